"""Per-token int8 quantization of activation rows (optionally after RMSNorm), as the W2A8 kernels consume them.

Matches `quant.ternary.quantize_activations` bit for bit: a = (1/amax) * 127 (torch evaluates `127 / t` as
`t.reciprocal() * 127`), q = round-half-even(x * a) clamped to [-128, 127].

- `_quant_kernel`: rows -> int8 [M, 4*Kp] (zero padded), a [M], rowsum [M]: the separate launch in front of the
  split-K / tiled GEMMs, the pre-quantized GEMVs and the fused q|k|v decode kernel;
- `_finish_quant_kernel`: the same launch when its rows are a deferred split-K projection's int32 sums
  (`deferred.SplitKSums`): it runs that projection's epilogue first;
- `_act_scale`, `_q8`: the two steps every quantizing kernel shares;
- `_quant_words`: one row straight into the int32 words of the four slabs (the fused row GEMV's prologue).
"""

from __future__ import annotations

import triton
import triton.language as tl

from bitnetlm.kernels.triton.common import (
    INTERPRET,
    _add_rn,
    _gated_epilogue_s,
    _pdl_wait,
    _rcp_rn,
    _rne,
    _scales,
    pdl_kw,
)
from bitnetlm.kernels.triton.plan import DecodePlan, resolve


@triton.jit
def _act_scale(amax, PTX: tl.constexpr):
    """a = RN(1 / max(amax, 1e-5)) * 127: the per-row activation scale."""
    return _rcp_rn(tl.maximum(amax, 1e-5), PTX) * 127.0


@triton.jit
def _sum_max(s0, m0, s1, m1):
    return s0 + s1, tl.maximum(m0, m1)


@triton.jit
def _ss_gmax(xx, xg, axis: tl.constexpr):
    """(sum of xx, max of xg) along axis in one reduction: the two block-wide reductions of an RMSNorm before an
    absmax quantization share one pass through shared memory and one barrier (the sum in tl.sum's order)."""
    return tl.reduce((xx, xg), axis, _sum_max)


@triton.jit
def _q8(x, a, PTX: tl.constexpr):
    """int8 codes (as int32) of x at scale a: round half to even, clamped to [-128, 127]."""
    q = _rne(x * a, PTX)
    return tl.minimum(tl.maximum(q, -128.0), 127.0).to(tl.int32)


# --------------------------------------------------------------------------------------------------------------
# quantize rows (optionally RMSNorm first): x [M, K] -> xq int8 [M, 4*Kp] (zero padded), a [M], rowsum [M]
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _quant_kernel(
    x_ptr,
    nw_ptr,
    q_ptr,
    a_ptr,
    rs_ptr,
    K,
    KPAD,
    stride_xm,
    stride_qm,
    eps,
    HAS_NORM: tl.constexpr,
    PTX: tl.constexpr,
    BK: tl.constexpr,
    PDL: tl.constexpr = False,
    LATE: tl.constexpr = False,
):
    m = tl.program_id(0)
    offs = tl.arange(0, BK)
    mk = offs < K
    # the norm weights: their DRAM round trip overlaps the previous kernel
    g = _norm_early(nw_ptr, offs, mk, HAS_NORM)
    # LATE: the next kernel launches only once the one before this has ended (`quant_launch_kw`)
    _pdl_wait(PDL, AFTER=LATE)
    x = tl.load(x_ptr + m * stride_xm + offs, mask=mk, other=0.0).to(tl.float32)
    _quant_row(x, g, m, offs, mk, q_ptr, a_ptr, rs_ptr, K, KPAD, stride_qm, eps, HAS_NORM, PTX)


@triton.jit
def _norm_early(nw_ptr, offs, mk, LOAD: tl.constexpr):
    """The norm weights [BK] loaded before the PDL wait (constant data), when LOAD; else a placeholder."""
    if LOAD:
        g = tl.load(nw_ptr + offs, mask=mk, other=0.0)
    else:
        g = mk.to(tl.float32)
    return g


@triton.jit
def _quant_row(
    x,
    g,
    m,
    offs,
    mk,
    q_ptr,
    a_ptr,
    rs_ptr,
    K,
    KPAD,
    stride_qm,
    eps,
    HAS_NORM: tl.constexpr,
    PTX: tl.constexpr,
):
    """Row m's values x [BK] (0 past K) -> its codes, a and row sum; g: the norm weights (`_norm_early`)."""
    if HAS_NORM:
        g = g.to(tl.float32)
        ss, gmax = _ss_gmax(x * x, tl.abs(x * g), 0)
        rstd = 1.0 / tl.sqrt_rn(ss / K + eps)
        amax = gmax * rstd
        x = (x * rstd) * g
    else:
        amax = tl.max(tl.abs(x), axis=0)
    a = _act_scale(amax, PTX)
    q = tl.where(mk, _q8(x, a, PTX), 0)
    tl.store(q_ptr + m * stride_qm + offs, q.to(tl.int8), mask=offs < KPAD)
    tl.store(a_ptr + m, a)
    tl.store(rs_ptr + m, tl.sum(q, axis=0))


# --------------------------------------------------------------------------------------------------------------
# a deferred split-K projection's row (deferred.SplitKSums: int32 sums the GEMM's programs added up) -> its
# epilogue (scales, activation, residual) and output row, then optionally that row's quantization
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _finish_quant_kernel(
    acc_ptr,
    ain_ptr,
    rsin_ptr,
    s_ptr,
    r_ptr,
    y_ptr,
    nw_ptr,
    q_ptr,
    a_ptr,
    rs_ptr,
    N,
    KPAD,
    stride_acc,
    stride_rm,
    stride_ym,
    stride_qm,
    eps,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    PER_ROW: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_NORM: tl.constexpr,
    QUANT: tl.constexpr,
    PTX: tl.constexpr,
    BK: tl.constexpr,
    PDL: tl.constexpr = False,
    LATE: tl.constexpr = False,
):
    """Row m: y = [r +] f((acc - rowsum) * s / a), as the split-K GEMM's last program would have stored it
    (`gemm._gemm_kernel`'s epilogue, the same operations), stored; the sums zeroed for the next producer; then,
    QUANT, `_quant_kernel`'s work on y as stored."""
    m = tl.program_id(0)
    offs = tl.arange(0, BK)
    mk = offs < N
    one = tl.arange(0, 1)  # [1]: the epilogue's per-row operands, as a one-row tile
    # constants: their DRAM round trips overlap the previous kernel
    s = _scales(s_ptr, offs, mk, PER_ROW)
    s2 = s
    if GATED:
        s2 = _scales(s_ptr, offs + N, mk, PER_ROW)
    g = _norm_early(nw_ptr, offs, mk, HAS_NORM)
    _pdl_wait(PDL, AFTER=LATE)
    accp = acc_ptr + m * stride_acc + offs
    acc = tl.load(accp, mask=mk, other=0)
    acc2 = acc
    if GATED:  # the up rows' sums, N columns on
        acc2 = tl.load(accp + N, mask=mk, other=0)
    ain = tl.load(ain_ptr + m + one)
    rsin = tl.load(rsin_ptr + m + one)
    # zero at rest for the next producer. The zeros may be stored by other threads than loaded these sums (the
    # compiler picks each tensor's layout): every load first
    tl.debug_barrier()
    tl.store(accp, tl.zeros_like(acc), mask=mk)
    if GATED:
        tl.store(accp + N, tl.zeros_like(acc), mask=mk)
    y = _gated_epilogue_s(acc[None, :], acc2[None, :], rsin, ain, s, s2, GATED, ACT, PER_ROW, PTX)
    y = tl.reshape(y, [BK])  # [1, BK] -> [BK]
    if HAS_RES:
        r = tl.load(r_ptr + m * stride_rm + offs, mask=mk, other=0.0)
        y = _add_rn(y, r.to(tl.float32), PTX)
    yt = y.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + m * stride_ym + offs, yt, mask=mk)
    if QUANT:
        x = tl.where(mk, yt.to(tl.float32), 0.0)  # the row as stored, as `_quant_kernel` would load it
        _quant_row(x, g, m, offs, mk, q_ptr, a_ptr, rs_ptr, N, KPAD, stride_qm, eps, HAS_NORM, PTX)


# --------------------------------------------------------------------------------------------------------------
# one row -> int32 words of the four slabs (four int8 codes a word), inside the fused row GEMV
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _slab_x(xrow, kk, mk):
    return tl.load(xrow + kk, mask=mk, other=0.0).to(tl.float32)


@triton.jit
def _slab_q(x, g, rstd, a, offs_j, HAS_NORM: tl.constexpr, PTX: tl.constexpr):
    if HAS_NORM:
        x = (x * rstd) * g
    q = _q8(x, a, PTX)
    return tl.sum((q & 255) << (offs_j * 8)[None, :], axis=1), tl.sum(q, axis=1)  # words, row sums [KWP]


@triton.jit
def _quant_words(xrow, nw_ptr, K, KW, eps, offs_w, mw, HAS_NORM: tl.constexpr, PTX: tl.constexpr):
    """One activation row -> int8 words of the four slabs ([KWP] int32 each), a, and the codes' sums per word
    position ([KWP]: the row sum in parts, which `gemv._row_dot` subtracts before its own reduction, so that no
    block-wide reduction runs for the row sum; codes and a as `_quant_kernel`'s). With a norm: its weights, then
    `_quant_words_g`."""
    if HAS_NORM:
        g0, g1, g2, g3 = _norm_slabs(nw_ptr, K, KW, offs_w, mw)
        w0, w1, w2, w3, a, rw = _quant_words_g(xrow, g0, g1, g2, g3, K, KW, eps, offs_w, mw, PTX)
    else:
        offs_j = tl.arange(0, 4)
        kk = offs_w[:, None] * 4 + offs_j[None, :]  # [KWP, 4] index in slab 0
        kp = 4 * KW
        x0 = _slab_x(xrow, kk, (kk < K) & mw[:, None])
        x1 = _slab_x(xrow, kk + kp, (kk + kp < K) & mw[:, None])
        x2 = _slab_x(xrow, kk + 2 * kp, (kk + 2 * kp < K) & mw[:, None])
        x3 = _slab_x(xrow, kk + 3 * kp, (kk + 3 * kp < K) & mw[:, None])
        am = tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3)))
        amax = tl.max(tl.max(am, axis=1), axis=0)
        a = _act_scale(amax, PTX)
        w0, r0 = _slab_q(x0, x0, amax, a, offs_j, False, PTX)
        w1, r1 = _slab_q(x1, x1, amax, a, offs_j, False, PTX)
        w2, r2 = _slab_q(x2, x2, amax, a, offs_j, False, PTX)
        w3, r3 = _slab_q(x3, x3, amax, a, offs_j, False, PTX)
        rw = r0 + r1 + r2 + r3
    return w0, w1, w2, w3, a, rw


@triton.jit
def _norm_slabs(nw_ptr, K, KW, offs_w, mw):
    """The RMSNorm weights of the four slabs (float32 [KWP, 4] each), as `_quant_words` indexes them: constant
    data, which a row kernel may load before its PDL wait (`_quant_words_g`)."""
    kk = offs_w[:, None] * 4 + tl.arange(0, 4)[None, :]  # [KWP, 4] index in slab 0
    kp = 4 * KW
    g0 = tl.load(nw_ptr + kk, mask=(kk < K) & mw[:, None], other=0.0).to(tl.float32)
    g1 = tl.load(nw_ptr + kk + kp, mask=(kk + kp < K) & mw[:, None], other=0.0).to(tl.float32)
    g2 = tl.load(nw_ptr + kk + 2 * kp, mask=(kk + 2 * kp < K) & mw[:, None], other=0.0).to(tl.float32)
    g3 = tl.load(nw_ptr + kk + 3 * kp, mask=(kk + 3 * kp < K) & mw[:, None], other=0.0).to(tl.float32)
    return g0, g1, g2, g3


@triton.jit
def _quant_words_g(xrow, g0, g1, g2, g3, K, KW, eps, offs_w, mw, PTX: tl.constexpr):
    """`_quant_words` with a norm whose slab weights g* are already loaded (`_norm_slabs`): the same operations
    in the same order, so the same words, a and row sums."""
    offs_j = tl.arange(0, 4)
    kk = offs_w[:, None] * 4 + offs_j[None, :]  # [KWP, 4] index in slab 0
    kp = 4 * KW
    x0 = tl.load(xrow + kk, mask=(kk < K) & mw[:, None], other=0.0).to(tl.float32)
    x1 = tl.load(xrow + kk + kp, mask=(kk + kp < K) & mw[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(xrow + kk + 2 * kp, mask=(kk + 2 * kp < K) & mw[:, None], other=0.0).to(tl.float32)
    x3 = tl.load(xrow + kk + 3 * kp, mask=(kk + 3 * kp < K) & mw[:, None], other=0.0).to(tl.float32)
    am = tl.maximum(
        tl.maximum(tl.abs(x0 * g0), tl.abs(x1 * g1)), tl.maximum(tl.abs(x2 * g2), tl.abs(x3 * g3))
    )
    ss, gmax = _ss_gmax(tl.sum(x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3, axis=1), tl.max(am, axis=1), 0)
    rstd = 1.0 / tl.sqrt_rn(ss / K + eps)
    a = _act_scale(gmax * rstd, PTX)
    w0, r0 = _slab_q(x0, g0, rstd, a, offs_j, True, PTX)
    w1, r1 = _slab_q(x1, g1, rstd, a, offs_j, True, PTX)
    w2, r2 = _slab_q(x2, g2, rstd, a, offs_j, True, PTX)
    w3, r3 = _slab_q(x3, g3, rstd, a, offs_j, True, PTX)
    return w0, w1, w2, w3, a, r0 + r1 + r2 + r3


# --------------------------------------------------------------------------------------------------------------
# the int8 LM head's input: RMSNorm (rounded to the activations' dtype, as `norm.rmsnorm` stores it), then
# int16 codes per row split into two int8 halves for two int8 MMAs: q = 256 * hi + lo, hi and lo in [-127, 127]
# --------------------------------------------------------------------------------------------------------------
Q16_MAX = tl.constexpr(32639)  # 127 * 256 + 127: the largest code whose halves both fit in [-127, 127]


@triton.jit
def _quant16_kernel(
    x_ptr,
    nw_ptr,
    hi_ptr,
    lo_ptr,
    a_ptr,
    K,
    stride_xm,
    stride_qm,
    eps,
    HAS_NORM: tl.constexpr,
    BK: tl.constexpr,
    PTX: tl.constexpr,
    PDL: tl.constexpr = False,
):
    m = tl.program_id(0)
    offs = tl.arange(0, BK)
    mk = offs < K
    if HAS_NORM:  # constant: loaded while the previous kernel runs (`_quant_kernel`)
        g = tl.load(nw_ptr + offs, mask=mk, other=0.0)
    _pdl_wait(PDL)
    y = tl.load(x_ptr + m * stride_xm + offs, mask=mk, other=0.0).to(tl.float32)
    if HAS_NORM:
        g = g.to(tl.float32)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(y * y, axis=0) / K + eps)
        y = ((y * rstd) * g).to(x_ptr.dtype.element_ty).to(tl.float32)  # what rmsnorm would store
    a = _rcp_rn(tl.maximum(tl.max(tl.abs(y), axis=0), 1e-30), PTX) * float(Q16_MAX)
    q = tl.minimum(tl.maximum(_rne(y * a, PTX), -float(Q16_MAX)), float(Q16_MAX)).to(tl.int32)
    lo = ((q + 128) & 255) - 128
    hi = (q - lo) >> 8
    tl.store(hi_ptr + m * stride_qm + offs, hi.to(tl.int8), mask=mk)
    tl.store(lo_ptr + m * stride_qm + offs, lo.to(tl.int8), mask=mk)
    tl.store(a_ptr + m, a)


def _quant_warps(m: int, k: int, plan: DecodePlan) -> int:
    """The quantization launch's warps for m rows of k values (`DecodePlan.quant_wide_k`, `quant_narrow_max_m`)."""
    if INTERPRET:
        return 1
    return plan.quant_warps or (8 if k <= plan.quant_wide_k and m <= plan.quant_narrow_max_m else 16)


def quant_launch_kw(m: int, k: int, late: bool, plan: DecodePlan | None = None) -> dict:
    """The launch options of a quantization launch of m rows of k values, plain (`launch.launch_quant`) or
    finishing a deferred projection (`deferred.launch_finish`): warps, and the PDL trigger's place (late: after its
    own wait, as from `plan.quant_late_min_m` to `quant_late_max_m` rows)."""
    plan = resolve(plan)
    late = late or plan.quant_late_min_m <= m <= plan.quant_late_max_m
    return dict(num_warps=_quant_warps(m, k, plan), LATE=late, **pdl_kw(plan))
