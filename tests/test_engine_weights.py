"""The CUDA engine's random weights (every GPU benchmark's model): the config's exact shapes in the packed layout,
ternary codes, per-row scales (gate and up with their own), a forward step that runs, and the seed deciding."""

from __future__ import annotations

import pytest
import torch
from triton_interp import DEV, triton_modules

from bitnetlm.models.config import ModelConfig

(layout,) = triton_modules("layout")

CFG = ModelConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def _engine(weights="ternary", seed=0, head="fp"):
    from bitnetlm.runtime.cuda.engine import CudaEngine, EngineConfig

    ecfg = EngineConfig(max_seq_len=16, dtype=torch.float32, weights=weights, head=head)
    return CudaEngine.random(CFG, ecfg, device=DEV, seed=seed)


def test_random_ternary_weights_have_the_configs_shapes_and_codes():
    eng = _engine()
    h, i = CFG.hidden_size, CFG.intermediate_size
    nq, nkv = CFG.num_attention_heads * CFG.head_dim, CFG.num_key_value_heads * CFG.head_dim
    shapes = {"qkv": (nq + 2 * nkv, h), "o": (h, nq), "gate_up": (2 * i, h), "down": (h, i)}
    for L in eng.layers:
        for name, (n, k) in shapes.items():
            packed = getattr(L, name)
            t = layout.unpack_triton(packed, (n, k))  # raises on a wrong packed shape
            assert set(t.unique().tolist()) <= {-1, 0, 1}, name
            assert torch.equal(layout.pack_triton(t), packed), name
            scale = getattr(L, f"{name}_scale")
            assert scale.shape == (n,) and bool((scale > 0).all()), name
        assert len(L.gate_up_scale[:i].unique()) == 1 and len(L.gate_up_scale[i:].unique()) == 1
        assert L.gate_up_scale[0] != L.gate_up_scale[i]  # gate and up: one scale each
        assert L.attn_sub_norm.shape == (nq,) and L.ffn_sub_norm.shape == (i,)
    assert eng.embed.shape == (CFG.vocab_size, h) and eng.head.data_ptr() == eng.embed.data_ptr()  # tied


@pytest.mark.parametrize("weights", ["ternary", "dense"])
def test_random_engine_steps_and_the_seed_decides(weights):
    tok = torch.tensor([[3, 7, 11]], device=DEV)
    pos = torch.zeros(1, dtype=torch.int32, device=DEV)
    with torch.no_grad():
        a, b, c = (_engine(weights, seed).forward(tok, pos) for seed in (1, 1, 2))
    assert a.shape == (1, CFG.vocab_size) and bool(torch.isfinite(a).all())  # the last token's logits
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_random_int8_head_rows_round_trip():
    from bitnetlm.runtime.cuda.weights import int8_rows

    eng = _engine(head="int8", seed=4)
    ref = _engine(seed=4).embed  # the same draw, kept in float
    q, s = int8_rows(ref)
    assert torch.equal(eng.embed_q, q) and torch.equal(eng.embed_s, s)
    assert (q.float() * s[:, None] - ref).abs().max() <= s.max() / 2 + 1e-6
