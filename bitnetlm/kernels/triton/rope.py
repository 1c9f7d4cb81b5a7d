"""RoPE + KV-cache write: one launch for every token row of a prefill (and of the decode steps that do not fuse it
into their q|k|v projection, `decode.py`).

Layouts: qkv rows [B*T, (H + 2*Hkv) * D] (q heads, then k heads, then v heads; HF rotate-half RoPE); KV cache
[B, Hkv, S, D]; queries out [B, T, H, D] (the memory order SDPA's output keeps, so the attention output reaches
o_proj as [B*T, H*D] rows without a copy).
"""

from __future__ import annotations

import triton
import triton.language as tl

from bitnetlm.kernels.triton.common import INTERPRET, _kv_slot, _pdl_wait, _rotate, pdl_kw, table_block_size
from bitnetlm.kernels.triton.plan import DecodePlan


@triton.jit
def _store_halves(p, a, b, mask, HALF: tl.constexpr):
    """A head's rotate-half pair: a [HP, HALF] at p, b at p + HALF, both in p's element dtype."""
    tl.store(p, a.to(p.dtype.element_ty), mask=mask)
    tl.store(p + HALF, b.to(p.dtype.element_ty), mask=mask)


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
    copy_ptr,
    ROW0,
    k16_ptr,
    v16_ptr,
    TP,
    D: tl.constexpr,
    HALF: tl.constexpr,
    HP: tl.constexpr,
    PTX: tl.constexpr,
    COPY: tl.constexpr = False,
    KV16: tl.constexpr = False,
    PDL: tl.constexpr = False,
    tbl_ptr=None,
    TBL_STRIDE=0,
    PBS: tl.constexpr = 0,
):
    """One program per token row, all heads at once ([HP, D/2] halves): q heads rotated into q, k heads rotated
    into the cache slot pos, v heads copied into theirs. COPY (one row, B = 1): k and v also into cache row
    copy_ptr[0] (k_ptr being row ROW0 of a cache [R, HKV, S, D]). KV16: k and v as the cache holds them (its
    dtype's rounding) also into k16/v16 [B, HKV, TP, D] at slot t, in their own (attention) dtype. PBS > 0: k and
    v into a paged cache's pools through the block table (`_kv_slot`; no COPY)."""
    row = tl.program_id(0)  # b * T + t
    _pdl_wait(PDL)
    b = row // T
    t = row % T
    pos = tl.load(pos_ptr + b) + t
    hh = tl.arange(0, HP)  # 0..H-1 q heads, H..H+HKV-1 k heads, then v heads
    d = tl.arange(0, HALF)
    mh = (hh < H + 2 * HKV)[:, None]
    src = qkv_ptr + row * stride_row + hh[:, None] * D + d[None, :]
    f1 = tl.load(src, mask=mh, other=0.0).to(tl.float32)
    f2 = tl.load(src + HALF, mask=mh, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + pos * HALF + d)[None, :]
    s = tl.load(sin_ptr + pos * HALF + d)[None, :]
    rot = (hh < H + HKV)[:, None]
    r1, r2 = _rotate(f1, f2, c, s, PTX)
    o1 = tl.where(rot, r1, f1)
    o2 = tl.where(rot, r2, f2)
    mq = (hh < H)[:, None]
    dq = q_ptr + ((row * H + hh) * D)[:, None] + d[None, :]  # q [B, T, H, D]
    _store_halves(dq, o1, o2, mq, HALF)
    mk = ((hh >= H) & (hh < H + HKV))[:, None]
    mv = ((hh >= H + HKV) & (hh < H + 2 * HKV))[:, None]
    if PBS:
        ks = _kv_slot(tbl_ptr, b, hh - H, pos, pos >= 0, HKV, S, TBL_STRIDE, PBS)
        vs = _kv_slot(tbl_ptr, b, hh - H - HKV, pos, pos >= 0, HKV, S, TBL_STRIDE, PBS)
        dk = k_ptr + (ks * D)[:, None] + d[None, :]
        dv = v_ptr + (vs * D)[:, None] + d[None, :]
    else:
        dk = k_ptr + (((b * HKV + (hh - H)) * S + pos) * D)[:, None] + d[None, :]
        dv = v_ptr + (((b * HKV + (hh - H - HKV)) * S + pos) * D)[:, None] + d[None, :]
    _store_halves(dk, o1, o2, mk, HALF)
    _store_halves(dv, o1, o2, mv, HALF)
    # COPY: the captured prefill (its scratch row for the attention, the prompt's row for the decode steps)
    if COPY:
        delta = (tl.load(copy_ptr).to(tl.int64) - ROW0) * (HKV * S * D)
        _store_halves(dk + delta, o1, o2, mk, HALF)
        _store_halves(dv + delta, o1, o2, mv, HALF)
    # KV16: a prefill's attention operands without an upcast launch of the cache per layer (float8 cache)
    if KV16:
        d16 = (((b * HKV + (hh - H)) * TP + t) * D)[:, None] + d[None, :]
        _store_halves(k16_ptr + d16, o1.to(k_ptr.dtype.element_ty), o2.to(k_ptr.dtype.element_ty), mk, HALF)
        d16 = d16 - (HKV * TP * D)  # v heads' index hh - H - HKV
        _store_halves(v16_ptr + d16, o1.to(v_ptr.dtype.element_ty), o2.to(v_ptr.dtype.element_ty), mv, HALF)


def rope_cache(
    qkv,
    cos,
    sin,
    pos,
    q_out,
    k_cache,
    v_cache,
    n_heads: int,
    n_kv: int,
    t: int,
    copy_to=None,
    row0: int = 0,
    kv16=None,
    plan: DecodePlan | None = None,
    table=None,
) -> None:
    """Rotate q/k of `qkv` [B*T, (H+2Hkv)*D] at positions pos[b]+t; q -> q_out [B,T,H,D], k/v -> cache slots.
    copy_to: int64 [1] on the device, a second cache row for k/v (B = 1; k_cache/v_cache being row `row0` of
    contiguous caches [R, Hkv, S, D]), read at run time: a captured prefill's target row.
    kv16: (k16, v16), contiguous [B, Hkv, TP >= T, D] of q_out's dtype: slot t also gets token t's k/v as the
    cache stores them, upcast (a float8 cache's values for the prefill attention, bit for bit).
    table: int32 [B, blocks a row] of a paged cache, whose k_cache / v_cache are pools [blocks, Hkv, block size, D]
    (see `attention.attn_decode`); no copy_to then."""
    d = k_cache.shape[-1]
    rows = qkv.shape[0] // t
    pbs = table_block_size(table, rows, k_cache, "rope_cache")
    if pbs and copy_to is not None:
        raise ValueError("rope_cache: copy_to writes a static cache's second row; a paged cache has none")
    hp = triton.next_power_of_2(n_heads + 2 * n_kv)
    if copy_to is not None and k_cache.shape[0] != 1:
        raise ValueError(f"rope_cache: copy_to needs one cache row, found {k_cache.shape[0]}")
    k16, v16 = (
        (q_out, q_out) if kv16 is None else _checked_kv16(kv16, (rows, n_kv, kv16[0].shape[2], d), t, q_out)
    )
    _rope_cache_kernel[(qkv.shape[0],)](
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
        copy_to if copy_to is not None else pos,
        row0,
        k16,
        v16,
        k16.shape[2] if kv16 is not None else 0,
        D=d,
        HALF=d // 2,
        HP=hp,
        PTX=not INTERPRET,
        COPY=copy_to is not None,
        KV16=kv16 is not None,
        num_warps=1 if INTERPRET else max(1, min(8, hp * d // 512)),
        tbl_ptr=table,
        TBL_STRIDE=table.stride(0) if pbs else 0,
        PBS=pbs,
        **pdl_kw(plan),
    )


def _checked_kv16(kv16, want: tuple, t: int, q_out) -> tuple:
    """(k16, v16) of `rope_cache`, checked to be contiguous, of q_out's dtype, of shape `want` with >= t slots."""
    for name, x in zip(("k16", "v16"), kv16, strict=True):
        if tuple(x.shape) != want or x.shape[2] < t or not x.is_contiguous() or x.dtype != q_out.dtype:
            raise ValueError(
                f"rope_cache: {name} must be contiguous {q_out.dtype} [B, Hkv, TP >= {t}, D] = {want}, "
                f"found {x.dtype} {tuple(x.shape)}{'' if x.is_contiguous() else ' (not contiguous)'}"
            )
    return tuple(kv16)
