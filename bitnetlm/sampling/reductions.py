"""The samplers' reductions over each row's vocabulary, wide on CUDA: argmax, logsumexp, and a top-k row's draw.

PyTorch runs argmax and log_softmax over a row in one thread block: at batch 1 on an H200 (128k vocabulary) 26.5
and 28.9 us, of a greedy sampler graph's 65.7 (docs/PERF_LOG.md, 2026-12-02). On CUDA both
come from one Triton pass over the row's chunks spread over the GPU (`kernels.triton.sampler.logit_stats`, 4.2
us), and a row with a top-k draws its token (temperature, top-p, min-p, the draw) in one launch after its top-k
(`candidate_draw`) instead of some twenty small ones. Top-k stays torch.topk: a top-k over chunks of the row,
then over their winners, measured 0.84x / 0.47x its speed (k 40, batch 1 / 32), and one that sorts chunks 0.52x
/ 0.23x (docs/PERF_LOG.md, 2026-12-02 and 12-03). Elsewhere (CPU, no Triton) they are PyTorch's own ops. The results are
the same (argmax: the first index of the maximum; the draw: the host sampler's ops' token), but for a logsumexp's
last bits.
"""

from __future__ import annotations

import torch

_triton: list[bool] = []


def wide(x: torch.Tensor) -> bool:
    """Whether x's reductions take the wide CUDA path (a CUDA tensor and a working Triton)."""
    if not x.is_cuda:
        return False
    if not _triton:
        try:
            import bitnetlm.kernels.triton.sampler  # noqa: F401
        except ImportError:
            _triton.append(False)
        else:
            _triton.append(True)
    return _triton[0]


def _wide_rows(x: torch.Tensor) -> bool:
    """Whether the row kernels take x [B, V]: the wide path and a unit stride along the vocabulary."""
    return wide(x) and x.stride(-1) == 1


def argmax_logsumexp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, V] -> (argmax [B] long, logsumexp [B] float32 of x in float32), one pass over x on CUDA."""
    if _wide_rows(x):
        from bitnetlm.kernels.triton.sampler import logit_stats

        return logit_stats(x)
    return x.argmax(dim=-1), torch.logsumexp(x.float(), dim=-1)


def greedy_sample(x: torch.Tensor, tok, lp, next_tok, step) -> bool:
    """On the wide path, a greedy sampler's step over logits x [B, V] in one pass: tok [B] = the argmax, lp [B] =
    its raw log-probability, next_tok [B, 1] = the token, step [B] += 1 (`GraphSampler`'s all-greedy rows).
    Returns False, doing nothing, off it."""
    if not _wide_rows(x):
        return False
    from bitnetlm.kernels.triton.sampler import greedy_sample as fused

    fused(x, tok, lp, next_tok, step)
    return True


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] -> the first index of each row's maximum [B] (torch.argmax's)."""
    if _wide_rows(x):
        return argmax_logsumexp(x)[0]
    return x.argmax(dim=-1)


def candidate_draw(x: torch.Tensor, t, u: torch.Tensor) -> torch.Tensor:
    """CUDA only (`wide`): tokens [B] of `sampling.choose`'s rows with a top-k, drawn at u [B] among their t.kmax
    best (t: the rows' `sampling.RowTensors`), as `sampling._candidate_probs` and `_draw_sorted` draw them."""
    from bitnetlm.kernels.triton.sampler import candidate_draw as draw

    vals, order = x.topk(t.kmax, dim=-1)
    return draw(vals.float(), order, t.temps[:, 0], t.k, t.top_p, t.min_p, u, t.scale, t.need_p)


# The top-k classes `warm` compiles the draw for (the kernel's block: the power of 2 >= k, at least 16): top-k 1-128,
# which holds llama.cpp's 40, transformers' 50, and 20 and 100. Each class costs about 0.8-1.0 s of a start with an
# empty Triton cache and 0.01 s with a full one (H200, docs/PERF_LOG.md, 2026-12-03); a larger top-k compiles its class on
# first use.
WARM_TOPK = (16, 32, 64, 128)


def warm(x: torch.Tensor, kmaxes: tuple[int, ...] = WARM_TOPK) -> None:
    """Compile the wide kernels for logits like x [B, V] and allocate their workspaces, before any request needs
    them: the argmax + logsumexp pass and the greedy sampler's for every batch 1..B (a variant for each width of the
    chunks' merge) and, once for each top-k class of `kmaxes`, a top-k row's draw with and without a temperature
    and top-p / min-p (which no batch changes). A server calls it at start, so that no sampled step waits for
    Triton's compiler (the first 32 prompts at once: 0.6-0.9 s on an H200, serve_load.py, docs/PERF_LOG.md stop
    57). Nothing off the wide path."""
    if not wide(x):
        return
    from bitnetlm.kernels.triton.sampler import candidate_draw as draw

    dev = x.device
    n = x.shape[0]
    tok, step = (torch.zeros((n,), dtype=torch.long, device=dev) for _ in range(2))  # scratch outputs
    lp, nt = torch.zeros((n,), device=dev), torch.zeros((n, 1), dtype=torch.long, device=dev)
    for b in range(1, n + 1):
        argmax_logsumexp(x[:b])
        greedy_sample(x[:b], tok[:b], lp[:b], nt[:b], step[:b])
    ones = torch.ones((1,), dtype=torch.float32, device=dev)
    u = torch.zeros((1,), dtype=torch.float64, device=dev)
    for kmax in kmaxes:
        vals, order = x[:1, :kmax].float().contiguous(), torch.zeros((1, kmax), dtype=torch.long, device=dev)
        k = torch.full((1,), kmax, dtype=torch.long, device=dev)
        for scale in (False, True):
            for need_p in (False, True):
                draw(vals, order, ones, k, ones * 2, ones * 0, u, scale, need_p)
