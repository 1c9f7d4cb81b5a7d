"""The decode kernels over a paged KV cache (pools of fixed-size blocks and a per-row block table) equal the same
kernels over a static cache bit for bit: the attention reads, and the RoPE + KV writes (`rope_cache`, the fused
q|k|v kernels), land in the slots the table names. Without a GPU they run under Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_decode_fused import _rand, _rope_tables, _tern
from triton_interp import DEV, triton_modules

A, R, F, L = triton_modules("attention", "rope", "decode", "launch")


def _paged(static: torch.Tensor, bs: int, seed: int, spare_cols: int = 2):
    """(pool [blocks, Hkv, bs, D], table int32 [B, S / bs + spare_cols]) holding a static cache [B, Hkv, S, D]: each
    row's blocks at random distinct ids of a pool with spare (garbage) blocks; the table's spare columns name
    block 0 (never read)."""
    b, hkv, s, d = static.shape
    nb = s // bs
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(b * nb + 3, generator=g)[: b * nb].view(b, nb)
    pool = torch.randn((b * nb + 3, hkv, bs, d), generator=g).to(static.dtype).to(static.device)
    for r in range(b):
        for j in range(nb):
            pool[ids[r, j]] = static[r, :, j * bs : (j + 1) * bs]
    table = torch.zeros((b, nb + spare_cols), dtype=torch.int32)
    table[:, :nb] = ids
    return pool, table.to(static.device)


def _unpaged(pool: torch.Tensor, table: torch.Tensor, s: int) -> torch.Tensor:
    """The static cache [B, Hkv, s, D] a pool and its table hold."""
    bs = pool.shape[2]
    blocks = pool[table[:, : s // bs].long()]  # [B, nb, Hkv, bs, D]
    return blocks.permute(0, 2, 1, 3, 4).reshape(table.shape[0], pool.shape[1], s, pool.shape[3])


@pytest.mark.parametrize("keys", [0, 16, 1024])
@pytest.mark.parametrize("bs", [16, 8, 32])
@pytest.mark.parametrize("h,hkv", [(4, 2), (6, 2)])
def test_decode_attention_paged_equals_static(h, hkv, bs, keys):
    """Blocks of the attention's key tile (16 keys here), smaller (a tile spans two blocks) and larger; contexts
    of 1 key, block boundaries and the whole row; the default splits and the short-context ranges."""
    g = torch.Generator().manual_seed(11)
    b, s, d = 5, 64, 16
    q = torch.randn(b, h, d, generator=g).to(DEV)
    kc = torch.randn(b, hkv, s, d, generator=g).to(DEV)
    vc = torch.randn(b, hkv, s, d, generator=g).to(DEV)
    pos = torch.tensor([37, 15, 0, 47, 63], dtype=torch.int32, device=DEV)
    kp, table = _paged(kc, bs, 1)
    vp, _ = _paged(vc, bs, 1)  # (the same block ids: drawn from the seed)
    ref = torch.full((b, h, d), float("nan"), device=DEV)
    A.attn_decode(q, kc, vc, pos, ref, d**-0.5, keys)
    for _ in range(2):  # twice: the merge counters are reset
        out = torch.full((b, h, d), float("nan"), device=DEV)
        A.attn_decode(q, kp, vp, pos, out, d**-0.5, keys, table=table)
        assert torch.equal(out, ref)


def test_decode_attention_paged_reads_only_its_blocks():
    """Garbage (NaN) in every block the table does not name for a row's live keys leaves the output finite and
    unchanged."""
    g = torch.Generator().manual_seed(5)
    b, h, hkv, s, d, bs = 3, 4, 2, 48, 16, 16
    q = torch.randn(b, h, d, generator=g).to(DEV)
    kc = torch.randn(b, hkv, s, d, generator=g).to(DEV)
    vc = torch.randn(b, hkv, s, d, generator=g).to(DEV)
    pos = torch.tensor([20, 5, 31], dtype=torch.int32, device=DEV)
    kp, table = _paged(kc, bs, 2)
    vp, _ = _paged(vc, bs, 2)
    live = {int(table[r, j]) for r in range(b) for j in range(int(pos[r]) // bs + 1)}
    for blk in range(kp.shape[0]):
        if blk not in live:
            kp[blk] = float("nan")
            vp[blk] = float("nan")
    ref = torch.empty((b, h, d), device=DEV)
    A.attn_decode(q, kc, vc, pos, ref, d**-0.5)
    out = torch.empty((b, h, d), device=DEV)
    A.attn_decode(q, kp, vp, pos, out, d**-0.5, table=table)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("t", [1, 5])
def test_rope_cache_paged_equals_static(t):
    """A decode step (T = 1) and a prefill chunk (T = 5) crossing a block boundary: the same queries, and the pool
    holds what the static cache holds, at the table's slots (and nothing else changed)."""
    b, nh, nkv, hd, s, bs = 2, 4, 2, 16, 32, 8
    qkv = _rand((b * t, (nh + 2 * nkv) * hd), 3, DEV)
    cos, sin = _rope_tables(hd, s, DEV)
    pos = torch.tensor([6, 13], dtype=torch.int32, device=DEV)
    kc, vc = _rand((b, nkv, s, hd), 4, DEV), _rand((b, nkv, s, hd), 5, DEV)
    kp, table = _paged(kc, bs, 3)
    vp, _ = _paged(vc, bs, 3)
    spare_k, spare_v = kp.clone(), vp.clone()
    q_ref, q = (torch.zeros((b, t, nh, hd), device=DEV) for _ in range(2))
    R.rope_cache(qkv, cos, sin, pos, q_ref, kc, vc, nh, nkv, t)
    R.rope_cache(qkv, cos, sin, pos, q, kp, vp, nh, nkv, t, table=table)
    assert torch.equal(q, q_ref)
    assert torch.equal(_unpaged(kp, table, s), kc) and torch.equal(_unpaged(vp, table, s), vc)
    used = set(table[:, : s // bs].flatten().tolist())
    for blk in set(range(kp.shape[0])) - used:
        assert torch.equal(kp[blk], spare_k[blk]) and torch.equal(vp[blk], spare_v[blk])


def test_rope_cache_paged_kv16_and_refusals():
    """A paged prefill also fills the attention's contiguous kv16 operands; copy_to (a static cache's second row)
    and a table of the wrong dtype are refused."""
    b, t, nh, nkv, hd, s, bs = 1, 6, 2, 1, 16, 16, 4
    qkv = _rand((b * t, (nh + 2 * nkv) * hd), 7, DEV)
    cos, sin = _rope_tables(hd, s, DEV)
    pos = torch.zeros((b,), dtype=torch.int32, device=DEV)
    kc, vc = torch.zeros((b, nkv, s, hd), device=DEV), torch.zeros((b, nkv, s, hd), device=DEV)
    kp, table = _paged(kc, bs, 4)
    vp, _ = _paged(vc, bs, 4)
    k16, v16 = torch.zeros((b, nkv, 8, hd), device=DEV), torch.zeros((b, nkv, 8, hd), device=DEV)
    q = torch.zeros((b, t, nh, hd), device=DEV)
    R.rope_cache(qkv, cos, sin, pos, q, kp, vp, nh, nkv, t, kv16=(k16, v16), table=table)
    assert torch.equal(k16[:, :, :t], _unpaged(kp, table, s)[:, :, :t])
    assert torch.equal(v16[:, :, :t], _unpaged(vp, table, s)[:, :, :t])
    row = torch.zeros((1,), dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match="copy_to"):
        R.rope_cache(qkv, cos, sin, pos, q, kp, vp, nh, nkv, t, copy_to=row, table=table)
    with pytest.raises(ValueError, match="int32"):
        R.rope_cache(qkv, cos, sin, pos, q, kp, vp, nh, nkv, t, table=table.long())


@pytest.mark.parametrize("m", [1, 2, 5])
def test_qkv_rope_paged_equals_static(m):
    """The fused q|k|v + RoPE + KV write (the row GEMV up to 2 rows, the split-K GEMM from 3; pre-quantized rows,
    and rows each program quantizes itself) writes the table's slots with the static cache's values."""
    hidden, nh, nkv, hd, s, bs = 64, 2, 1, 32, 24, 8
    x = (_rand((m, hidden), m, DEV) * 12).round().clamp(-32, 32).div(4)
    nin = 1 + 0.1 * _rand((hidden,), m + 1, DEV)
    nqkv = (nh + 2 * nkv) * hd
    w = _tern(nqkv, hidden, m + 3, DEV)
    sc = 0.01 + _rand((nqkv,), m + 4, DEV).abs()
    cos, sin = _rope_tables(hd, s, DEV)
    pos = (torch.tensor([5, 17, 0, 11, 22], dtype=torch.int32)[:m]).to(DEV)
    xq = F.QuantBuf(m, hidden, DEV)
    F.quantize_into(x, nin, xq, 1e-5)
    for src, norm in ((xq, None), (x, nin)):
        kc, vc = _rand((m, nkv, s, hd), m + 5, DEV), _rand((m, nkv, s, hd), m + 6, DEV)
        kp, table = _paged(kc, bs, m)
        vp, _ = _paged(vc, bs, m)
        q_ref, q = (torch.zeros((m, 1, nh, hd), device=DEV) for _ in range(2))
        F.qkv_rope(src, m, w, sc, q_ref, cos, sin, pos, kc, vc, nh, nkv, norm, 1e-5)
        F.qkv_rope(src, m, w, sc, q, cos, sin, pos, kp, vp, nh, nkv, norm, 1e-5, table=table)
        assert torch.equal(q, q_ref)
        assert torch.equal(_unpaged(kp, table, s), kc) and torch.equal(_unpaged(vp, table, s), vc)
