"""Our loader + forward against transformers' BitNetForCausalLM / LlamaForCausalLM on oracle checkpoints."""

import json
import shutil

import pytest
import torch
from oracle import VARIANTS, greedy_with_cache, oracle_model, pinned_quantizer_inputs

import bitnetlm
from bitnetlm.formats.hf import load_hf
from bitnetlm.quant import BitLinear


def _ids(n=24, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (2, n), generator=g)


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(oracle_dirs, variant):
    ours_dir, oracle_dir = oracle_dirs[variant]
    ref = oracle_model(oracle_dir)
    model, _ = bitnetlm.load(ours_dir, backend="reference")
    ids = _ids()
    with torch.no_grad(), pinned_quantizer_inputs(ref, model, ids):  # no int8 rounding-tie flips (oracle.py)
        expected = ref(ids).logits
        got = model(ids)
    assert got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    assert diff <= 1e-4, f"{variant}: max |logits diff| = {diff}"
    if variant not in ("fp", "llama"):
        assert any(isinstance(m, BitLinear) for m in model.modules())


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_32_tokens_match_transformers(oracle_dirs, variant):
    ours_dir, oracle_dir = oracle_dirs[variant]
    ref = oracle_model(oracle_dir)
    model, _ = bitnetlm.load(ours_dir, backend="reference")
    prompt = _ids(7, seed=3)[:1]
    with torch.no_grad():
        expected = ref.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, 7:].tolist()
        got = greedy_with_cache(model, prompt, 32)[0].tolist()
    assert got == expected


def test_cached_decode_equals_full_forward(oracle_dirs):
    model, _ = bitnetlm.load(oracle_dirs["packed-autobitlinear"][0], backend="reference")
    ids = _ids(16)
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 32)
        a = model(ids[:, :10], cache=cache)
        b = model(ids[:, 10:], positions=torch.arange(10, 16).expand(2, 6), cache=cache)
    torch.testing.assert_close(torch.cat([a, b], 1), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "variant", ["packed-autobitlinear", "packed-bitlinear", "online", "1bitllm", "llama"]
)
def test_save_roundtrip_and_transformers_loads_it(oracle_dirs, tmp_path, variant):
    model, _ = bitnetlm.load(oracle_dirs[variant][0], backend="reference")
    out = bitnetlm.save(model, tmp_path / "saved")
    again, _ = bitnetlm.load(out, backend="reference")
    sd1, sd2 = model.state_dict(), again.state_dict()
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k
    ref = oracle_model(out)  # the saved directory loads in transformers ...
    ids = _ids()
    with torch.no_grad(), pinned_quantizer_inputs(ref, again, ids):
        diff = (ref(ids).logits - again(ids)).abs().max().item()
    assert diff <= 1e-4  # ... and computes what we compute
    if variant != "llama":
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["quantization_config"] == {
            "quant_method": "bitnet",
            "linear_class": "autobitlinear",
            "quantization_mode": "offline",
        }


def test_train_mode_load_matches_infer(oracle_dirs):
    d = oracle_dirs["packed-autobitlinear"][0]
    inf, _ = bitnetlm.load(d, backend="reference")
    tr = load_hf(d, mode="train")
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(tr(ids), inf(ids), atol=1e-4, rtol=1e-4)


def test_save_refuses_to_overwrite(oracle_dirs, tmp_path):
    model, _ = bitnetlm.load(oracle_dirs["packed-autobitlinear"][0])
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="overwrite"):
        bitnetlm.save(model, out)
    assert (out / "keep.txt").read_text() == "precious"


# ---- bad input -------------------------------------------------------------------------------
def _copy(oracle_dirs, tmp_path, variant="packed-autobitlinear"):
    d = tmp_path / "m"
    shutil.copytree(oracle_dirs[variant][0], d)
    return d


def test_truncated_safetensors(oracle_dirs, tmp_path):
    d = _copy(oracle_dirs, tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        bitnetlm.load(d)


def test_wrong_hidden_size(oracle_dirs, tmp_path):
    d = _copy(oracle_dirs, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_size"] = 96
    cfg["head_dim"] = 24
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight.*\(512, 64\).*\(512, 96\)"):
        bitnetlm.load(d)


def test_missing_shard(oracle_dirs, tmp_path):
    d = _copy(oracle_dirs, tmp_path)
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {
        "metadata": {},
        "weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "model.norm.weight": "model-00002-of-00002.safetensors",
        },
    }
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        bitnetlm.load(d)


def test_missing_config_and_pickle_only(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        bitnetlm.load(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "bitnet",
                "vocab_size": 8,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 1,
            }
        )
    )
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ValueError, match="pickle"):
        bitnetlm.load(tmp_path)


def test_missing_tensor_and_unknown_arch(oracle_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy(oracle_dirs, tmp_path)
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight_scale"):
        bitnetlm.load(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "mamba", ["MambaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unknown architecture"):
        bitnetlm.load(d)
