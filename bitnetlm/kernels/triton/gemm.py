"""Int8 tensor-core GEMMs over the triton-2bit-v1 layout (prefill and batched decode), plus the int8 LM head.

- `_mma_loop`: the K loop: 2-bit codes unpacked in registers, `tl.dot` on int8 tensor cores with int32
  accumulation, one dot per K slab; SWAP puts the weight rows in the MMA's M (Hopper's wgmma wants M >= 64);
- `_gemm_kernel`: over rows pre-quantized by `quant._quant_kernel`, either tiled (GROUP_M > 0: prefill, M > 64)
  or split-K (GROUP_M == 0: batched decode, M <= 64);
- `_w8_kernel`: int8 (per-row scaled) weights x bf16 activations, the optional int8 LM head.
"""

from __future__ import annotations

import triton
import triton.language as tl

from bitnetlm.kernels.triton.common import (
    _activate,
    _argmax_key,
    _argmax_parts,
    _codes8,
    _epilogue,
    _gated_epilogue,
    _greedy_fold,
    _pdl_wait,
    _prefetch_l2,
    _prefetch_scales,
    _store_out,
)


@triton.jit
def _pair_rows(pid_n, N, BN: tl.constexpr):
    """Weight rows [BN] of output tile pid_n (BN/2 outputs: gate rows, then the up rows) and their mask."""
    OUT_N: tl.constexpr = BN // 2
    j = tl.arange(0, BN)
    offs_o = pid_n * OUT_N + j % OUT_N
    rows = offs_o + tl.where(j >= OUT_N, N, 0)
    return rows, offs_o < N


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
def _prefetch_rows(w_ptr, rows, mask_r, KP, b_lo, b_hi, PTX: tl.constexpr):
    """L2 hint for packed bytes b_lo..b_hi of weight rows [BN] (up to 2 KB a row), issued before `_pdl_wait`."""
    offs_l = b_lo + tl.arange(0, 16) * 128
    _prefetch_l2(
        w_ptr + rows[:, None] * KP + offs_l[None, :], mask_r[:, None] & (offs_l < b_hi)[None, :], PTX
    )


@triton.jit
def _splitk_sum(
    acc,
    acc2,
    ws_ptr,
    cnt_ptr,
    pid_n,
    pid_s,
    pid_m,
    offs_m,
    cols,
    mask_m,
    mask_c,
    M,
    wcols,
    N,
    TWO: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Split-K: (is this the tile's last program, the tile's int32 sums over every split, the same for acc2).

    Each program stores its partial tile into its own workspace slot [SPLIT, M, wcols] (plain stores, no atomics
    per element); the last program of the tile to arrive (a counter per tile, reset by that program so CUDA-graph
    replays need no memset) sums the SPLIT slots in a fixed order: exact and deterministic. TWO: acc2 (the up
    rows) in columns N..2N-1."""
    if SPLIT > 1:
        mask_y = mask_m[:, None] & mask_c[None, :]
        ws = ws_ptr + offs_m[:, None] * wcols + cols[None, :]
        tl.store(ws + pid_s * M * wcols, acc, mask=mask_y)
        if TWO:
            tl.store(ws + pid_s * M * wcols + N, acc2, mask=mask_y)
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(0) + pid_n
        last = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == SPLIT - 1
        if last:
            tl.debug_barrier()
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")
            acc = tl.zeros_like(acc)
            acc2 = tl.zeros_like(acc2)
            for sp in tl.static_range(SPLIT):  # unrolled: every slot's load in flight at once
                # .cg: the other programs' partials from L2, never a stale L1 line of an earlier replay
                acc += tl.load(ws + sp * M * wcols, mask=mask_y, other=0, cache_modifier=".cg")
                if TWO:
                    acc2 += tl.load(ws + sp * M * wcols + N, mask=mask_y, other=0, cache_modifier=".cg")
    else:
        last = True
    return last, acc, acc2


@triton.jit
def _add_partials(acc, acc2, sums_ptr, offs_m, cols, mask_m, mask_c, wcols, N, TWO: tl.constexpr):
    """A deferred split-K program's partial tile added into the int32 sums [M, wcols] (zero at rest; integer adds
    in any order are exact), which the next kernel finishes (`deferred.SplitKSums`); acc2 (TWO) N columns on."""
    mask_y = mask_m[:, None] & mask_c[None, :]
    sums = sums_ptr + offs_m[:, None] * wcols + cols[None, :]
    tl.atomic_add(sums, acc, mask=mask_y, sem="relaxed")
    if TWO:
        tl.atomic_add(sums + N, acc2, mask=mask_y, sem="relaxed")


@triton.jit
def _gemm_kernel(
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
    GROUP_M: tl.constexpr = 0,
    SPLIT: tl.constexpr = 1,
    PDL: tl.constexpr = False,
    SWAP: tl.constexpr = False,
    PAIR: tl.constexpr = False,
    LATE: tl.constexpr = False,
    DEFER: tl.constexpr = False,
):
    """y = epilogue(X @ C^T) over [BM, BN] tiles.

    GROUP_M > 0, tiled: a 1-D grid, one program per output tile, GROUP_M row tiles walked together (L2 reuse).
    GROUP_M == 0, split-K (small M): grid (N tiles, SPLIT, M tiles); program (n, s, m) owns K chunk s of its tile
    (CHUNKS_PER_SPLIT chunks of BKB bytes), so every SM has its loads in flight at once; with SPLIT > 1 the
    last program of the tile sums the partials and runs the epilogue (`_splitk_sum`). Under programmatic
    dependent launch (PDL, split-K) each program first prefetches its weight bytes into L2, overlapping the
    quantization launch it waits for.
    PAIR (gated only): a tile's BN weight rows are the BN/2 gate rows and the BN/2 up rows of the same outputs
    (`_pair_rows`), so one accumulator and one MMA of the full width cover both (two half-width MMAs waste
    Hopper's wgmma); the epilogue splits the tile. The workspace columns are then the weight rows.
    DEFER (split-K): the programs add their int32 partials into ws_ptr [M, wcols] and stop; no epilogue here.
    """
    OUT_N: tl.constexpr = BN // 2 if PAIR else BN  # output columns per tile
    if GROUP_M > 0:
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        group = GROUP_M * tl.cdiv(N, OUT_N)
        first_m = (pid // group) * GROUP_M
        gsize = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group) % gsize
        pid_n = (pid % group) // gsize
        pid_s = 0
        b_lo = 0
        b_hi = KP
    else:
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        pid_m = tl.program_id(2)
        b_lo = pid_s * CHUNKS_PER_SPLIT * BKB
        b_hi = tl.minimum(b_lo + CHUNKS_PER_SPLIT * BKB, KP)
    if PAIR:  # cols: the tile's weight rows (gate rows, then the up rows of the same outputs)
        cols, mask_c = _pair_rows(pid_n, N, BN)
    else:  # cols: the tile's outputs (and the up rows cols + N in acc2 when GATED)
        cols = pid_n * BN + tl.arange(0, BN)
        mask_c = cols < N
    TWO: tl.constexpr = GATED and not PAIR  # gate|up in two accumulators
    if PDL:  # the weights are constant: pull this program's bytes into L2 while waiting
        _prefetch_rows(w_ptr, cols, mask_c, KP, b_lo, b_hi, PTX)
        if TWO:
            _prefetch_rows(w_ptr, cols + N, mask_c, KP, b_lo, b_hi, PTX)
        if not DEFER:  # and the epilogue's scales (constant data read after the wait would miss L2)
            _prefetch_scales(s_ptr, cols, mask_c, PER_ROW, PTX)
            if TWO:
                _prefetch_scales(s_ptr, cols + N, mask_c, PER_ROW, PTX)
    # LATE: the next kernel launches only once the one before this has ended (DecodePlan.gemm_late_min_m)
    _pdl_wait(PDL, AFTER=LATE)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask_m = offs_m < M
    acc, acc2 = _mma_loop(
        q_ptr, w_ptr, offs_m, cols, mask_m, mask_c, N, KP, b_lo, b_hi, stride_qm, TWO, PTX, SWAP, BM, BN, BKB
    )
    wcols = N * 2 if GATED else N
    if DEFER:  # no program is last: the next kernel sums and finishes
        _add_partials(acc, acc2, ws_ptr, offs_m, cols, mask_m, mask_c, wcols, N, TWO)
        last = False
    else:
        last, acc, acc2 = _splitk_sum(
            acc,
            acc2,
            ws_ptr,
            cnt_ptr,
            pid_n,
            pid_s,
            pid_m,
            offs_m,
            cols,
            mask_m,
            mask_c,
            M,
            wcols,
            N,
            TWO,
            SPLIT,
        )
    if last:
        a = tl.load(a_ptr + offs_m, mask=mask_m, other=1.0)  # after the K loop: no registers held across it
        rs = tl.load(rs_ptr + offs_m, mask=mask_m, other=0)
        if PAIR:  # [BM, BN] tile -> gate and up halves [BM, BN/2]
            yy = _epilogue(acc, rs, a, s_ptr, cols, mask_c, PER_ROW, PTX)
            g, u = tl.split(tl.permute(tl.reshape(yy, [BM, 2, OUT_N]), (0, 2, 1)))
            y = _activate(g, ACT) * u
            offs_n = pid_n * OUT_N + tl.arange(0, OUT_N)
            mask_n = offs_n < N
        else:
            y = _gated_epilogue(acc, acc2, rs, a, s_ptr, cols, mask_c, N, GATED, ACT, PER_ROW, PTX)
            offs_n = cols
            mask_n = mask_c
        _store_out(y, r_ptr, y_ptr, offs_m, offs_n, mask_m, mask_n, stride_rm, stride_ym, HAS_RES, PTX)


# --------------------------------------------------------------------------------------------------------------
# int8 (per-row scaled) weights x float activations: the optional int8 LM head, any M
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _head_tile(M, N, BM: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):
    """The int8 head's (rows, outputs) tile of program (n, m), after the PDL wait: offsets and masks."""
    _pdl_wait(PDL)
    offs_m = tl.program_id(1) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    return offs_m, offs_n, offs_m < M, offs_n < N


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
    offs_m, offs_n, mask_m, mask_n = _head_tile(M, N, BM, BN, PDL)
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
# int8 (per-row scaled) weights x int16 activations as two int8 halves: the int8 LM head without converting the
# weights (two int8 MMAs into exact int32 sums; y = (256 * hi_sum + lo_sum) / a * s)
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _w8a16_kernel(
    hi_ptr,
    lo_ptr,
    a_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    yi_ptr,
    M,
    N,
    K,
    stride_qm,
    stride_ym,
    best_ptr,
    cnt_ptr,
    tok_ptr,
    out_ptr,
    stride_out,
    step_ptr,
    pos_ptr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PDL: tl.constexpr = False,
    ARGMAX: tl.constexpr = False,
    FOLD: tl.constexpr = False,
    BMR: tl.constexpr = 16,
):
    """y [M, N] logits; ARGMAX: no logits, each row's maximum over the tile's BN outputs and its first index (a NaN
    above every number, the first NaN winning, as torch.argmax) into y and yi [M, cdiv(N, BN)]; FOLD (with
    ARGMAX): neither, the greedy step instead (`_greedy_fold`: tok, out[:, step], pos and step; best, cnt)."""
    offs_m, offs_n, mask_m, mask_n = _head_tile(M, N, BM, BN, PDL)
    acc_h = tl.zeros([BM, BN], tl.int32)
    acc_l = tl.zeros([BM, BN], tl.int32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        mk = offs_k < K
        mx = mask_m[:, None] & mk[None, :]
        xh = tl.load(hi_ptr + offs_m[:, None] * stride_qm + offs_k[None, :], mask=mx, other=0)
        xl = tl.load(lo_ptr + offs_m[:, None] * stride_qm + offs_k[None, :], mask=mx, other=0)
        wm = mask_n[:, None] & mk[None, :]
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=wm, other=0)
        wt = tl.trans(w)
        acc_h = tl.dot(xh, wt, acc_h, out_dtype=tl.int32)
        acc_l = tl.dot(xl, wt, acc_l, out_dtype=tl.int32)
    a = tl.load(a_ptr + offs_m, mask=mask_m, other=1.0)
    s = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
    y = (acc_h.to(tl.float32) * 256.0 + acc_l.to(tl.float32)) / a[:, None] * s[None, :]
    if ARGMAX:
        mx, first, first_nan = _argmax_parts(y, offs_n[None, :], mask_n[None, :], N, 1)  # [BM] each
        has_nan = first_nan < N
        if FOLD:
            key = _argmax_key(mx, tl.where(has_nan, first_nan, first), has_nan)
            _greedy_fold(
                key,
                offs_m,
                mask_m,
                M,
                best_ptr,
                cnt_ptr,
                tok_ptr,
                out_ptr,
                stride_out,
                step_ptr,
                pos_ptr,
                BMR,
            )
        else:
            t = offs_m * stride_ym + tl.program_id(0)
            tl.store(y_ptr + t, tl.where(has_nan, float("nan"), mx), mask=mask_m)
            tl.store(yi_ptr + t, tl.where(has_nan, first_nan, first), mask=mask_m)
    else:
        tl.store(
            y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y, mask=mask_m[:, None] & mask_n[None, :]
        )
