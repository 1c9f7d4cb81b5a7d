"""Small Triton kernels of the decode step: RoPE + KV-cache write, single-query attention, RMSNorm, gated act.

Each replaces several eager PyTorch kernels with one launch, which is what a CUDA-graph decode step at batch 1
is made of. Layouts: qkv rows [B*T, (H + 2*Hkv) * D] (q heads, then k heads, then v heads; HF rotate-half RoPE);
KV cache [B, Hkv, S, D]; queries out [B, H, T, D].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bitnetlm.kernels.triton.kernels import ACT_CODES, INTERPRET, _activate


@triton.jit
def _rope_cache_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    T,
    H,
    HKV,
    S,
    stride_row,
    D: tl.constexpr,
    HALF: tl.constexpr,
):
    row = tl.program_id(0)  # b * T + t
    hh = tl.program_id(1)  # 0..H-1 q heads, H..H+HKV-1 k heads, then v heads
    b = row // T
    t = row % T
    pos = tl.load(pos_ptr + b) + t
    d = tl.arange(0, HALF)
    src = qkv_ptr + row * stride_row + hh * D
    x1 = tl.load(src + d)
    x2 = tl.load(src + HALF + d)
    if hh < H + HKV:
        c = tl.load(cos_ptr + pos * HALF + d)
        s = tl.load(sin_ptr + pos * HALF + d)
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        o1 = f1 * c - f2 * s
        o2 = f2 * c + f1 * s
        if hh < H:
            dst = q_ptr + ((b * H + hh) * T + t) * D
            tl.store(dst + d, o1.to(q_ptr.dtype.element_ty))
            tl.store(dst + HALF + d, o2.to(q_ptr.dtype.element_ty))
        else:
            dst = k_ptr + ((b * HKV + (hh - H)) * S + pos) * D
            tl.store(dst + d, o1.to(k_ptr.dtype.element_ty))
            tl.store(dst + HALF + d, o2.to(k_ptr.dtype.element_ty))
    else:
        dst = v_ptr + ((b * HKV + (hh - H - HKV)) * S + pos) * D
        tl.store(dst + d, x1.to(v_ptr.dtype.element_ty))
        tl.store(dst + HALF + d, x2.to(v_ptr.dtype.element_ty))


def rope_cache(qkv, cos, sin, pos, q_out, k_cache, v_cache, n_heads: int, n_kv: int, t: int) -> None:
    """Rotate q/k of `qkv` [B*T, (H+2Hkv)*D] at positions pos[b]+t; q -> q_out [B,H,T,D], k/v -> cache slots."""
    d = k_cache.shape[-1]
    grid = (qkv.shape[0], n_heads + 2 * n_kv)
    _rope_cache_kernel[grid](
        qkv,
        cos,
        sin,
        pos,
        q_out,
        k_cache,
        v_cache,
        t,
        n_heads,
        n_kv,
        k_cache.shape[2],
        qkv.stride(0),
        D=d,
        HALF=d // 2,
        num_warps=1,
    )


@triton.jit
def _attn_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    o_ptr,
    sm_scale,
    H,
    HKV,
    S,
    D: tl.constexpr,
    BS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // (H // HKV)
    n = tl.load(pos_ptr + b) + 1  # keys 0..pos[b] are this row's context
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + (b * H + h) * D + offs_d).to(tl.float32) * sm_scale
    kb = k_ptr + (b * HKV + kvh) * S * D
    vb = v_ptr + (b * HKV + kvh) * S * D
    m_i = tl.max(tl.full([BS], float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([BS], tl.float32), axis=0)
    acc = tl.zeros([D], tl.float32)
    for s0 in range(0, n, BS):
        offs_s = s0 + tl.arange(0, BS)
        ms = offs_s < n
        k = tl.load(kb + offs_s[:, None] * D + offs_d[None, :], mask=ms[:, None], other=0.0).to(tl.float32)
        sc = tl.sum(k * q[None, :], axis=1)
        sc = tl.where(ms, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=0))
        p = tl.exp(sc - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(vb + offs_s[:, None] * D + offs_d[None, :], mask=ms[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    tl.store(o_ptr + (b * H + h) * D + offs_d, (acc / l_i).to(o_ptr.dtype.element_ty))


@triton.jit
def _attn_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    o_ptr,
    pacc_ptr,
    pml_ptr,
    cnt_ptr,
    sm_scale,
    H,
    HKV,
    S,
    NSPLIT,
    D: tl.constexpr,
    CHUNK: tl.constexpr,
    NS2: tl.constexpr,
):
    """Flash-decoding: program (b, h, split) scores one CHUNK of keys; the last split of (b, h) to finish (an
    atomic counter) merges the partial (max, sum, acc) of all splits and resets the counter for the next call."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    kvh = h // (H // HKV)
    n = tl.load(pos_ptr + b) + 1
    offs_d = tl.arange(0, D)
    offs_s = sp * CHUNK + tl.arange(0, CHUNK)
    ms = offs_s < n
    q = tl.load(q_ptr + (b * H + h) * D + offs_d).to(tl.float32) * sm_scale
    base = (b * HKV + kvh) * S * D
    k = tl.load(k_ptr + base + offs_s[:, None] * D + offs_d[None, :], mask=ms[:, None], other=0.0).to(
        tl.float32
    )
    sc = tl.where(ms, tl.sum(k * q[None, :], axis=1), float("-inf"))
    m = tl.max(sc, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp(sc - m_safe)
    v = tl.load(v_ptr + base + offs_s[:, None] * D + offs_d[None, :], mask=ms[:, None], other=0.0).to(
        tl.float32
    )
    row = (b * H + h) * NSPLIT + sp
    tl.store(pacc_ptr + row * D + offs_d, tl.sum(p[:, None] * v, axis=0))
    tl.store(pml_ptr + row * 2, m)
    tl.store(pml_ptr + row * 2 + 1, tl.sum(p, axis=0))
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + b * H + h, 1, sem="acq_rel")
    if done == NSPLIT - 1:
        tl.debug_barrier()
        tl.atomic_xchg(cnt_ptr + b * H + h, 0, sem="relaxed")
        offs_p = tl.arange(0, NS2)
        mp = offs_p < NSPLIT
        rows = (b * H + h) * NSPLIT + offs_p
        # .cg: read the other programs' partials from L2, never from a stale L1 line of an earlier replay
        m_all = tl.load(pml_ptr + rows * 2, mask=mp, other=float("-inf"), cache_modifier=".cg")
        l_all = tl.load(pml_ptr + rows * 2 + 1, mask=mp, other=0.0, cache_modifier=".cg")
        acc = tl.load(
            pacc_ptr + rows[:, None] * D + offs_d[None, :], mask=mp[:, None], other=0.0, cache_modifier=".cg"
        )
        mx = tl.max(m_all, axis=0)
        w = tl.where(m_all == float("-inf"), 0.0, tl.exp(m_all - mx))
        o = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_all * w, axis=0)
        tl.store(o_ptr + (b * H + h) * D + offs_d, o.to(o_ptr.dtype.element_ty))


ATTN_CHUNK = 64  # keys per program: decode attention is latency-bound, so spread it over many programs
_attn_ws: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def attn_decode(q, k_cache, v_cache, pos, out, sm_scale: float) -> None:
    """One query per row: q [B, H, D] attends to cache slots 0..pos[b]; out [B, H, D]."""
    b, h, d = q.shape[0], q.shape[1], q.shape[-1]
    s = k_cache.shape[2]
    chunk = 16 if INTERPRET else ATTN_CHUNK
    nsplit = triton.cdiv(s, chunk)
    key = (str(q.device), b, h, nsplit, d)
    if key not in _attn_ws:  # partials + zeroed counters, allocated before any graph capture (warm-up call)
        _attn_ws[key] = (
            torch.empty((b * h * nsplit, d), dtype=torch.float32, device=q.device),
            torch.empty((b * h * nsplit, 2), dtype=torch.float32, device=q.device),
            torch.zeros((b * h,), dtype=torch.int32, device=q.device),
        )
    pacc, pml, cnt = _attn_ws[key]
    _attn_split_kernel[(b, h, nsplit)](
        q,
        k_cache,
        v_cache,
        pos,
        out,
        pacc,
        pml,
        cnt,
        sm_scale,
        h,
        k_cache.shape[1],
        s,
        nsplit,
        D=d,
        CHUNK=chunk,
        NS2=triton.next_power_of_2(nsplit),
        num_warps=1 if INTERPRET else 4,
    )


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, K, stride_x, stride_y, eps, BK: tl.constexpr):
    m = tl.program_id(0)
    offs = tl.arange(0, BK)
    mk = offs < K
    x = tl.load(x_ptr + m * stride_x + offs, mask=mk, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mk, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / K + eps)
    tl.store(y_ptr + m * stride_y + offs, ((x * rstd) * w).to(y_ptr.dtype.element_ty), mask=mk)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    y = torch.empty_like(x2)
    _rmsnorm_kernel[(x2.shape[0],)](
        x2,
        w,
        y,
        k,
        x2.stride(0),
        y.stride(0),
        eps,
        BK=triton.next_power_of_2(k),
        num_warps=1 if INTERPRET else (8 if k > 4096 else 4),
    )
    return y.reshape(x.shape)


@triton.jit
def _gated_act_kernel(x_ptr, y_ptr, N, stride_x, stride_y, ACT: tl.constexpr, BN: tl.constexpr):
    m = tl.program_id(0)
    offs = tl.program_id(1) * BN + tl.arange(0, BN)
    mk = offs < N
    g = tl.load(x_ptr + m * stride_x + offs, mask=mk, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + m * stride_x + N + offs, mask=mk, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_y + offs, (_activate(g, ACT) * u).to(y_ptr.dtype.element_ty), mask=mk)


def gated_act(x: torch.Tensor, act: str = "relu2") -> torch.Tensor:
    """x [M, 2N] = gate | up -> act(gate) * up [M, N] (the bf16 path's MLP middle)."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    bn = 1024
    _gated_act_kernel[(x2.shape[0], triton.cdiv(n, bn))](
        x2, y, n, x2.stride(0), y.stride(0), ACT=ACT_CODES[act], BN=bn
    )
    return y.reshape(*x.shape[:-1], n)
