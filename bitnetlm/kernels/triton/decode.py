"""The q|k|v projection of the batch-1/2 CUDA-graph decode step with RoPE and the KV-cache write fused in.

`_qkv_rope_kernel` is the row GEMV (`gemv._gemv_row_kernel`) whose BN
weight rows are BN/2 rotation pairs (d, d + D/2) of the heads, so a program rotates its own outputs and writes
q into the query buffer [B, 1, H, D] and k / v straight into the KV-cache slot pos: no q|k|v round trip and no
RoPE launch (`attention.rope_cache`). The results equal the unfused launches bit for bit: the outputs are
rounded to the activation dtype before the rotation, as the stored q|k|v rows are in the unfused step.

The activation rows come pre-quantized (`quantize_into`, one launch before) or as they are: then every program
normalizes and quantizes the whole row itself (`quant._quant_words`, as the row GEMV's PREQ=False path), which
the batch-1 step uses. (A quantizing tail -- the last program of o / gate|up / down / attention quantizing the
whole output row for the next projection -- was measured slower than the separate `_quant_kernel` launch on an
H100, 1-2 us a projection, and is not used.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bitnetlm.kernels.triton.common import _pdl_wait
from bitnetlm.kernels.triton.gemv import _load_qrow, _row_out
from bitnetlm.kernels.triton.launch import PTX, check_packed, launch_quant, pdl_kw
from bitnetlm.kernels.triton.layout import packed_row_bytes
from bitnetlm.kernels.triton.quant import _quant_words
from bitnetlm.kernels.triton.tune import _row_candidates, _tune


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
):
    pid = tl.program_id(0)
    j = tl.arange(0, BN)
    HALF: tl.constexpr = D // 2
    P: tl.constexpr = BN // 2
    pp = pid * P + j % P  # rotation pair of each row: rows d and d + D/2 of a head side by side
    offs_n = (pp // HALF) * D + pp % HALF + tl.where(j >= P, HALF, 0)
    mask_n = pp < N // 2
    offs_w = tl.arange(0, KWP)
    mw = offs_w < KW
    wv = tl.load(w_ptr + offs_n[:, None] * KW + offs_w[None, :], mask=mask_n[:, None] & mw[None, :], other=0)
    if PER_ROW:
        s = tl.load(s_ptr + offs_n, mask=mask_n, other=1.0)
    else:
        s = tl.load(s_ptr) + tl.zeros([BN], tl.float32)
    _pdl_wait(PDL)  # the weight and scale loads above overlap the previous kernel
    p1 = pid * P + tl.arange(0, P)
    mp = p1 < N // 2
    head = p1 // HALF
    d = p1 % HALF
    rot = head < H + HKV
    # one store pair for q, k and v alike: heads 0..H-1 are q, then the k heads, then the v heads
    is_q = head < H
    is_k = (head >= H) & rot
    kvh = tl.where(is_k, head - H, head - H - HKV)
    cache = tl.where(is_k, kc_ptr, vc_ptr)
    for m in range(M):
        if PREQ:
            xw0, xw1, xw2, xw3, a, rs = _load_qrow(
                q_ptr + m * stride_qw, a_ptr + m, rs_ptr + m, KW, offs_w, mw
            )
        else:  # rmsnorm? + quantization of the whole row in every program (no separate launch)
            xw0, xw1, xw2, xw3, a, rs = _quant_words(
                x_ptr + m * stride_xm, nw_ptr, K, KW, eps, offs_w, mw, HAS_NORM, PTX
            )
        y = _row_out(xw0, xw1, xw2, xw3, wv, rs, a, s, PTX)
        yq = y.to(qo_ptr.dtype.element_ty).to(tl.float32)  # the q|k|v row as the unfused step stores it
        f1, f2 = tl.split(tl.permute(tl.reshape(yq, [2, P]), (1, 0)))
        pos = tl.load(pos_ptr + m)
        c = tl.load(cos_ptr + pos * HALF + d)
        sn = tl.load(sin_ptr + pos * HALF + d)
        o1 = tl.where(rot, f1 * c - f2 * sn, f1)
        o2 = tl.where(rot, f2 * c + f1 * sn, f2)
        dq = qo_ptr + (m * H + head) * D + d
        dc = cache + ((m * HKV + kvh) * S + pos) * D + d
        if KV_SAME:  # one store pair for q, k and v alike
            dst = tl.where(is_q, dq, dc)
            tl.store(dst, o1.to(kc_ptr.dtype.element_ty), mask=mp)
            tl.store(dst + HALF, o2.to(kc_ptr.dtype.element_ty), mask=mp)
        else:  # a float8 cache: q in the activations' dtype, k and v in the cache's
            tl.store(dq, o1.to(qo_ptr.dtype.element_ty), mask=mp & is_q)
            tl.store(dq + HALF, o2.to(qo_ptr.dtype.element_ty), mask=mp & is_q)
            tl.store(dc, o1.to(kc_ptr.dtype.element_ty), mask=mp & ~is_q)
            tl.store(dc + HALF, o2.to(kc_ptr.dtype.element_ty), mask=mp & ~is_q)


class QuantBuf:
    """Pre-quantized activation rows for a projection over K inputs: q int8 [B, 4*Kp], a [B], rowsum [B]."""

    def __init__(self, b: int, k: int, device):
        self.k, self.kpad = k, 4 * packed_row_bytes(k)
        self.q = torch.zeros((b, self.kpad), dtype=torch.int8, device=device)
        self.a = torch.ones((b,), dtype=torch.float32, device=device)
        self.rs = torch.zeros((b,), dtype=torch.int32, device=device)


def quantize_into(x: torch.Tensor, norm_weight: torch.Tensor | None, buf: QuantBuf, eps: float) -> None:
    """rmsnorm? + per-row int8 quantization of x [M, K] into `buf` (rows 0..M-1), as ternary_linear's."""
    launch_quant(x, norm_weight, buf.q, buf.a, buf.rs, eps)


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
) -> None:
    """M activation rows through the q|k|v weights (`packed`, scale [1] or per row), then RoPE at positions
    pos[b]: q -> q_out [B, 1, H, D], k / v -> cache slot pos[b] (as ternary_linear + rope_cache).

    src: a `QuantBuf` of pre-quantized rows (`quantize_into`), or the rows x [M, K] themselves, which every
    program then normalizes (norm_weight) and quantizes itself: one launch instead of two, as
    ternary_linear(path="row") does."""
    preq = isinstance(src, QuantBuf)
    k = src.k if preq else src.shape[-1]
    d, s_len = k_cache.shape[-1], k_cache.shape[2]
    n = (n_heads + 2 * n_kv) * d
    check_packed(packed, n, k, "qkv_rope")
    kw = packed.shape[1] // 4
    scale = scale.reshape(-1)
    if preq:  # the pointers a variant does not read get `scale` as a stand-in
        qw, a, rs, sq = src.q.view(torch.int32), src.a, src.rs, src.q.stride(0) // 4
        x, nw, sx = scale, scale, 0
    else:
        x = src.reshape(-1, k)
        if x.stride(-1) != 1:
            x = x.contiguous()
        qw, a, rs, sq = scale, scale, scale, 0
        nw, sx = norm_weight if norm_weight is not None else scale, x.stride(0)

    def launch(cfg):
        _qkv_rope_kernel[(triton.cdiv(n // 2, cfg["BN"] // 2),)](
            qw,
            a,
            rs,
            x,
            nw,
            packed.view(torch.int32),
            scale,
            q_out,
            cos,
            sin,
            pos,
            k_cache,
            v_cache,
            m,
            n,
            kw,
            n_heads,
            n_kv,
            s_len,
            sq,
            k,
            sx,
            eps,
            PER_ROW=scale.numel() != 1,
            PTX=PTX,
            D=d,
            BN=cfg["BN"],
            KWP=triton.next_power_of_2(kw),
            num_warps=cfg["num_warps"],
            KV_SAME=k_cache.dtype == q_out.dtype,
            PREQ=preq,
            HAS_NORM=norm_weight is not None,
            **pdl_kw(),
        )

    key = ("qkv_rope", n, k, m, scale.numel() != 1, d, k_cache.dtype, preq)
    launch(_tune(key, lambda: _row_candidates(kw, False, "qkv_rope"), launch))  # row tiles: BN even, >= 2
