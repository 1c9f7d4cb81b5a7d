"""Triton W2A8 kernels over the triton-2bit-v1 layout (see layout.py) with fused per-token int8 quantization.

- `_gemv_kernel`  (decode, M <= 16 rows): CUDA-core `dp4a` over int32 words; each program re-derives the row
  statistics (absmax, and the RMSNorm rstd when a norm weight is fused) so no separate quantization launch exists.
- `_quant_kernel` + `_gemm_kernel` (prefill / large batch): int8 rows, then `tl.dot` on int8 tensor cores with
  int32 accumulation, one dot per K slab.
Epilogues fuse the float scale s/a, per-output-row scales (concatenated q|k|v), a gated activation
(act(gate) * up for concatenated gate|up weights) and a residual add.

Quantization matches `quant.ternary.quantize_activations` bit for bit: a = (1/amax) * 127 (torch evaluates
`127 / t` as `t.reciprocal() * 127`), q = round-half-even(x * a) clamped to [-128, 127], and the float result
is acc * (s / a) with a correctly rounded division. Under TRITON_INTERPRET=1 (CPU) the PTX pieces (dp4a,
cvt.rni, div.rn, the packed shift) fall back to plain Triton ops with the same integer results.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs
from triton.language.extra import libdevice

try:  # grid dependency control (programmatic dependent launch, sm_90+)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: kernels run with PDL=False
    gdc_launch_dependents = gdc_wait = None

INTERPRET = bool(knobs.runtime.interpret)
HAS_GDC = gdc_wait is not None and not INTERPRET
ACT_CODES = {"relu2": 0, "silu": 1}


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    """Programmatic dependent launch: let the next kernel start its prologue now, then wait until the previous
    kernel has finished and its writes are visible. Everything a kernel reads that an earlier kernel wrote, and
    every store, comes after this; only constant data (weights, scales) may be read before it."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def _rcp_rn(x, PTX: tl.constexpr):
    if PTX:
        return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), x)
    else:
        return 1.0 / x


@triton.jit
def _div_rn(a, b, PTX: tl.constexpr):
    if PTX:
        return tl.math.div_rn(a, b)
    else:
        return a / b


@triton.jit
def _rne(x, PTX: tl.constexpr):
    """Round half to even (torch.round), |x| < 2**22."""
    if PTX:
        return libdevice.rint(x)
    else:
        return (x + 12582912.0) - 12582912.0


@triton.jit
def _dp4a(a, b, c, PTX: tl.constexpr):
    """c + dot(bytes(a), bytes(b)) with signed bytes (PTX dp4a.s32.s32)."""
    if PTX:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        r = c
        for j in tl.static_range(4):
            r += ((a << (24 - 8 * j)) >> 24) * ((b << (24 - 8 * j)) >> 24)
        return r


@triton.jit
def _codes8(wb, I: tl.constexpr, PTX: tl.constexpr):
    """uint8 tile of packed bytes -> int8 codes (0..2) of slab I; PTX path works on 4 bytes per instruction."""
    if PTX:
        if I == 0:
            return tl.inline_asm_elementwise(
                "and.b32 $0, $1, 0x03030303;", "=r,r", [wb], dtype=tl.int8, is_pure=True, pack=4
            )
        elif I == 1:
            return tl.inline_asm_elementwise(
                "{.reg .b32 t; shr.b32 t, $1, 2; and.b32 $0, t, 0x03030303;}",
                "=r,r",
                [wb],
                dtype=tl.int8,
                is_pure=True,
                pack=4,
            )
        elif I == 2:
            return tl.inline_asm_elementwise(
                "{.reg .b32 t; shr.b32 t, $1, 4; and.b32 $0, t, 0x03030303;}",
                "=r,r",
                [wb],
                dtype=tl.int8,
                is_pure=True,
                pack=4,
            )
        else:
            return tl.inline_asm_elementwise(
                "{.reg .b32 t; shr.b32 t, $1, 6; and.b32 $0, t, 0x03030303;}",
                "=r,r",
                [wb],
                dtype=tl.int8,
                is_pure=True,
                pack=4,
            )
    else:
        return ((wb >> (2 * I)) & 3).to(tl.int8)


@triton.jit
def _epilogue(acc, rs, a, s_ptr, offs_n, mask_n, PER_ROW: tl.constexpr, PTX: tl.constexpr):
    """(int32 X@C^T - rowsum(X)) * (s / a) in float32; acc [BM, BN], rs/a [BM]."""
    if PER_ROW:
        s = tl.load(s_ptr + offs_n, mask=mask_n, other=1.0)
        if (
            PTX
        ):  # s / a correctly rounded without a div.rn per element (MUFU-bound, and its registers cost the
            # GEMM its second CTA an SM): one reciprocal r = RN(1/a) per row, then two corrections q + (s - a*q) * r
            # with exact FMA residuals; the second starts within an ulp, so it rounds correctly (Markstein)
            r = _rcp_rn(a, PTX)[:, None]
            sb = s[None, :]
            ab = a[:, None]
            q = sb * r
            q = tl.fma(tl.fma(-q, ab, sb), r, q)
            f = tl.fma(tl.fma(-q, ab, sb), r, q)
        else:
            f = s[None, :] / a[:, None]
    else:
        s = tl.load(s_ptr)
        f = _div_rn(s + tl.zeros_like(a), a, PTX)[:, None]
    return (acc - rs[:, None]).to(tl.float32) * f


@triton.jit
def _activate(g, ACT: tl.constexpr):
    if ACT == 0:
        r = tl.maximum(g, 0.0)
        return r * r
    else:
        return g / (1.0 + tl.exp(-g))


# --------------------------------------------------------------------------------------------------------------
# GEMV: decode path, M <= 16 activation rows
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _gemv_kernel(
    x_ptr,
    nw_ptr,
    w_ptr,
    s_ptr,
    r_ptr,
    y_ptr,
    M,
    N,
    K,
    KW,  # N: output features (per half when GATED); KW: int32 words per packed row
    stride_xm,
    stride_rm,
    stride_ym,
    eps,
    HAS_NORM: tl.constexpr,
    HAS_RES: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    PER_ROW: tl.constexpr,
    PTX: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BKW: tl.constexpr,
    SBK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BM)
    mask_m = offs_m < M
    x_rows = x_ptr + offs_m * stride_xm  # [BM]

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
    a = _rcp_rn(tl.maximum(amax, 1e-5), PTX) * 127.0  # [BM]

    # pass 2: quantize on the fly into int32 words and dp4a against the packed weight words
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
            kk = i * (4 * KW) + offs_w[:, None] * 4 + offs_j[None, :]  # [BKW, 4] activation index of slab i
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
            q = _rne(x * a[:, None, None], PTX)
            q = tl.minimum(tl.maximum(q, -128.0), 127.0).to(tl.int32)
            xw = tl.sum((q & 255) << (offs_j * 8)[None, None, :], axis=2)  # [BM, BKW] four int8 per word
            rs += tl.sum(q, axis=2)
            xb = tl.broadcast_to(xw[:, None, :], [BM, BN, BKW])
            c = tl.broadcast_to(((wv >> (2 * i)) & 0x03030303)[None, :, :], [BM, BN, BKW])
            acc = _dp4a(xb, c, acc, PTX)
            if GATED:
                c2 = tl.broadcast_to(((wv2 >> (2 * i)) & 0x03030303)[None, :, :], [BM, BN, BKW])
                acc2 = _dp4a(xb, c2, acc2, PTX)
    rsum = tl.sum(rs, axis=1)
    y = _epilogue(tl.sum(acc, axis=2), rsum, a, s_ptr, offs_n, mask_n, PER_ROW, PTX)
    if GATED:
        u = _epilogue(tl.sum(acc2, axis=2), rsum, a, s_ptr, offs_n + N, mask_n, PER_ROW, PTX)
        y = _activate(y, ACT) * u
    mask_y = mask_m[:, None] & mask_n[None, :]
    if HAS_RES:
        y += tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask_y, other=0.0).to(
            tl.float32
        )
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty), mask=mask_y)


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
):
    m = tl.program_id(0)
    offs = tl.arange(0, BK)
    mk = offs < K
    _pdl_wait(PDL)
    x = tl.load(x_ptr + m * stride_xm + offs, mask=mk, other=0.0).to(tl.float32)
    if HAS_NORM:
        g = tl.load(nw_ptr + offs, mask=mk, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / K + eps)
        amax = tl.max(tl.abs(x * g), axis=0) * rstd
        x = (x * rstd) * g
    else:
        amax = tl.max(tl.abs(x), axis=0)
    a = _rcp_rn(tl.maximum(amax, 1e-5), PTX) * 127.0
    q = _rne(x * a, PTX)
    q = tl.minimum(tl.maximum(q, -128.0), 127.0).to(tl.int32)
    q = tl.where(mk, q, 0)
    tl.store(q_ptr + m * stride_qm + offs, q.to(tl.int8), mask=offs < KPAD)
    tl.store(a_ptr + m, a)
    tl.store(rs_ptr + m, tl.sum(q, axis=0))


# --------------------------------------------------------------------------------------------------------------
# GEMM: prefill / large batch, int8 tensor cores
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _mma_loop(
    q_ptr,
    w_ptr,
    offs_m,
    offs_n,
    mask_m,
    mask_n,
    N,
    KP,
    b_lo,
    b_hi,
    stride_qm,
    GATED: tl.constexpr,
    PTX: tl.constexpr,
    SWAP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BKB: tl.constexpr,
):
    """int32 [BM, BN] tiles X @ C^T (and the up half when GATED) over packed bytes b_lo..b_hi of every slab.
    SWAP computes C @ X^T instead: the decoded codes are the MMA's A operand straight from registers and the
    activations its B operand (shared memory), with the batch in the MMA's N dimension -- the shape Hopper's
    wgmma wants, and no padding of a small batch up to 64 rows."""
    if SWAP:
        acc = tl.zeros([BN, BM], tl.int32)
        acc2 = tl.zeros([BN, BM], tl.int32)
    else:
        acc = tl.zeros([BM, BN], tl.int32)
        acc2 = tl.zeros([BM, BN], tl.int32)
    for b0 in range(b_lo, b_hi, BKB):
        offs_b = b0 + tl.arange(0, BKB)
        mb = offs_b < b_hi
        mw = mask_n[:, None] & mb[None, :]
        wb = tl.load(w_ptr + offs_n[:, None] * KP + offs_b[None, :], mask=mw, other=0)  # [BN, BKB] uint8
        if GATED:
            wb2 = tl.load(w_ptr + (offs_n + N)[:, None] * KP + offs_b[None, :], mask=mw, other=0)
        for i in tl.static_range(4):
            xa = tl.load(
                q_ptr + offs_m[:, None] * stride_qm + (i * KP + offs_b)[None, :],
                mask=mask_m[:, None] & mb[None, :],
                other=0,
            )  # [BM, BKB] int8
            if SWAP:
                acc = tl.dot(_codes8(wb, i, PTX), tl.trans(xa), acc, out_dtype=tl.int32)
                if GATED:
                    acc2 = tl.dot(_codes8(wb2, i, PTX), tl.trans(xa), acc2, out_dtype=tl.int32)
            else:
                acc = tl.dot(xa, tl.trans(_codes8(wb, i, PTX)), acc, out_dtype=tl.int32)
                if GATED:
                    acc2 = tl.dot(xa, tl.trans(_codes8(wb2, i, PTX)), acc2, out_dtype=tl.int32)
    if SWAP:  # (one return: Triton checks every return statement's type, taken branch or not)
        r1 = tl.trans(acc)
        r2 = tl.trans(acc2)
    else:
        r1 = acc
        r2 = acc2
    return r1, r2


@triton.jit
def _gemm_kernel(
    q_ptr,
    a_ptr,
    rs_ptr,
    w_ptr,
    s_ptr,
    r_ptr,
    y_ptr,
    M,
    N,
    KP,
    stride_qm,
    stride_rm,
    stride_ym,
    HAS_RES: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    PER_ROW: tl.constexpr,
    PTX: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BKB: tl.constexpr,
    GROUP_M: tl.constexpr,
    SWAP: tl.constexpr = False,
    PAIR: tl.constexpr = False,
):
    """PAIR (gated only): a tile's BN weight rows are BN/2 gate rows and the BN/2 up rows of the same outputs,
    one accumulator and one MMA of the full width (two half-width MMAs waste Hopper's wgmma), split in the
    epilogue."""
    pid = tl.program_id(0)
    OUT_N: tl.constexpr = BN // 2 if PAIR else BN  # output columns per tile
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, OUT_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % gsize
    pid_n = (pid % group) // gsize
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask_m = offs_m < M
    if PAIR:
        j = tl.arange(0, BN)
        offs_o = pid_n * OUT_N + j % OUT_N
        mask_w = offs_o < N
        rows = offs_o + tl.where(j >= OUT_N, N, 0)  # gate rows, then the up rows of the same outputs
        acc, acc2 = _mma_loop(
            q_ptr, w_ptr, offs_m, rows, mask_m, mask_w, N, KP, 0, KP, stride_qm, False, PTX, SWAP, BM, BN, BKB
        )
        a = tl.load(a_ptr + offs_m, mask=mask_m, other=1.0)  # after the K loop: no registers held across it
        rs = tl.load(rs_ptr + offs_m, mask=mask_m, other=0)
        yy = _epilogue(acc, rs, a, s_ptr, rows, mask_w, PER_ROW, PTX)  # [BM, BN]
        g, u = tl.split(tl.permute(tl.reshape(yy, [BM, 2, OUT_N]), (0, 2, 1)))
        y = _activate(g, ACT) * u
        offs_n = pid_n * OUT_N + tl.arange(0, OUT_N)
        mask_n = offs_n < N
    else:
        offs_n = pid_n * BN + tl.arange(0, BN)
        mask_n = offs_n < N
        acc, acc2 = _mma_loop(
            q_ptr,
            w_ptr,
            offs_m,
            offs_n,
            mask_m,
            mask_n,
            N,
            KP,
            0,
            KP,
            stride_qm,
            GATED,
            PTX,
            SWAP,
            BM,
            BN,
            BKB,
        )
        a = tl.load(a_ptr + offs_m, mask=mask_m, other=1.0)
        rs = tl.load(rs_ptr + offs_m, mask=mask_m, other=0)
        y = _epilogue(acc, rs, a, s_ptr, offs_n, mask_n, PER_ROW, PTX)
        if GATED:
            u = _epilogue(acc2, rs, a, s_ptr, offs_n + N, mask_n, PER_ROW, PTX)
            y = _activate(y, ACT) * u
    mask_y = mask_m[:, None] & mask_n[None, :]
    if HAS_RES:
        y += tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask_y, other=0.0).to(
            tl.float32
        )
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty), mask=mask_y)


# --------------------------------------------------------------------------------------------------------------
# int8 (per-row scaled) weights x float activations: the optional int8 LM head, any M
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _w8_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PTX: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    _pdl_wait(PDL)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        mk = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mk[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=mask_n[:, None] & mk[None, :], other=0
        )
        if PTX:
            acc = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
        else:  # the interpreter has no bf16 dot; same products, exact int8 -> f32
            acc = tl.dot(
                x.to(tl.bfloat16).to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee"
            )
    s = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
    y = acc * s[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y, mask=mask_m[:, None] & mask_n[None, :])


# --------------------------------------------------------------------------------------------------------------
# split-K GEMM: small M (decode). Many programs each own a K chunk so every SM has its loads in flight at once;
# each stores its partial int32 tile into a workspace slot [SPLIT, M, cols] and the last program of each output
# tile (a counter per tile, reset by that program so CUDA-graph replays need no memset) sums the slots and runs
# the epilogue. Integer sums: the result is exact and deterministic.
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _splitk_kernel(
    q_ptr,
    a_ptr,
    rs_ptr,
    w_ptr,
    s_ptr,
    r_ptr,
    y_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    KP,
    CHUNKS_PER_SPLIT,
    SPLIT: tl.constexpr,
    stride_qm,
    stride_rm,
    stride_ym,
    HAS_RES: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    PER_ROW: tl.constexpr,
    PTX: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BKB: tl.constexpr,
    PDL: tl.constexpr = False,
    SWAP: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    _pdl_wait(PDL)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_m = offs_m < M
    mask_n = offs_n < N
    b_lo = pid_s * CHUNKS_PER_SPLIT * BKB
    b_hi = tl.minimum(b_lo + CHUNKS_PER_SPLIT * BKB, KP)
    acc, acc2 = _mma_loop(
        q_ptr,
        w_ptr,
        offs_m,
        offs_n,
        mask_m,
        mask_n,
        N,
        KP,
        b_lo,
        b_hi,
        stride_qm,
        GATED,
        PTX,
        SWAP,
        BM,
        BN,
        BKB,
    )
    mask_y = mask_m[:, None] & mask_n[None, :]
    if USE_SPLIT:
        # partial tile -> its own workspace slot (plain stores: no atomics per element); the last split of the
        # tile to arrive sums the SPLIT slots in a fixed order
        wcols = N * 2 if GATED else N
        ws = ws_ptr + offs_m[:, None] * wcols + offs_n[None, :]
        tl.store(ws + pid_s * M * wcols, acc, mask=mask_y)
        if GATED:
            tl.store(ws + pid_s * M * wcols + N, acc2, mask=mask_y)
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(0) + pid_n
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if done == SPLIT - 1:
            tl.debug_barrier()
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")
            acc = tl.zeros([BM, BN], tl.int32)
            acc2 = tl.zeros([BM, BN], tl.int32)
            for sp in tl.static_range(SPLIT):  # unrolled: every slot's load in flight at once
                # .cg: the other programs' partials from L2, never a stale L1 line of an earlier replay
                acc += tl.load(ws + sp * M * wcols, mask=mask_y, other=0, cache_modifier=".cg")
                if GATED:
                    acc2 += tl.load(ws + sp * M * wcols + N, mask=mask_y, other=0, cache_modifier=".cg")
            _splitk_store(
                acc,
                acc2,
                a_ptr,
                rs_ptr,
                s_ptr,
                r_ptr,
                y_ptr,
                offs_m,
                offs_n,
                mask_m,
                mask_n,
                N,
                stride_rm,
                stride_ym,
                HAS_RES,
                GATED,
                ACT,
                PER_ROW,
                PTX,
            )
    else:
        _splitk_store(
            acc,
            acc2,
            a_ptr,
            rs_ptr,
            s_ptr,
            r_ptr,
            y_ptr,
            offs_m,
            offs_n,
            mask_m,
            mask_n,
            N,
            stride_rm,
            stride_ym,
            HAS_RES,
            GATED,
            ACT,
            PER_ROW,
            PTX,
        )


@triton.jit
def _splitk_store(
    acc,
    acc2,
    a_ptr,
    rs_ptr,
    s_ptr,
    r_ptr,
    y_ptr,
    offs_m,
    offs_n,
    mask_m,
    mask_n,
    N,
    stride_rm,
    stride_ym,
    HAS_RES: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    PER_ROW: tl.constexpr,
    PTX: tl.constexpr,
):
    a = tl.load(a_ptr + offs_m, mask=mask_m, other=1.0)
    rs = tl.load(rs_ptr + offs_m, mask=mask_m, other=0)
    y = _epilogue(acc, rs, a, s_ptr, offs_n, mask_n, PER_ROW, PTX)
    if GATED:
        u = _epilogue(acc2, rs, a, s_ptr, offs_n + N, mask_n, PER_ROW, PTX)
        y = _activate(y, ACT) * u
    mask_y = mask_m[:, None] & mask_n[None, :]
    if HAS_RES:
        y += tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask_y, other=0.0).to(
            tl.float32
        )
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty), mask=mask_y)


# --------------------------------------------------------------------------------------------------------------
# GEMV over pre-quantized activations (decode, M <= 16): `_quant_kernel` once, then dp4a on int32 words of x.
# Cheaper than the fused GEMV when K is large: no program re-derives the row statistics.
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _gemv8_kernel(
    q_ptr,
    a_ptr,
    rs_ptr,
    w_ptr,
    s_ptr,
    r_ptr,
    y_ptr,
    M,
    N,
    KW,
    stride_qw,
    stride_rm,
    stride_ym,
    HAS_RES: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    PER_ROW: tl.constexpr,
    PTX: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BKW: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BM)
    mask_m = offs_m < M
    offs_n = pid * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    acc = tl.zeros([BM, BN, BKW], tl.int32)
    acc2 = tl.zeros([BM, BN, BKW], tl.int32)
    for w0 in range(0, KW, BKW):
        offs_w = w0 + tl.arange(0, BKW)
        mw = offs_w < KW
        wv = tl.load(
            w_ptr + offs_n[:, None] * KW + offs_w[None, :], mask=mask_n[:, None] & mw[None, :], other=0
        )
        if GATED:
            wv2 = tl.load(
                w_ptr + (offs_n + N)[:, None] * KW + offs_w[None, :],
                mask=mask_n[:, None] & mw[None, :],
                other=0,
            )
        for i in tl.static_range(4):
            xw = tl.load(
                q_ptr + offs_m[:, None] * stride_qw + (i * KW + offs_w)[None, :],
                mask=mask_m[:, None] & mw[None, :],
                other=0,
            )  # [BM, BKW] four int8 activations per word
            xb = tl.broadcast_to(xw[:, None, :], [BM, BN, BKW])
            c = tl.broadcast_to(((wv >> (2 * i)) & 0x03030303)[None, :, :], [BM, BN, BKW])
            acc = _dp4a(xb, c, acc, PTX)
            if GATED:
                c2 = tl.broadcast_to(((wv2 >> (2 * i)) & 0x03030303)[None, :, :], [BM, BN, BKW])
                acc2 = _dp4a(xb, c2, acc2, PTX)
    _splitk_store(
        tl.sum(acc, axis=2),
        tl.sum(acc2, axis=2),
        a_ptr,
        rs_ptr,
        s_ptr,
        r_ptr,
        y_ptr,
        offs_m,
        offs_n,
        mask_m,
        mask_n,
        N,
        stride_rm,
        stride_ym,
        HAS_RES,
        GATED,
        ACT,
        PER_ROW,
        PTX,
    )


# --------------------------------------------------------------------------------------------------------------
# Row GEMV (decode, small M): each program owns BN whole output rows. Its packed weight words [BN, KWP] are
# loaded in one shot before anything else (every load in flight at once, no K loop), then the activation row
# is quantized into int32 words once per program (PREQ=False: norm + absmax + rounding fused, no extra launch)
# or read pre-quantized from `_quant_kernel` (PREQ=True), and dp4a runs over the four slabs.
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _slab_x(xrow, nw_ptr, kk, mk, HAS_NORM: tl.constexpr):
    x = tl.load(xrow + kk, mask=mk, other=0.0).to(tl.float32)
    if HAS_NORM:
        g = tl.load(nw_ptr + kk, mask=mk, other=0.0).to(tl.float32)
    else:
        g = x
    return x, g


@triton.jit
def _slab_q(x, g, rstd, a, offs_j, HAS_NORM: tl.constexpr, PTX: tl.constexpr):
    if HAS_NORM:
        x = (x * rstd) * g
    q = _rne(x * a, PTX)
    q = tl.minimum(tl.maximum(q, -128.0), 127.0).to(tl.int32)
    return tl.sum((q & 255) << (offs_j * 8)[None, :], axis=1), tl.sum(tl.sum(q, axis=1), axis=0)


@triton.jit
def _quant_words(xrow, nw_ptr, K, KW, eps, offs_w, mw, HAS_NORM: tl.constexpr, PTX: tl.constexpr):
    """One activation row -> int8 words of the four slabs ([KWP] int32 each), a, rowsum (as `_quant_kernel`)."""
    offs_j = tl.arange(0, 4)
    kk = offs_w[:, None] * 4 + offs_j[None, :]  # [KWP, 4] index in slab 0
    kp = 4 * KW
    x0, g0 = _slab_x(xrow, nw_ptr, kk, (kk < K) & mw[:, None], HAS_NORM)
    x1, g1 = _slab_x(xrow, nw_ptr, kk + kp, (kk + kp < K) & mw[:, None], HAS_NORM)
    x2, g2 = _slab_x(xrow, nw_ptr, kk + 2 * kp, (kk + 2 * kp < K) & mw[:, None], HAS_NORM)
    x3, g3 = _slab_x(xrow, nw_ptr, kk + 3 * kp, (kk + 3 * kp < K) & mw[:, None], HAS_NORM)
    if HAS_NORM:
        ss = tl.sum(tl.sum(x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3, axis=1), axis=0)
        am = tl.maximum(
            tl.maximum(tl.abs(x0 * g0), tl.abs(x1 * g1)), tl.maximum(tl.abs(x2 * g2), tl.abs(x3 * g3))
        )
        rstd = 1.0 / tl.sqrt_rn(ss / K + eps)
        amax = tl.max(tl.max(am, axis=1), axis=0) * rstd
    else:
        am = tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3)))
        amax = tl.max(tl.max(am, axis=1), axis=0)
        rstd = amax
    a = _rcp_rn(tl.maximum(amax, 1e-5), PTX) * 127.0
    w0, r0 = _slab_q(x0, g0, rstd, a, offs_j, HAS_NORM, PTX)
    w1, r1 = _slab_q(x1, g1, rstd, a, offs_j, HAS_NORM, PTX)
    w2, r2 = _slab_q(x2, g2, rstd, a, offs_j, HAS_NORM, PTX)
    w3, r3 = _slab_q(x3, g3, rstd, a, offs_j, HAS_NORM, PTX)
    return w0, w1, w2, w3, a, r0 + r1 + r2 + r3


@triton.jit
def _row_dot(xw0, xw1, xw2, xw3, wv, PTX: tl.constexpr):
    """sum_k x_k * c_k for each of the BN weight rows (codes c = t + 1) -> [BN] int32."""
    acc = _dp4a(tl.broadcast_to(xw0[None, :], wv.shape), wv & 0x03030303, tl.zeros_like(wv), PTX)
    acc = _dp4a(tl.broadcast_to(xw1[None, :], wv.shape), (wv >> 2) & 0x03030303, acc, PTX)
    acc = _dp4a(tl.broadcast_to(xw2[None, :], wv.shape), (wv >> 4) & 0x03030303, acc, PTX)
    acc = _dp4a(tl.broadcast_to(xw3[None, :], wv.shape), (wv >> 6) & 0x03030303, acc, PTX)
    return tl.sum(acc, axis=1)


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
):
    pid = tl.program_id(0)
    offs_n = pid * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    offs_w = tl.arange(0, KWP)
    mw = offs_w < KW
    wm = mask_n[:, None] & mw[None, :]
    wv = tl.load(w_ptr + offs_n[:, None] * KW + offs_w[None, :], mask=wm, other=0)  # [BN, KWP] int32
    if GATED:
        wv2 = tl.load(w_ptr + (offs_n + N)[:, None] * KW + offs_w[None, :], mask=wm, other=0)
    if PER_ROW:
        s = tl.load(s_ptr + offs_n, mask=mask_n, other=1.0)
        if GATED:
            s2 = tl.load(s_ptr + N + offs_n, mask=mask_n, other=1.0)
    else:
        s = tl.load(s_ptr) + tl.zeros([BN], tl.float32)
        s2 = s
    _pdl_wait(PDL)  # the weight and scale loads above overlap the previous kernel
    for m in range(M):
        if PREQ:
            qrow = q_ptr + m * stride_qw
            xw0 = tl.load(qrow + offs_w, mask=mw, other=0)
            xw1 = tl.load(qrow + KW + offs_w, mask=mw, other=0)
            xw2 = tl.load(qrow + 2 * KW + offs_w, mask=mw, other=0)
            xw3 = tl.load(qrow + 3 * KW + offs_w, mask=mw, other=0)
            a = tl.load(a_ptr + m)
            rs = tl.load(rs_ptr + m)
        else:
            xw0, xw1, xw2, xw3, a, rs = _quant_words(
                x_ptr + m * stride_xm, nw_ptr, K, KW, eps, offs_w, mw, HAS_NORM, PTX
            )
        y = (_row_dot(xw0, xw1, xw2, xw3, wv, PTX) - rs).to(tl.float32) * _div_rn(
            s, a + tl.zeros_like(s), PTX
        )
        if GATED:
            u = (_row_dot(xw0, xw1, xw2, xw3, wv2, PTX) - rs).to(tl.float32) * _div_rn(
                s2, a + tl.zeros_like(s2), PTX
            )
            y = _activate(y, ACT) * u
        if HAS_RES:
            y += tl.load(r_ptr + m * stride_rm + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)
