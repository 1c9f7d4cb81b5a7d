"""The samplers' reductions over each row's vocabulary: argmax, logsumexp and top-k, wide on CUDA.

PyTorch runs argmax and log_softmax over a row in one thread block, and its top-k over a 128k row in several
radix passes: at batch 1 on an H200 (2B4T, 128k vocabulary) a greedy sampler's graph took 65 us of which argmax
27 and log_softmax 29, and llama.cpp's sampler 154 us, its top-k about 45 of them (.scratch profile, PERF_LOG
stop 55). On CUDA these run over the whole GPU instead: argmax and logsumexp in one Triton pass
(`kernels.triton.sampler.logit_stats`), top-k over chunks of the row, then over the chunks' winners. Elsewhere (CPU,
no Triton) they are PyTorch's own ops. A row with a top-k also draws its token in one launch after its top-k
(`candidate_draw`). The results are the same ones (argmax: the first index of the maximum;
top-k: the k largest, descending); only a logsumexp's last bits may differ from PyTorch's.
"""

from __future__ import annotations

import os

import torch

# False (or the environment's BITNETLM_WIDE_SAMPLER=0, for benchmarks' A/B): PyTorch's own ops on CUDA too.
WIDE = os.environ.get("BITNETLM_WIDE_SAMPLER", "1") != "0"
# A row is cut into chunks of this many entries for top-k (k up to a chunk's eighth); shorter rows, and every row
# off CUDA, go through torch.topk whole.
TOPK_CHUNK = 2048
TOPK_MIN_V = 16384
_triton: list[bool] = []


def wide(x: torch.Tensor) -> bool:
    """Whether x's reductions take the wide CUDA path (WIDE, a CUDA tensor and a working Triton)."""
    if not (WIDE and x.is_cuda):
        return False
    if not _triton:
        try:
            import bitnetlm.kernels.triton.sampler  # noqa: F401
        except ImportError:
            _triton.append(False)
        else:
            _triton.append(True)
    return _triton[0]


def argmax_logsumexp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, V] -> (argmax [B] long, logsumexp [B] float32 of x in float32), one pass over x on CUDA."""
    if wide(x) and x.stride(-1) == 1:
        from bitnetlm.kernels.triton.sampler import logit_stats

        return logit_stats(x)
    return x.argmax(dim=-1), torch.logsumexp(x.float(), dim=-1)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] -> the first index of each row's maximum [B] (torch.argmax's)."""
    if wide(x) and x.stride(-1) == 1:
        return argmax_logsumexp(x)[0]
    return x.argmax(dim=-1)


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) [B, k] of each row's k largest entries, descending (torch.topk's)."""
    if not wide(x) or x.shape[1] < TOPK_MIN_V or k > TOPK_CHUNK // 8:
        return x.topk(k, dim=-1)
    return chunked_topk(x, k, TOPK_CHUNK)


def chunked_topk(x: torch.Tensor, k: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk of each row of x [B, V] from the top-k of its chunks of c entries (k <= c): a row's k largest
    are among its chunks' k largest. Many short rows run wide where one long row runs in a few blocks."""
    b, v = x.shape
    n = v // c
    vals, idx = x[:, : n * c].reshape(b, n, c).topk(k, dim=-1)  # [B, n, k] each chunk's best
    idx = idx + torch.arange(0, n * c, c, device=x.device)[None, :, None]
    vals, idx = vals.reshape(b, n * k), idx.reshape(b, n * k)
    if n * c < v:  # the short last chunk
        tv, ti = x[:, n * c :].topk(min(k, v - n * c), dim=-1)
        vals, idx = torch.cat([vals, tv], dim=1), torch.cat([idx, ti + n * c], dim=1)
    best, j = vals.topk(k, dim=-1)  # [B, k] among the chunks' winners
    return best, idx.gather(1, j)


def candidate_draw(x: torch.Tensor, t, u: torch.Tensor) -> torch.Tensor:
    """CUDA only (`wide`): tokens [B] of `sampling.choose`'s rows with a top-k, drawn at u [B] among their t.kmax
    best (t: the rows' `sampling.RowTensors`), as `sampling._candidate_probs` and `_draw_sorted` draw them."""
    from bitnetlm.kernels.triton.sampler import candidate_draw as draw

    vals, order = topk(x, t.kmax)
    return draw(vals.float(), order, t.temps[:, 0], t.k, t.top_p, t.min_p, u, t.scale, t.need_p)
