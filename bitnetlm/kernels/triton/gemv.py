"""Decode GEMVs (M <= 16 activation rows) over the triton-2bit-v1 layout: CUDA-core `dp4a` on int32 words.

- `_gemv_kernel`: a K loop over BKW words a trip; each program re-derives the row statistics (absmax, and the
  RMSNorm rstd when a norm weight is fused) and quantizes on the fly, so no separate quantization launch exists,
  or (PREQ, the "gemv8" path) reads rows pre-quantized by `quant._quant_kernel` (cheaper when K is large: no
  program re-derives the statistics);
- `_gemv_row_kernel`: each program owns BN whole output rows, all its weight words loaded in one shot before
  anything else (M <= 2; `decode._qkv_rope_kernel` is its q|k|v + RoPE variant).
Epilogues: the float scale s/a, per-output-row scales, act(gate) * up for concatenated gate|up weights, residual.
"""

from __future__ import annotations

import triton
import triton.language as tl

from bitnetlm.kernels.triton.common import (
    _activate,
    _add_rn,
    _div_rn,
    _dp4a,
    _gated_epilogue,
    _pdl_wait,
    _prefetch_l2,
    _store_out,
)
from bitnetlm.kernels.triton.quant import _act_scale, _norm_slabs, _q8, _quant_words, _quant_words_g


@triton.jit
def _dp4a_slab(
    xb, wv, acc, I: tl.constexpr, PTX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr
):
    """acc [BM, BN, BKW] += dp4a(activation words xb, the slab-I codes of weight words wv [BN, BKW])."""
    c = tl.broadcast_to(((wv >> (2 * I)) & 0x03030303)[None, :, :], [BM, BN, BKW])
    return _dp4a(xb, c, acc, PTX)


# --------------------------------------------------------------------------------------------------------------
# GEMV: M <= 16 rows, a K loop of BKW words a trip; quantization fused (PREQ=False) or from `_quant_kernel` (PREQ)
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _gemv_kernel(
    x_ptr,
    nw_ptr,
    q_ptr,
    a_ptr,
    rs_ptr,
    w_ptr,
    s_ptr,
    r_ptr,
    y_ptr,
    M,
    N,
    K,
    KW,  # N: output features (per half when GATED); KW: int32 words per packed row
    stride_xm,
    stride_qw,
    stride_rm,
    stride_ym,
    eps,
    PREQ: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_RES: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    PER_ROW: tl.constexpr,
    PTX: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BKW: tl.constexpr,
    SBK: tl.constexpr = 128,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BM)
    mask_m = offs_m < M
    x_rows = x_ptr + offs_m * stride_xm  # [BM]
    if not PREQ:
        # pass 1: per-row statistics (sum of squares for the norm, absmax of the normed activations)
        sumsq = tl.zeros([BM], tl.float32)
        amax = tl.zeros([BM], tl.float32)
        for k0 in range(0, K, SBK):
            offs_k = k0 + tl.arange(0, SBK)
            mk = offs_k < K
            x = tl.load(x_rows[:, None] + offs_k[None, :], mask=mask_m[:, None] & mk[None, :], other=0.0).to(
                tl.float32
            )
            if HAS_NORM:
                g = tl.load(nw_ptr + offs_k, mask=mk, other=0.0).to(tl.float32)
                sumsq += tl.sum(x * x, axis=1)
                x = x * g[None, :]
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        rstd = tl.zeros([BM], tl.float32)
        if HAS_NORM:
            rstd = 1.0 / tl.sqrt_rn(sumsq / K + eps)
            amax = amax * rstd
        a = _act_scale(amax, PTX)  # [BM]

    # pass 2: activation words (quantized on the fly, or loaded) dp4a against the packed weight words
    offs_n = pid * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    offs_j = tl.arange(0, 4)
    acc = tl.zeros([BM, BN, BKW], tl.int32)
    acc2 = tl.zeros([BM, BN, BKW], tl.int32)
    rs = tl.zeros([BM, BKW], tl.int32)
    for w0 in range(0, KW, BKW):
        offs_w = w0 + tl.arange(0, BKW)
        mw = mask_n[:, None] & (offs_w < KW)[None, :]
        wv = tl.load(w_ptr + offs_n[:, None] * KW + offs_w[None, :], mask=mw, other=0)  # [BN, BKW] int32
        if GATED:
            wv2 = tl.load(w_ptr + (offs_n + N)[:, None] * KW + offs_w[None, :], mask=mw, other=0)
        for i in tl.static_range(4):
            if PREQ:
                xw = tl.load(
                    q_ptr + offs_m[:, None] * stride_qw + (i * KW + offs_w)[None, :],
                    mask=mask_m[:, None] & (offs_w < KW)[None, :],
                    other=0,
                )  # [BM, BKW] four int8 activations per word
            else:
                kk = (
                    i * (4 * KW) + offs_w[:, None] * 4 + offs_j[None, :]
                )  # [BKW, 4] activation index of slab i
                mkk = (kk < K) & (offs_w < KW)[:, None]
                x = tl.load(
                    x_rows[:, None, None] + kk[None, :, :],
                    mask=mask_m[:, None, None] & mkk[None, :, :],
                    other=0.0,
                )
                x = x.to(tl.float32)
                if HAS_NORM:
                    g = tl.load(nw_ptr + kk, mask=mkk, other=0.0).to(tl.float32)
                    x = (x * rstd[:, None, None]) * g[None, :, :]
                q = _q8(x, a[:, None, None], PTX)
                xw = tl.sum((q & 255) << (offs_j * 8)[None, None, :], axis=2)  # [BM, BKW] four int8 per word
                rs += tl.sum(q, axis=2)
            xb = tl.broadcast_to(xw[:, None, :], [BM, BN, BKW])
            acc = _dp4a_slab(xb, wv, acc, i, PTX, BM, BN, BKW)
            if GATED:
                acc2 = _dp4a_slab(xb, wv2, acc2, i, PTX, BM, BN, BKW)
    if PREQ:
        a = tl.load(a_ptr + offs_m, mask=mask_m, other=1.0)
        rsum = tl.load(rs_ptr + offs_m, mask=mask_m, other=0)
    else:
        rsum = tl.sum(rs, axis=1)
    acc1 = tl.sum(acc, axis=2)
    y = _gated_epilogue(
        acc1, tl.sum(acc2, axis=2), rsum, a, s_ptr, offs_n, mask_n, N, GATED, ACT, PER_ROW, PTX
    )
    _store_out(y, r_ptr, y_ptr, offs_m, offs_n, mask_m, mask_n, stride_rm, stride_ym, HAS_RES, PTX)


# --------------------------------------------------------------------------------------------------------------
# Row GEMV (decode, small M): each program owns BN whole output rows. Its packed weight words [BN, KWP] are
# loaded in one shot before anything else (every load in flight at once, no K loop), then the activation row
# is quantized into int32 words once per program (PREQ=False: norm + absmax + rounding fused, no extra launch)
# or read pre-quantized from `_quant_kernel` (PREQ=True), and dp4a runs over the four slabs. Pre-quantized, a row
# whose words are not a power of two runs as two parts, KWP + KWB words (`launch._row_parts`).
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _row_dot(xw0, xw1, xw2, xw3, wv, rw, PTX: tl.constexpr):
    """sum_k x_k * c_k - rw-parts for each of the BN weight rows (codes c = t + 1) -> [BN] int32. rw [KWP]: the
    activation codes' sums per word position (`quant._quant_words`), subtracted before the one reduction so that
    it yields X @ T directly; zeros when the row sum comes whole (`_load_qrow`)."""
    acc = _dp4a(tl.broadcast_to(xw0[None, :], wv.shape), wv & 0x03030303, tl.zeros_like(wv), PTX)
    acc = _dp4a(tl.broadcast_to(xw1[None, :], wv.shape), (wv >> 2) & 0x03030303, acc, PTX)
    acc = _dp4a(tl.broadcast_to(xw2[None, :], wv.shape), (wv >> 4) & 0x03030303, acc, PTX)
    acc = _dp4a(tl.broadcast_to(xw3[None, :], wv.shape), (wv >> 6) & 0x03030303, acc, PTX)
    return tl.sum(acc - rw[None, :], axis=1)


@triton.jit
def _row_scale(dot, rs, a, s, PTX: tl.constexpr):
    """Float outputs [BN] of the integer sums dot [BN] (less the row sum rs) at activation scale a, weight scales s."""
    return (dot - rs).to(tl.float32) * _div_rn(s, a + tl.zeros_like(s), PTX)


@triton.jit
def _row_out(xw0, xw1, xw2, xw3, wv, rw, rs, a, s, PTX: tl.constexpr):
    """Float outputs [BN] of one activation row (words xw*, scale a, row sum rw-parts + rs) through weight words wv."""
    return _row_scale(_row_dot(xw0, xw1, xw2, xw3, wv, rw, PTX), rs, a, s, PTX)


@triton.jit
def _row_scales(s_ptr, offs_n, mask_n, PER_ROW: tl.constexpr):
    """The weight scales of rows offs_n [BN]: per row, or the one per-tensor scale broadcast."""
    if PER_ROW:
        return tl.load(s_ptr + offs_n, mask=mask_n, other=1.0)
    return tl.load(s_ptr) + tl.zeros(offs_n.shape, tl.float32)


@triton.jit
def _load_qrow(qrow, a_ptr, rs_ptr, KW, offs_w, mw):
    """One pre-quantized row (`_quant_kernel` output viewed as int32 words): the four slabs' words, a, no row sum
    parts (zeros [KWP]), the row sum."""
    xw0 = tl.load(qrow + offs_w, mask=mw, other=0)
    xw1 = tl.load(qrow + KW + offs_w, mask=mw, other=0)
    xw2 = tl.load(qrow + 2 * KW + offs_w, mask=mw, other=0)
    xw3 = tl.load(qrow + 3 * KW + offs_w, mask=mw, other=0)
    return xw0, xw1, xw2, xw3, tl.load(a_ptr), tl.zeros_like(offs_w), tl.load(rs_ptr)


@triton.jit
def _row_words(
    x_ptr,
    nw_ptr,
    q_ptr,
    a_ptr,
    rs_ptr,
    g0,
    g1,
    g2,
    g3,
    K,
    KW,
    eps,
    offs_w,
    mw,
    PREQ: tl.constexpr,
    HAS_NORM: tl.constexpr,
    EARLY_NORM: tl.constexpr,
    PTX: tl.constexpr,
):
    """One activation row for the row kernels: words, a, row sum parts, row sum. Pre-quantized (PREQ), or
    normalized and quantized here with the norm weights g* loaded before the wait (EARLY_NORM) or now."""
    if PREQ:
        xw0, xw1, xw2, xw3, a, rw, rs = _load_qrow(q_ptr, a_ptr, rs_ptr, KW, offs_w, mw)
    else:
        if EARLY_NORM:
            xw0, xw1, xw2, xw3, a, rw = _quant_words_g(x_ptr, g0, g1, g2, g3, K, KW, eps, offs_w, mw, PTX)
        else:
            xw0, xw1, xw2, xw3, a, rw = _quant_words(x_ptr, nw_ptr, K, KW, eps, offs_w, mw, HAS_NORM, PTX)
        rs = 0  # the row sum comes in rw's parts
    return xw0, xw1, xw2, xw3, a, rw, rs


@triton.jit
def _gemv_row_kernel(
    x_ptr,
    nw_ptr,
    q_ptr,
    a_ptr,
    rs_ptr,
    w_ptr,
    s_ptr,
    r_ptr,
    y_ptr,
    M,
    N,
    K,
    KW,  # N: output features (per half when GATED); KW: int32 words per packed row
    stride_xm,
    stride_qw,
    stride_rm,
    stride_ym,
    eps,
    PREQ: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_RES: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    PER_ROW: tl.constexpr,
    PTX: tl.constexpr,
    BN: tl.constexpr,
    KWP: tl.constexpr,
    PDL: tl.constexpr = False,
    EARLY_NORM: tl.constexpr = False,
    KWB: tl.constexpr = 0,
    BN2: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    offs_n = pid * (BN + BN2) + tl.arange(0, BN)
    mask_n = offs_n < N
    offs_w = tl.arange(0, KWP)
    mw = offs_w < KW
    wm = mask_n[:, None] & mw[None, :]
    wv = tl.load(w_ptr + offs_n[:, None] * KW + offs_w[None, :], mask=wm, other=0)  # [BN, KWP] int32
    # BN2: a program's rows past the first BN as a second [BN2] part, so that 2,560 rows run as 128 programs of
    # 16 + 4 on 132 SMs, not 80 of 32 (`launch._row_tiles`)
    tl.static_assert(BN2 == 0 or (KWB == 0 and not GATED), "a second rows part only for plain one-part rows")
    if BN2 > 0:
        offs_n2 = pid * (BN + BN2) + BN + tl.arange(0, BN2)
        mask_n2 = offs_n2 < N
        wm2 = mask_n2[:, None] & mw[None, :]
        wvn = tl.load(w_ptr + offs_n2[:, None] * KW + offs_w[None, :], mask=wm2, other=0)  # [BN2, KWP]
        sn = _row_scales(s_ptr, offs_n2, mask_n2, PER_ROW)
    if GATED:
        wv2 = tl.load(w_ptr + (offs_n + N)[:, None] * KW + offs_w[None, :], mask=wm, other=0)
    # KWB (PREQ only): a row's words past the first KWP as a second [KWB] part, so that a width of 160 words
    # runs on 128 + 32 lanes and not on 256, a third of them padding (`_row_parts`)
    tl.static_assert(KWB == 0 or PREQ, "a second part only for pre-quantized rows")
    if KWB > 0:
        offs_b = KWP + tl.arange(0, KWB)
        mb = offs_b < KW
        wbm = mask_n[:, None] & mb[None, :]
        wvb = tl.load(w_ptr + offs_n[:, None] * KW + offs_b[None, :], mask=wbm, other=0)  # [BN, KWB]
        if GATED:
            wvb2 = tl.load(w_ptr + (offs_n + N)[:, None] * KW + offs_b[None, :], mask=wbm, other=0)
    s = _row_scales(s_ptr, offs_n, mask_n, PER_ROW)
    s2 = s
    if GATED and PER_ROW:
        s2 = _row_scales(s_ptr + N, offs_n, mask_n, PER_ROW)
    g0, g1, g2, g3 = s, s, s, s  # (unused without EARLY_NORM)
    if EARLY_NORM:  # (a quantizing program with a norm) constant too: off the critical path after the wait
        g0, g1, g2, g3 = _norm_slabs(nw_ptr, K, KW, offs_w, mw)
    elif PDL and HAS_NORM and not PREQ:
        # K past DecodePlan.early_norm_max_k: into L2 instead, one 64-value line a program
        line = tl.arange(0, KWP // 4)  # a norm weight line holds 64 bf16 values: K <= 16 * KWP
        mine = (line * 64 < K) & (line % tl.num_programs(0) == pid)
        _prefetch_l2(nw_ptr + line * 64, mine, PTX)
    _pdl_wait(PDL)  # the weight and scale loads above overlap the previous kernel
    for m in range(M):
        if EARLY_NORM and HAS_RES:  # issued with the row's loads, not after its reductions
            res = tl.load(r_ptr + m * stride_rm + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            if BN2 > 0:
                res2 = tl.load(r_ptr + m * stride_rm + offs_n2, mask=mask_n2, other=0.0).to(tl.float32)
        xw0, xw1, xw2, xw3, a, rw, rs = _row_words(
            x_ptr + m * stride_xm,
            nw_ptr,
            q_ptr + m * stride_qw,
            a_ptr + m,
            rs_ptr + m,
            g0,
            g1,
            g2,
            g3,
            K,
            KW,
            eps,
            offs_w,
            mw,
            PREQ,
            HAS_NORM,
            EARLY_NORM,
            PTX,
        )
        dot = _row_dot(xw0, xw1, xw2, xw3, wv, rw, PTX)
        if KWB > 0:  # the second part's words: exact integer sums, added before the one float epilogue
            xb0, xb1, xb2, xb3, _a, rwb, _rs = _load_qrow(
                q_ptr + m * stride_qw, a_ptr + m, rs_ptr + m, KW, offs_b, mb
            )
            dot += _row_dot(xb0, xb1, xb2, xb3, wvb, rwb, PTX)
        y = _row_scale(dot, rs, a, s, PTX)
        if GATED:
            up = _row_dot(xw0, xw1, xw2, xw3, wv2, rw, PTX)
            if KWB > 0:
                up += _row_dot(xb0, xb1, xb2, xb3, wvb2, rwb, PTX)
            y = _activate(y, ACT) * _row_scale(up, rs, a, s2, PTX)
        if HAS_RES:
            if not EARLY_NORM:
                res = tl.load(r_ptr + m * stride_rm + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            y = _add_rn(y, res, PTX)
        tl.store(y_ptr + m * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)
        if BN2 > 0:  # the second rows part: the same row's words through its own weights
            y2 = _row_out(xw0, xw1, xw2, xw3, wvn, rw, rs, a, sn, PTX)
            if HAS_RES:
                if not EARLY_NORM:
                    res2 = tl.load(r_ptr + m * stride_rm + offs_n2, mask=mask_n2, other=0.0).to(tl.float32)
                y2 = _add_rn(y2, res2, PTX)
            tl.store(y_ptr + m * stride_ym + offs_n2, y2.to(y_ptr.dtype.element_ty), mask=mask_n2)
