"""The triton-2bit-v1 layout: the direct HF 2-bit -> triton repack used at load equals unpack + pack, and the
CUDA engine takes rows already in that layout as they are (same bytes, same logits)."""

from __future__ import annotations

import copy

import pytest
import torch
from triton_interp import DEV, triton_modules

from bitnetlm.quant.packing import pack_hf

(layout,) = triton_modules("layout")


@pytest.mark.parametrize("n,k", [(1, 1), (5, 17), (8, 64), (13, 100), (7, 2560), (3, 6912)])
def test_repack_hf_equals_unpack_then_pack(n, k):
    t = torch.randint(-1, 2, (n, k), generator=torch.Generator().manual_seed(n * 7919 + k), dtype=torch.int8)
    assert torch.equal(layout.repack_hf(pack_hf(t), (n, k)), layout.pack_triton(t))


def test_repack_hf_every_byte_value():
    """All 256 packed bytes (four codes each, code 3 included) map as unpack + pack maps them."""
    p = torch.arange(256, dtype=torch.uint8).view(1, 256)  # four rows of 256 columns
    codes = torch.stack([(p[0] >> (2 * i)) & 3 for i in range(4)])  # [4, 256]: row i*R + r, R = 1
    t = codes.to(torch.int8) - 1  # code 3 -> t = 2, outside ternary: the bits must still round-trip
    assert torch.equal(layout.repack_hf(p, (4, 256)), layout.pack_triton(t))


def test_repack_hf_rejects_wrong_shape():
    with pytest.raises(ValueError, match=r"repack_hf: for shape \(8, 5\) expected uint8 \[2, 5\]"):
        layout.repack_hf(torch.zeros((3, 5), dtype=torch.uint8), (8, 5))


def test_engine_takes_rows_already_in_the_triton_layout(tiny_model):
    """from_model on a model prepared for the Triton backend (rows already triton-2bit-v1) builds the same packed
    matrices and logits as from the reference-backend model (rows repacked from int8)."""
    from bitnetlm.kernels import prepare
    from bitnetlm.quant.packing import PackingFormat
    from bitnetlm.runtime.cuda.engine import CudaEngine, EngineConfig

    tri = prepare(copy.deepcopy(tiny_model), DEV, "triton")
    assert tri.layers[0].self_attn.q_proj.layout == PackingFormat.TRITON_2BIT
    ecfg = EngineConfig(max_batch=1, max_seq_len=16, dtype=torch.float32)
    a = CudaEngine.from_model(tiny_model, ecfg, device=DEV)
    b = CudaEngine.from_model(tri, ecfg, device=DEV)
    for la, lb in zip(a.layers, b.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            assert torch.equal(getattr(la, name), getattr(lb, name)), name
    tok = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(0)).to(DEV)
    pos = torch.zeros(1, dtype=torch.int32, device=DEV)
    with torch.no_grad():
        assert torch.equal(a.forward(tok, pos), b.forward(tok, pos))


def test_engine_shares_the_models_packed_weights(tiny_model):
    """share=True (what generate and serve use) points the model's projections at rows of the engine's fused
    tensors: one copy of the packed weights on the GPU, the same bytes, the same logits from both paths."""
    from bitnetlm.kernels import prepare
    from bitnetlm.runtime.cuda.engine import CudaEngine, EngineConfig

    tri = prepare(copy.deepcopy(tiny_model), DEV, "triton")
    projs = lambda blk: (  # noqa: E731
        blk.self_attn.q_proj,
        blk.self_attn.k_proj,
        blk.self_attn.v_proj,
        blk.self_attn.o_proj,
        blk.mlp.gate_proj,
        blk.mlp.up_proj,
        blk.mlp.down_proj,
    )
    weights = [m.ternary_weight().clone() for blk in tri.layers for m in projs(blk)]
    tok = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(0)).to(DEV)
    with torch.no_grad():
        eager = tri(tok)
    ecfg = EngineConfig(max_batch=1, max_seq_len=16, dtype=torch.float32)
    ptrs = [m.packed.data_ptr() for blk in tri.layers for m in projs(blk)]
    copied = CudaEngine.from_model(tri, ecfg, device=DEV)
    assert [m.packed.data_ptr() for blk in tri.layers for m in projs(blk)] == ptrs  # share=False: untouched
    eng = CudaEngine.from_model(tri, ecfg, device=DEV, share=True)
    for blk, L in zip(tri.layers, eng.layers):
        q, k, v, o, g, u, d = projs(blk)
        nq, nk = q.packed.shape[0], k.packed.shape[0]
        assert q.packed.data_ptr() == L.qkv.data_ptr()
        assert k.packed.data_ptr() == L.qkv[nq].data_ptr()
        assert v.packed.data_ptr() == L.qkv[nq + nk].data_ptr()
        assert g.packed.data_ptr() == L.gate_up.data_ptr()
        assert u.packed.data_ptr() == L.gate_up[g.packed.shape[0]].data_ptr()
        assert o.packed.data_ptr() == L.o.data_ptr() and d.packed.data_ptr() == L.down.data_ptr()
        assert all(m.packed.is_contiguous() for m in (q, k, v, g, u))
    for w, m in zip(weights, (m for blk in tri.layers for m in projs(blk))):
        assert torch.equal(m.ternary_weight(), w)
    pos = torch.zeros(1, dtype=torch.int32, device=DEV)
    with torch.no_grad():
        assert torch.equal(eng.forward(tok, pos), copied.forward(tok, pos))
        assert torch.equal(tri(tok), eager)
