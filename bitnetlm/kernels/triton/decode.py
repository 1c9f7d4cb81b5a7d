"""The q|k|v projection of the CUDA-graph decode step (batch 1-64) with RoPE and the KV-cache write fused in.

Its tiles' weight rows are rotation pairs (d, d + D/2) of the heads (`_pair_cols`), so a program rotates its own
outputs and writes q into the query buffer [B, 1, H, D] and k / v straight into the KV-cache slot pos: no q|k|v
round trip and no RoPE launch (`rope.rope_cache`). Two kernels, one tuner choosing between them:
- `_qkv_rope_kernel`, the row GEMV (`gemv._gemv_row_kernel`): the only one at batch 1-2;
- `_qkv_rope_mma_kernel`, the split-K tensor-core GEMM (`gemm._gemm_kernel`) with `_rope_store` as its epilogue:
  from batch 3 (the engine uses it at batch 8-64: `DecodePlan.fused_gap`).
The results equal the unfused launches bit for bit: the outputs are rounded to the activation dtype before the
rotation, as the stored q|k|v rows are in the unfused step, and every kernel rotates through `common._rotate`.

The activation rows come pre-quantized (`quantize_into`, one launch before) or as they are: then every program
normalizes and quantizes the whole row itself (`quant._quant_words`, as the row GEMV's PREQ=False path), which
the batch-1 step uses. (A quantizing tail -- the last program of o / gate|up / down / attention quantizing the
whole output row for the next projection -- was measured slower than the separate `_quant_kernel` launch on an
H100, 1-2 us a projection, and for o -> gate|up at batch 1 on an H200: docs/PERF_LOG.md, 2026-11-29; not used.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from bitnetlm.kernels.triton.common import (
    PTX,
    _epilogue,
    _kv_slot,
    _pdl_wait,
    _prefetch_l2,
    _prefetch_scales,
    _rotate,
    pdl_kw,
    table_block_size,
)
from bitnetlm.kernels.triton.gemm import _mma_loop, _prefetch_rows, _splitk_sum
from bitnetlm.kernels.triton.gemv import _row_out, _row_words
from bitnetlm.kernels.triton.launch import _workspace, check_packed, launch_quant
from bitnetlm.kernels.triton.layout import packed_row_bytes
from bitnetlm.kernels.triton.plan import DecodePlan, resolve
from bitnetlm.kernels.triton.quant import _norm_slabs
from bitnetlm.kernels.triton.tune import _next_pow2, _row_candidates, _splitk_candidates, _tune


@triton.jit
def _pair_cols(pid, N, D: tl.constexpr, BN: tl.constexpr):
    """Weight rows [BN] of tile pid: BN/2 rotation pairs, rows d then rows d + D/2 of the same heads, and mask."""
    HALF: tl.constexpr = D // 2
    P: tl.constexpr = BN // 2
    j = tl.arange(0, BN)
    pp = pid * P + j % P
    return (pp // HALF) * D + pp % HALF + tl.where(j >= P, HALF, 0), pp < N // 2


@triton.jit
def _pair_roles(pid, N, H, HKV, HALF: tl.constexpr, P: tl.constexpr):
    """Tile pid's P rotation pairs [P]: head, dim d within the half, in range, rotated (q and k heads), q head,
    k head, and the kv head of a k or v head (heads 0..H-1 are q, then the k heads, then the v heads)."""
    p1 = pid * P + tl.arange(0, P)
    head = p1 // HALF
    rot = head < H + HKV
    is_k = (head >= H) & rot
    return head, p1 % HALF, p1 < N // 2, rot, head < H, is_k, tl.where(is_k, head - H, head - H - HKV)


@triton.jit
def _rope_tables(offs_m, mask_m, pid, N, pos_ptr, cos_ptr, sin_ptr, D: tl.constexpr, BN: tl.constexpr):
    """Positions pos[m] [BM, 1] and the cos / sin [BM, BN/2] of tile pid's rotation pairs at them."""
    HALF: tl.constexpr = D // 2
    p1 = pid * (BN // 2) + tl.arange(0, BN // 2)
    mp = mask_m[:, None] & (p1 < N // 2)[None, :]
    pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0)[:, None]
    at = pos * HALF + (p1 % HALF)[None, :]
    return pos, tl.load(cos_ptr + at, mask=mp, other=0.0), tl.load(sin_ptr + at, mask=mp, other=0.0)


@triton.jit
def _store_halves(o1, o2, dq, dc, is_q, mp, qo_ptr, kc_ptr, HALF: tl.constexpr, KV_SAME: tl.constexpr):
    """The rotated halves o1 / o2 (any shape) to their q (dq) or cache (dc) addresses and + D/2."""
    if KV_SAME:  # one store pair for q, k and v alike
        dst = tl.where(is_q, dq, dc)
        tl.store(dst, o1.to(kc_ptr.dtype.element_ty), mask=mp)
        tl.store(dst + HALF, o2.to(kc_ptr.dtype.element_ty), mask=mp)
    else:  # a float8 cache: q in the activations' dtype, k and v in the cache's
        tl.store(dq, o1.to(qo_ptr.dtype.element_ty), mask=mp & is_q)
        tl.store(dq + HALF, o2.to(qo_ptr.dtype.element_ty), mask=mp & is_q)
        tl.store(dc, o1.to(kc_ptr.dtype.element_ty), mask=mp & ~is_q)
        tl.store(dc + HALF, o2.to(kc_ptr.dtype.element_ty), mask=mp & ~is_q)


@triton.jit
def _rope_store(
    y,
    offs_m,
    mask_m,
    pid,
    pos,
    c,
    sn,
    qo_ptr,
    kc_ptr,
    vc_ptr,
    N,
    H,
    HKV,
    S,
    D: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    KV_SAME: tl.constexpr,
    PTX: tl.constexpr,
    tbl_ptr,
    TBL_STRIDE,
    PBS: tl.constexpr,
):
    """Outputs y [BM, BN] of tile pid's weight rows (`_pair_cols`) for activation rows offs_m: rounded to the
    activation dtype (as the unfused step stores its q|k|v rows), rotated at positions pos (`_rope_tables`),
    q heads into qo [B, 1, H, D], k and v heads into their cache slot pos[m] (`_kv_slot`)."""
    HALF: tl.constexpr = D // 2
    P: tl.constexpr = BN // 2
    yq = y.to(qo_ptr.dtype.element_ty).to(tl.float32)
    f1, f2 = tl.split(tl.permute(tl.reshape(yq, [BM, 2, P]), (0, 2, 1)))  # [BM, P] rows d and d + D/2
    head, d, inr, rot, is_q, is_k, kvh = _pair_roles(pid, N, H, HKV, HALF, P)
    r1, r2 = _rotate(f1, f2, c, sn, PTX)
    o1 = tl.where(rot[None, :], r1, f1)
    o2 = tl.where(rot[None, :], r2, f2)
    m2 = offs_m[:, None]
    dq = qo_ptr + (m2 * H + head[None, :]) * D + d[None, :]
    slot = _kv_slot(tbl_ptr, m2, kvh[None, :], pos, mask_m[:, None], HKV, S, TBL_STRIDE, PBS)
    dc = tl.where(is_k, kc_ptr, vc_ptr)[None, :] + slot * D + d[None, :]
    mp = mask_m[:, None] & inr[None, :]
    _store_halves(o1, o2, dq, dc, is_q[None, :], mp, qo_ptr, kc_ptr, HALF, KV_SAME)


@triton.jit
def _prefetch_rope(rows, mask_r, pos_ptr, cos_ptr, sin_ptr, d, mask_d, HALF: tl.constexpr, PTX: tl.constexpr):
    """`_prefetch_l2` of the cos / sin entries d [P] at the positions of rows [R], before the PDL wait: pos is
    final before any kernel of the step starts (ARCHITECTURE's invariants), and the tables are constant."""
    pe = tl.load(pos_ptr + rows, mask=mask_r, other=0, cache_modifier=".cg")  # not into L1: read again later
    at = pe[:, None] * HALF + d[None, :]  # [R, P]
    mp = mask_r[:, None] & mask_d[None, :]
    _prefetch_l2(cos_ptr + at, mp, PTX)
    _prefetch_l2(sin_ptr + at, mp, PTX)


@triton.jit
def _qkv_rope_kernel(
    q_ptr,
    a_ptr,
    rs_ptr,
    x_ptr,
    nw_ptr,
    w_ptr,
    s_ptr,
    qo_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    kc_ptr,
    vc_ptr,
    M,
    N,
    KW,
    H,
    HKV,
    S,
    stride_qw,
    K,
    stride_xm,
    eps,
    PER_ROW: tl.constexpr,
    PTX: tl.constexpr,
    D: tl.constexpr,
    BN: tl.constexpr,
    KWP: tl.constexpr,
    PDL: tl.constexpr = False,
    KV_SAME: tl.constexpr = True,
    PREQ: tl.constexpr = True,
    HAS_NORM: tl.constexpr = True,
    EARLY_NORM: tl.constexpr = False,
    tbl_ptr=None,
    TBL_STRIDE=0,
    PBS: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    HALF: tl.constexpr = D // 2
    P: tl.constexpr = BN // 2
    offs_n, mask_n = _pair_cols(pid, N, D, BN)
    offs_w = tl.arange(0, KWP)
    mw = offs_w < KW
    wv = tl.load(w_ptr + offs_n[:, None] * KW + offs_w[None, :], mask=mask_n[:, None] & mw[None, :], other=0)
    if PER_ROW:
        s = tl.load(s_ptr + offs_n, mask=mask_n, other=1.0)
    else:
        s = tl.load(s_ptr) + tl.zeros([BN], tl.float32)
    g0, g1, g2, g3 = s, s, s, s  # (unused without EARLY_NORM)
    if EARLY_NORM:  # (a quantizing program with a norm) constant too: off the critical path after the wait
        g0, g1, g2, g3 = _norm_slabs(nw_ptr, K, KW, offs_w, mw)
    # `_rope_store` for one row, kept one-dimensional: its [1, P] form measured 4% slower a batch-1 step
    head, d, mp, rot, is_q, is_k, kvh = _pair_roles(pid, N, H, HKV, HALF, P)
    if PDL:  # cos / sin into L2 too (constant data read after the wait would miss L2)
        rows = tl.arange(
            0, 16
        )  # the row kernel's M: up to DecodePlan.gemv_max_m (a hint: more rows go without)
        _prefetch_rope(rows, rows < M, pos_ptr, cos_ptr, sin_ptr, d, mp, HALF, PTX)
    _pdl_wait(PDL)  # the weight and scale loads above overlap the previous kernel
    cache = tl.where(is_k, kc_ptr, vc_ptr)
    for m in range(M):
        if EARLY_NORM:  # the position and its cos / sin issued with the row's loads, not after the dots
            pos = tl.load(pos_ptr + m)
            c = tl.load(cos_ptr + pos * HALF + d)
            sn = tl.load(sin_ptr + pos * HALF + d)
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
        y = _row_out(xw0, xw1, xw2, xw3, wv, rw, rs, a, s, PTX)
        yq = y.to(qo_ptr.dtype.element_ty).to(tl.float32)  # the q|k|v row as the unfused step stores it
        f1, f2 = tl.split(tl.permute(tl.reshape(yq, [2, P]), (1, 0)))
        if not EARLY_NORM:
            pos = tl.load(pos_ptr + m)
            c = tl.load(cos_ptr + pos * HALF + d)
            sn = tl.load(sin_ptr + pos * HALF + d)
        r1, r2 = _rotate(f1, f2, c, sn, PTX)
        o1 = tl.where(rot, r1, f1)
        o2 = tl.where(rot, r2, f2)
        dq = qo_ptr + (m * H + head) * D + d
        dc = cache + _kv_slot(tbl_ptr, m, kvh, pos, pos >= 0, HKV, S, TBL_STRIDE, PBS) * D + d
        _store_halves(o1, o2, dq, dc, is_q, mp, qo_ptr, kc_ptr, HALF, KV_SAME)


@triton.jit
def _qkv_rope_mma_kernel(
    q_ptr,
    a_ptr,
    rs_ptr,
    w_ptr,
    s_ptr,
    ws_ptr,
    cnt_ptr,
    qo_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    kc_ptr,
    vc_ptr,
    M,
    N,
    KP,
    CHUNKS_PER_SPLIT,
    stride_qm,
    H,
    HKV,
    S,
    PER_ROW: tl.constexpr,
    PTX: tl.constexpr,
    D: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BKB: tl.constexpr,
    SPLIT: tl.constexpr,
    SWAP: tl.constexpr,
    PDL: tl.constexpr = False,
    KV_SAME: tl.constexpr = True,
    tbl_ptr=None,
    TBL_STRIDE=0,
    PBS: tl.constexpr = 0,
):
    """The split-K tensor-core GEMM (`gemm._gemm_kernel`, GROUP_M == 0) over pre-quantized rows, whose tiles are
    rotation pairs (`_pair_cols`) and whose epilogue is `_rope_store`: q|k|v + RoPE + KV write at batch 3-64."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    b_lo = pid_s * CHUNKS_PER_SPLIT * BKB
    b_hi = tl.minimum(b_lo + CHUNKS_PER_SPLIT * BKB, KP)
    cols, mask_c = _pair_cols(pid_n, N, D, BN)
    if PDL:  # the weights are constant: into L2 while the quantization launch runs
        _prefetch_rows(w_ptr, cols, mask_c, KP, b_lo, b_hi, PTX)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask_m = offs_m < M
    if PDL:  # and the epilogue's constants: scales, cos / sin
        _prefetch_scales(s_ptr, cols, mask_c, PER_ROW, PTX)
        p1 = pid_n * (BN // 2) + tl.arange(0, BN // 2)
        _prefetch_rope(offs_m, mask_m, pos_ptr, cos_ptr, sin_ptr, p1 % (D // 2), p1 < N // 2, D // 2, PTX)
    _pdl_wait(PDL)
    acc, acc2 = _mma_loop(
        q_ptr,
        w_ptr,
        offs_m,
        cols,
        mask_m,
        mask_c,
        N,
        KP,
        b_lo,
        b_hi,
        stride_qm,
        False,
        PTX,
        SWAP,
        BM,
        BN,
        BKB,
    )
    # the epilogue's loads before the split-K hand-off: in flight while the partials go out
    a = tl.load(a_ptr + offs_m, mask=mask_m, other=1.0)
    rs = tl.load(rs_ptr + offs_m, mask=mask_m, other=0)
    pos, c, sn = _rope_tables(offs_m, mask_m, pid_n, N, pos_ptr, cos_ptr, sin_ptr, D, BN)
    last, acc, acc2 = _splitk_sum(
        acc, acc2, ws_ptr, cnt_ptr, pid_n, pid_s, pid_m, offs_m, cols, mask_m, mask_c, M, N, N, False, SPLIT
    )
    if last:
        y = _epilogue(acc, rs, a, s_ptr, cols, mask_c, PER_ROW, PTX)
        _rope_store(
            y,
            offs_m,
            mask_m,
            pid_n,
            pos,
            c,
            sn,
            qo_ptr,
            kc_ptr,
            vc_ptr,
            N,
            H,
            HKV,
            S,
            D,
            BM,
            BN,
            KV_SAME,
            PTX,
            tbl_ptr,
            TBL_STRIDE,
            PBS,
        )


class QuantBuf:
    """Pre-quantized activation rows for a projection over K inputs: q int8 [B, 4*Kp], a [B], rowsum [B]."""

    def __init__(self, b: int, k: int, device):
        self.k, self.kpad = k, 4 * packed_row_bytes(k)
        self.q = torch.zeros((b, self.kpad), dtype=torch.int8, device=device)
        self.a = torch.ones((b,), dtype=torch.float32, device=device)
        self.rs = torch.zeros((b,), dtype=torch.int32, device=device)


def quantize_into(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    buf: QuantBuf,
    eps: float,
    plan: DecodePlan | None = None,
) -> None:
    """rmsnorm? + per-row int8 quantization of x [M, K] into `buf` (rows 0..M-1), as ternary_linear's."""
    launch_quant(x, norm_weight, buf.q, buf.a, buf.rs, eps, plan=plan)


def qkv_rope_candidates(m: int, n: int, k: int, preq: bool, plan: DecodePlan | None = None) -> list[dict]:
    """`qkv_rope`'s candidate tiles for M rows of K values through N = (H + 2 Hkv) * D weight rows."""
    plan = resolve(plan)
    kp = packed_row_bytes(k)
    row = _row_candidates(kp // 4, False, "qkv_rope")  # row tiles: BN even, >= 2
    if not preq or m <= plan.row_max_m:
        return row
    # past the row GEMVs' rows: the split-K tensor-core tiles (BN weight rows = BN/2 pairs), the row GEMV's last
    mma = [c for c in _splitk_candidates(m, n, kp, False) if not c.get("PAIR")]
    return mma + (row[:2] if m <= plan.gemv_max_m else [])


@dataclass
class _QkvRope:
    """One `qkv_rope` call's operands; the pointers a kernel variant does not read hold `scale` as a stand-in."""

    src: QuantBuf | torch.Tensor
    m: int
    packed: torch.Tensor
    scale: torch.Tensor
    q_out: torch.Tensor
    rope: tuple  # (cos, sin, pos)
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    heads: tuple  # (n_heads, n_kv)
    norm_weight: torch.Tensor | None
    eps: float
    plan: DecodePlan
    paged: dict  # the kernels' block-table arguments
    preq: bool
    k: int

    @functools.cached_property
    def rows(self) -> tuple:
        """The row kernel's activation operands (`_row_operands`)."""
        return _row_operands(self)

    @property
    def n(self) -> int:
        return (self.heads[0] + 2 * self.heads[1]) * self.k_cache.shape[-1]


def _row_operands(c: _QkvRope) -> tuple:
    """(q words, a, rowsum, q row stride, x, norm weight, x row stride): pre-quantized rows, or the rows x
    themselves."""
    sc = c.scale
    if c.preq:
        return c.src.q.view(torch.int32), c.src.a, c.src.rs, c.src.q.stride(0) // 4, sc, sc, 0
    x = c.src.reshape(-1, c.k)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return sc, sc, sc, 0, x, c.norm_weight if c.norm_weight is not None else sc, x.stride(0)


def _launch_qkv_row(c: _QkvRope, cfg: dict, w: torch.Tensor) -> None:
    qw, a, rs, sq, x, nw, sx = c.rows
    n, kw, d = c.n, c.packed.shape[1] // 4, c.k_cache.shape[-1]
    _qkv_rope_kernel[(triton.cdiv(n // 2, cfg["BN"] // 2),)](
        qw,
        a,
        rs,
        x,
        nw,
        w.view(torch.int32),
        c.scale,
        c.q_out,
        *c.rope,
        c.k_cache,
        c.v_cache,
        c.m,
        n,
        kw,
        *c.heads,
        c.k_cache.shape[2],
        sq,
        c.k,
        sx,
        c.eps,
        PER_ROW=c.scale.numel() != 1,
        PTX=PTX,
        D=d,
        BN=cfg["BN"],
        KWP=triton.next_power_of_2(kw),
        num_warps=cfg["num_warps"],
        KV_SAME=c.k_cache.dtype == c.q_out.dtype,
        PREQ=c.preq,
        HAS_NORM=c.norm_weight is not None,
        EARLY_NORM=not c.preq and c.norm_weight is not None and c.k <= c.plan.early_norm_max_k,
        **c.paged,
        **pdl_kw(c.plan),
    )


def _launch_qkv_mma(c: _QkvRope, cfg: dict, w: torch.Tensor) -> None:
    n, m, src = c.n, c.m, c.src
    ws, cnt = _workspace(c.packed.device, m, n, cfg["SPLIT"])
    grid = (triton.cdiv(n // 2, cfg["BN"] // 2), cfg["SPLIT"], triton.cdiv(m, cfg["BM"]))
    _qkv_rope_mma_kernel[grid](
        src.q,
        src.a,
        src.rs,
        w,
        c.scale,
        ws,
        cnt,
        c.q_out,
        *c.rope,
        c.k_cache,
        c.v_cache,
        m,
        n,
        c.packed.shape[1],
        cfg["CPS"],
        src.q.stride(0),
        *c.heads,
        c.k_cache.shape[2],
        PER_ROW=c.scale.numel() != 1,
        PTX=PTX,
        D=c.k_cache.shape[-1],
        KV_SAME=c.k_cache.dtype == c.q_out.dtype,
        **{k2: v for k2, v in cfg.items() if k2 not in ("path", "CPS")},
        **c.paged,
        **pdl_kw(c.plan),
    )


def _launch_qkv(c: _QkvRope, cfg: dict, w: torch.Tensor | None = None) -> None:
    (_launch_qkv_mma if cfg["path"] == "splitk" else _launch_qkv_row)(c, cfg, c.packed if w is None else w)


def qkv_rope(
    src: QuantBuf | torch.Tensor,
    m: int,
    packed,
    scale,
    q_out,
    cos,
    sin,
    pos,
    k_cache,
    v_cache,
    n_heads,
    n_kv,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-5,
    plan: DecodePlan | None = None,
    table: torch.Tensor | None = None,
) -> None:
    """M activation rows through the q|k|v weights (`packed`, scale [1] or per row), then RoPE at positions
    pos[b]: q -> q_out [B, 1, H, D], k / v -> cache slot pos[b] (as ternary_linear + rope_cache).

    src: a `QuantBuf` of pre-quantized rows (`quantize_into`), or the rows x [M, K] themselves, which every
    program then normalizes (norm_weight) and quantizes itself: one launch instead of two, as
    ternary_linear(path="row") does. plan: the `DecodePlan` (None: the default plan). table: a paged cache's block
    table (see `attention.attn_decode`)."""
    plan = resolve(plan)
    pbs = table_block_size(table, m, k_cache, "qkv_rope")
    paged = {"tbl_ptr": table, "TBL_STRIDE": table.stride(0) if pbs else 0, "PBS": pbs}
    preq = isinstance(src, QuantBuf)
    k = src.k if preq else src.shape[-1]
    d = k_cache.shape[-1]
    n = (n_heads + 2 * n_kv) * d
    check_packed(packed, n, k, "qkv_rope")
    c = _QkvRope(
        src, m, packed, scale.reshape(-1), q_out, (cos, sin, pos), k_cache, v_cache, (n_heads, n_kv),
        norm_weight, eps, plan, paged, preq, k,
    )  # fmt: skip
    # tuned per power-of-two bucket of rows, as ternary_linear
    bucket = m if m <= plan.row_max_m else min(_next_pow2(m), 1024)
    key = ("qkv_rope", n, k, bucket, c.scale.numel() != 1, d, k_cache.dtype, preq)
    launch = functools.partial(_launch_qkv, c)
    launch(_tune(key, lambda: qkv_rope_candidates(m, n, k, preq, plan), launch, packed))
