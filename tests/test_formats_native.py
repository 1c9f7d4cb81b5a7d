"""Native format: zero-copy memory-mapped loading, format metadata, base3 storage, hostile safetensors headers."""

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bitnetlm.formats.hf import load_hf, save_hf
from bitnetlm.formats.native import file_layout, load_mmap, load_native, mmap_safetensors, save_native
from bitnetlm.models import ModelConfig, build_model
from bitnetlm.quant import to_inference_
from bitnetlm.quant.bitlinear import BitLinear


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = ModelConfig(
        arch="bitnet",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    m = build_model(cfg, "train")
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.05)
    d = tmp_path_factory.mktemp("n") / "m"
    save_hf(to_inference_(m).eval(), d)
    return d


def test_mmap_load_is_zero_copy_and_equal(model_dir):
    m = load_mmap(model_dir)
    ref = load_hf(model_dir)
    ((start, size),) = m.mmap_regions
    assert size == (model_dir / "model.safetensors").stat().st_size
    views = 0
    for (name, a), b in zip(
        [(n, x) for n, x in m.named_modules() if isinstance(x, BitLinear)],
        [x for x in ref.modules() if isinstance(x, BitLinear)],
    ):
        assert torch.equal(a.packed, b.packed) and torch.equal(a.weight_scale, b.weight_scale), name
        # not a copy: the packed bytes live inside the memory map of the file
        assert start <= a.packed.data_ptr() and a.packed.data_ptr() + a.packed.numel() <= start + size
        views += 1
    assert views == 14
    ids = torch.randint(0, 300, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(m(ids), ref(ids), rtol=0, atol=0)
    assert m.source_metadata["bitnetlm_format_version"] == "1"
    assert file_layout(model_dir) == ("hf-2bit", "1")


def test_load_native_through_bitnetlm_load(model_dir, tmp_path):
    import bitnetlm

    b3 = save_native(load_hf(model_dir), tmp_path / "b3", storage="base3")
    model, _ = bitnetlm.load(b3, backend="reference")
    ref = load_native(model_dir)
    ids = torch.randint(0, 300, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), rtol=0, atol=0)
    header = json.loads(
        (b3 / "model.safetensors").read_bytes()[8:][
            : struct.unpack("<Q", (b3 / "model.safetensors").read_bytes()[:8])[0]
        ]
    )
    assert header["__metadata__"]["bitnetlm_layout"] == "base3-5"
    q = header["model.layers.0.self_attn.q_proj.weight"]
    assert q["dtype"] == "U8" and q["shape"] == [(64 * 64 + 4) // 5]  # 1.6 bits per weight


def test_bad_safetensors_headers(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError, match="exceeds the file size"):
        mmap_safetensors(p)
    hdr = json.dumps({"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}).encode()
    p.write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 16)
    with pytest.raises(ValueError, match="runs past the end"):
        mmap_safetensors(p)
    p.write_bytes(struct.pack("<Q", 5) + b"{oops")
    with pytest.raises(ValueError, match="corrupt safetensors header"):
        mmap_safetensors(p)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=64), st.integers(0, 200))
def test_fuzz_mmap_safetensors(tmp_path_factory, junk, cut):
    """Corrupted headers: a clean ValueError (or a successful parse), never another exception."""
    hdr = json.dumps({"a": {"dtype": "U8", "shape": [2, 3], "data_offsets": [0, 6]}}).encode()
    raw = bytearray(struct.pack("<Q", len(hdr)) + hdr + bytes(6))
    pos = cut % len(raw)
    raw[pos : pos + len(junk)] = junk
    p = tmp_path_factory.getbasetemp() / "fz.safetensors"
    p.write_bytes(bytes(raw))
    try:
        mmap_safetensors(p)
    except ValueError:
        pass
