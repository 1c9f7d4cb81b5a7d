"""Launchers of the optional int8 (per-row scaled) LM head: over bf16 activations (`w8_linear`), over int16
activation codes as two int8 MMAs (`quantize16`, `w8a16_linear`, the engine's), its logits reduced inside its
tiles (`w8a16_argmax`), and the greedy decode step folded into it (`w8a16_greedy`). The kernels are in gemm.py
and quant.py; tiles are tuned per power-of-two bucket of rows (tune._w8_candidates). Every launcher takes the
step's `DecodePlan` (`plan=`, None: the default plan) for its launch options.
"""

from __future__ import annotations

import torch
import triton

from bitnetlm.kernels.triton.common import INTERPRET, PTX, pdl_kw
from bitnetlm.kernels.triton.gemm import _w8_kernel, _w8a16_kernel
from bitnetlm.kernels.triton.plan import DecodePlan
from bitnetlm.kernels.triton.quant import _quant16_kernel
from bitnetlm.kernels.triton.tune import _next_pow2, _tune, _w8_candidates


def w8_linear(
    x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, cfg: dict | None = None, plan: DecodePlan | None = None
) -> torch.Tensor:
    """float32 [..., N] = (x in bf16) @ (int8 w [N, K])^T * s[N]: the int8 LM head (tiles tuned per M bucket,
    or `cfg`, one of `tune._w8_candidates`, for tests)."""
    k = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], w.shape[0]
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)

    def launch(cfg: dict, w: torch.Tensor) -> None:
        grid = (triton.cdiv(n, cfg["BN"]), triton.cdiv(m, cfg["BM"]))
        _w8_kernel[grid](x2, w, s, y, m, n, k, x2.stride(0), y.stride(0), PTX=PTX, **cfg, **pdl_kw(plan))

    key = ("w8", n, k, min(_next_pow2(m), 1024))  # tune per power-of-two bucket of M
    launch(cfg or _tune(key, lambda: _w8_candidates(m), launch, w), w)
    return y.reshape(*lead, n)


def quantize16(
    x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float = 1e-5, plan: DecodePlan | None = None
):
    """RMSNorm (rounded to x's dtype; none without `norm_weight`) then int16 codes per row as two int8 halves:
    (hi, lo int8 [M, K], a float32 [M]) with rmsnorm(x) ~= (256 * hi + lo) / a."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    hi = torch.empty((m, k), dtype=torch.int8, device=x.device)
    lo = torch.empty_like(hi)
    a = torch.empty((m,), dtype=torch.float32, device=x.device)
    nw = 1 if INTERPRET else (8 if k > 4096 else 4)
    _quant16_kernel[(m,)](
        x2,
        x2 if norm_weight is None else norm_weight,
        hi,
        lo,
        a,
        k,
        x2.stride(0),
        hi.stride(0),
        eps,
        HAS_NORM=norm_weight is not None,
        BK=triton.next_power_of_2(k),
        PTX=PTX,
        num_warps=nw,
        **pdl_kw(plan),
    )
    return hi, lo, a


def w8a16_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    s: torch.Tensor,
    cfg: dict | None = None,
    plan: DecodePlan | None = None,
) -> torch.Tensor:
    """float32 [..., N] = rmsnorm(x) as int16 codes @ (int8 w [N, K])^T * s[N]: the int8 LM head by two int8 MMAs
    (no weight conversion). `cfg`: one of `tune._w8_candidates`, for tests."""
    k = x.shape[-1]
    lead = x.shape[:-1]
    hi, lo, a = quantize16(x, norm_weight, eps, plan)
    m, n = hi.shape[0], w.shape[0]
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)

    def launch(cfg: dict, w: torch.Tensor) -> None:
        _w8a16_launch(hi, lo, a, w, s, y, y, m, n, k, y.stride(0), cfg, plan)

    key = ("w8a16", n, k, min(_next_pow2(m), 1024))
    launch(cfg or _tune(key, lambda: _w8_candidates(m), launch, w), w)
    return y.reshape(*lead, n)


def w8a16_argmax(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    s: torch.Tensor,
    cfg: dict | None = None,
    plan: DecodePlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`w8a16_linear`'s logits reduced inside its tiles, never stored: (float32 maxima, int32 indices), both
    [M, T], the maximum of each row over each tile of BN vocabulary entries (T tiles, in vocabulary order) and its
    first index; a NaN ranks above every number (the first one wins), as `torch.argmax`. The row's argmax is then
    indices[r, argmax(maxima[r])] (`ends.greedy_step(..., index=)`). x [M, K]."""
    hi, lo, a = quantize16(x, norm_weight, eps, plan)  # [M, K] rows
    launch, bufs = _argmax_launcher(hi, lo, a, s, w.shape[0], plan)
    cfg = cfg or _argmax_tune(hi, w, launch)
    launch(cfg, w)
    return bufs[triton.cdiv(w.shape[0], cfg["BN"])]


def _argmax_launcher(hi, lo, a, s, n: int, plan: DecodePlan | None = None):
    """`w8a16_argmax`'s launch(cfg, w) over the int16 codes hi / lo [M, K] and scales a, and the (maxima, indices)
    it writes, by tile count (one pair a tile width)."""
    m, k = hi.shape
    bufs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def launch(cfg: dict, w: torch.Tensor) -> None:
        t = triton.cdiv(n, cfg["BN"])
        if t not in bufs:
            bufs[t] = (
                torch.empty((m, t), dtype=torch.float32, device=hi.device),
                torch.empty((m, t), dtype=torch.int32, device=hi.device),
            )
        ym, yi = bufs[t]
        _w8a16_launch(hi, lo, a, w, s, ym, yi, m, n, k, t, cfg, plan, ARGMAX=True)

    return launch, bufs


def _argmax_tune(hi: torch.Tensor, w: torch.Tensor, launch) -> dict:
    """The tile of `w8a16_argmax` (and of `w8a16_greedy`, which uses its choice) for hi's M rows."""
    m, k = hi.shape
    key = ("w8a16_argmax", w.shape[0], k, min(_next_pow2(m), 1024))
    return _tune(key, lambda: _w8_candidates(m), launch, w)


def _w8a16_launch(
    hi, lo, a, w, s, y, yi, m: int, n: int, k: int, stride_y: int, cfg: dict, plan, fold=(), **kw
) -> None:
    """One `_w8a16_kernel` launch of tile cfg; fold: (best, cnt, tok, out, step, pos) for FOLD."""
    best, cnt, tok, out, step, pos = fold or (y,) * 6  # (unused pointers without FOLD)
    stride_out = out.stride(0) if fold else 0
    grid = (triton.cdiv(n, cfg["BN"]), triton.cdiv(m, cfg["BM"]))
    _w8a16_kernel[grid](
        hi, lo, a, w, s, y, yi, m, n, k, hi.stride(0), stride_y, best, cnt, tok, out, stride_out, step, pos,
        FOLD=bool(fold), **cfg, **kw, **pdl_kw(plan),
    )  # fmt: skip


_fold_ws: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def w8a16_greedy(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    s: torch.Tensor,
    tok: torch.Tensor,
    out: torch.Tensor,
    step: torch.Tensor,
    pos: torch.Tensor,
    cfg: dict | None = None,
    plan: DecodePlan | None = None,
) -> None:
    """The int8 head and the greedy step in one launch: tok[:, 0] = out[:, step] = argmax of each row's logits
    (`w8a16_argmax`'s rule and tiles; the logits are never stored), pos += 1, step += 1, as
    `ends.greedy_step(*w8a16_argmax(...), tok, out, step, pos, index=)` does in two. The tiles are tuned as
    `w8a16_argmax`'s (the fold's own launches would advance the state). tok int64 [M, 1], out int64 [M, S], step
    int64 [1], pos int32 [M]."""
    hi, lo, a = quantize16(x, norm_weight, eps, plan)
    (m, k), n = hi.shape, w.shape[0]
    cfg = cfg or _argmax_tune(hi, w, _argmax_launcher(hi, lo, a, s, n, plan)[0])  # timed without FOLD
    ws = (str(x.device), m)
    if ws not in _fold_ws:  # zeroed once, before any graph capture; every launch leaves them zero
        _fold_ws[ws] = (
            torch.zeros((m,), dtype=torch.uint64, device=x.device),
            torch.zeros((1,), dtype=torch.int32, device=x.device),
        )
    best, cnt = _fold_ws[ws]
    fold = (best, cnt, tok, out, step, pos)
    bmr = min(_next_pow2(m), 64)
    _w8a16_launch(hi, lo, a, w, s, a, a, m, n, k, 0, cfg, plan, fold=fold, ARGMAX=True, BMR=bmr)
