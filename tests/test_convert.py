"""`bitnet convert` / `bitnet quantize` end to end through the CLI, native base3 storage, fp GGUF sources."""

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from oracle import pinned_quantizer_inputs, random_model

from bitnetlm.cli import main
from bitnetlm.formats.gguf import load_gguf_model
from bitnetlm.formats.gguf_file import TensorToWrite, read_gguf, write_gguf
from bitnetlm.formats.gguf_tensors import permute_qk
from bitnetlm.formats.hf import load_hf, save_hf
from bitnetlm.formats.native import file_layout, load_native
from bitnetlm.quant.bitlinear import BitLinear
from bitnetlm.quant.ternary import ternarize


def _tiny(arch="bitnet", seed=0, hidden=256, inter=512, **kw):
    return random_model(arch, seed, hidden, inter, **kw)


def _tern(model):
    return {
        n: (m.ternary_weight(), float(m.scale()))
        for n, m in model.named_modules()
        if isinstance(m, BitLinear)
    }


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("src") / "tiny"
    save_hf(_tiny(), d)
    return d


def test_cli_hf_gguf_hf_all_types(hf_dir, tmp_path):
    orig = _tern(load_hf(hf_dir))
    for qtype in ("tq1_0", "tq2_0", "i2_s"):
        g = tmp_path / f"m-{qtype}.gguf"
        assert main(["convert", str(hf_dir), str(g), "--to", "gguf", "--type", qtype]) == 0
        back = tmp_path / f"back-{qtype}"
        assert main(["convert", str(g), str(back), "--to", "hf"]) == 0
        got = _tern(load_hf(back))
        for name, (t, s) in orig.items():
            assert torch.equal(got[name][0], t), (qtype, name)
            want = s if qtype == "i2_s" else float(np.float16(s))
            assert got[name][1] == want, (qtype, name)


def test_cli_tokenizer_survives_hf_gguf_hf(tmp_path):
    """The real LLaMA-3 tokenizer + chat template: HF dir -> GGUF metadata -> HF dir, same ids."""
    from assets import asset
    from tokenizers import Tokenizer

    tok = asset("llama3-tokenizer")
    src = tmp_path / "src"
    files = {n: (tok / n).read_text() for n in ("tokenizer.json", "tokenizer_config.json")}
    save_hf(_tiny(hidden=64, inter=128), src, extra_files=files)
    g, back = tmp_path / "m.gguf", tmp_path / "back"
    assert main(["convert", str(src), str(g), "--to", "gguf", "--type", "i2_s"]) == 0
    assert main(["convert", str(g), str(back), "--to", "hf"]) == 0
    a = Tokenizer.from_file(str(src / "tokenizer.json"))
    b = Tokenizer.from_file(str(back / "tokenizer.json"))
    for text in ("Hello world, 12345 <|eot_id|> \u00fcn\u00efcode", "  two  spaces\n\nand lines"):
        assert a.encode(text).ids == b.encode(text).ids
    tc = json.loads((back / "tokenizer_config.json").read_text())
    assert tc["chat_template"] == json.loads((src / "tokenizer_config.json").read_text())["chat_template"]


def test_never_overwrites_without_force(hf_dir, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"precious")
    assert main(["convert", str(hf_dir), str(out), "--to", "gguf"]) == 2
    assert "--force" in capsys.readouterr().err
    assert out.read_bytes() == b"precious"
    assert main(["convert", str(hf_dir), str(out), "--to", "gguf", "--force"]) == 0
    assert read_gguf(out).metadata["general.architecture"] == "bitnet-b1.58"
    d = tmp_path / "dir"
    d.mkdir()
    (d / "keep.txt").write_text("x")
    assert main(["convert", str(hf_dir), str(d), "--to", "hf"]) == 2
    assert (d / "keep.txt").read_text() == "x"


def test_failed_conversion_leaves_nothing(tmp_path, capsys):
    # rows of 64 values cannot be TQ2_0 (needs multiples of 256): the writer fails midway
    src = tmp_path / "small"
    save_hf(_tiny(hidden=64, inter=128), src)
    out = tmp_path / "out.gguf"
    assert main(["convert", str(src), str(out), "--to", "gguf", "--type", "tq2_0"]) == 2
    assert "multiple of 256" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small"]
    # I2_S only needs a multiple of 128 values per matrix: that works
    assert main(["convert", str(src), str(out), "--to", "gguf", "--type", "i2_s"]) == 0
    # outputs get ordinary permissions (umask), not the 0600/0700 of temporary files
    import os
    import stat

    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~mask
    assert main(["convert", str(out), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) == 0o777 & ~mask
    assert main(["convert", str(out), str(tmp_path / "m.onnx"), "--to", "onnx"]) == 0
    assert stat.S_IMODE((tmp_path / "m.onnx").stat().st_mode) == 0o666 & ~mask


def test_base3_native_storage(hf_dir, tmp_path):
    out = tmp_path / "b3"
    assert main(["convert", str(hf_dir), str(out), "--to", "hf", "--storage", "base3"]) == 0
    assert file_layout(out)[0] == "base3-5"
    a, b = (hf_dir / "model.safetensors").stat().st_size, (out / "model.safetensors").stat().st_size
    assert b < a
    from bitnetlm.inspect import inspect_path

    info = inspect_path(out)
    assert info["layout"] == "base3-5" and info["bits_per_ternary_weight"] == pytest.approx(1.6)
    m = load_native(out)
    assert all(
        torch.equal(x[0], y[0]) and x[1] == y[1]
        for x, y in zip(_tern(m).values(), _tern(load_hf(hf_dir)).values())
    )
    back = tmp_path / "back"
    assert main(["convert", str(out), str(back), "--to", "hf"]) == 0
    assert file_layout(back)[0] == "hf-2bit"


def test_quantize_llama_hf_with_warning_and_transformers_oracle(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    src = tmp_path / "fp"
    fp = _tiny("llama", hidden=64, inter=128).eval()
    save_hf(fp, src)
    out = tmp_path / "q"
    assert main(["quantize", str(src), str(out)]) == 0
    assert "distillation" in capsys.readouterr().err
    q = load_hf(out)
    assert q.config.arch == "llama" and q.config.quant == "ternary"
    for name, (t, s) in _tern(q).items():
        t0, s0 = ternarize(fp.get_submodule(name).weight)
        assert torch.equal(t, t0) and s == float(s0)
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), pinned_quantizer_inputs(ref, q, ids):  # no int8 rounding-tie flips (oracle.py)
        torch.testing.assert_close(q(ids), ref(ids).logits, rtol=1e-4, atol=1e-4)


def _llama_gguf_with_types(path, fp, types):
    """A llama GGUF written with gguf.quants-encoded projections of the given types (first one per tensor)."""
    cfg = fp.config
    tensors = [
        TensorToWrite(
            "token_embd.weight",
            fp.embed_tokens.weight.detach().numpy().astype(np.float16),
            1,
            (cfg.vocab_size, cfg.hidden_size),
        )
    ]
    want = {}
    k = 0
    for i, layer in enumerate(fp.layers):
        for ours, g in (
            ("self_attn.q_proj", "attn_q"),
            ("self_attn.k_proj", "attn_k"),
            ("self_attn.v_proj", "attn_v"),
            ("self_attn.o_proj", "attn_output"),
            ("mlp.gate_proj", "ffn_gate"),
            ("mlp.up_proj", "ffn_up"),
            ("mlp.down_proj", "ffn_down"),
        ):
            w = layer.get_submodule(ours).weight.detach()
            if g == "attn_q":
                w = permute_qk(w, cfg.num_attention_heads)
            if g == "attn_k":
                w = permute_qk(w, cfg.num_key_value_heads)
            qt = types[k % len(types)]
            k += 1
            data = (
                quants.quantize(w.numpy(), qt) if qt not in (Q.Q4_K, Q.Q6_K) else _fake_k_quant(w.shape, qt)
            )
            tensors.append(TensorToWrite(f"blk.{i}.{g}.weight", data, int(qt), tuple(w.shape)))
            deq = torch.from_numpy(quants.dequantize(data, qt).copy())
            if g == "attn_q":
                deq = (
                    deq.reshape(cfg.num_attention_heads, -1, 2, deq.shape[1])
                    .swapaxes(1, 2)
                    .reshape(deq.shape)
                )
            if g == "attn_k":
                deq = (
                    deq.reshape(cfg.num_key_value_heads, -1, 2, deq.shape[1])
                    .swapaxes(1, 2)
                    .reshape(deq.shape)
                )
            want[f"layers.{i}.{ours}"] = deq
        for ours, g in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm")):
            w = layer.get_submodule(ours).weight.detach().numpy()
            tensors.append(TensorToWrite(f"blk.{i}.{g}.weight", w, 0, w.shape))
    w = fp.norm.weight.detach().numpy()
    tensors.append(TensorToWrite("output_norm.weight", w, 0, w.shape))
    w = fp.lm_head.weight.detach().numpy()
    tensors.append(TensorToWrite("output.weight", quants.quantize(w, Q.Q8_0), int(Q.Q8_0), w.shape))
    meta = {
        "llama.block_count": cfg.num_hidden_layers,
        "llama.embedding_length": cfg.hidden_size,
        "llama.feed_forward_length": cfg.intermediate_size,
        "llama.attention.head_count": cfg.num_attention_heads,
        "llama.attention.head_count_kv": cfg.num_key_value_heads,
        "llama.rope.freq_base": 10000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.context_length": 64,
    }
    write_gguf(path, "llama", meta, tensors)
    return want


def _fake_k_quant(shape, qt):
    """Random but valid Q4_K / Q6_K blocks (gguf.quants cannot encode them): small finite fp16 scales."""
    rng = np.random.default_rng(0)
    n_blocks = int(np.prod(shape)) // 256
    size = {Q.Q4_K: 144, Q.Q6_K: 210}[qt]
    b = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    sc = np.full((n_blocks, 1), 0.01, np.float16).view(np.uint8)
    if qt == Q.Q4_K:
        b[:, 0:2], b[:, 2:4] = sc, sc  # d, dmin
    else:
        b[:, 208:210] = sc  # d
    return b.reshape(shape[0], -1)


def test_fp_gguf_sources_load_and_quantize(tmp_path, capsys):
    fp = _tiny("llama", hidden=256, inter=512, num_key_value_heads=2).eval()
    path = tmp_path / "fp.gguf"
    want = _llama_gguf_with_types(path, fp, [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.Q4_K, Q.Q6_K])
    types = {t.type_name for t in read_gguf(path).tensors.values()}
    assert {"Q4_0", "Q4_1", "Q8_0", "F16", "Q4_K", "Q6_K"} <= types
    m = load_gguf_model(path, mode="fp")
    assert m.config.arch == "llama" and m.config.quant == "none"
    for name, w in want.items():
        torch.testing.assert_close(m.get_submodule(name).weight, w, rtol=0, atol=0)
    out = tmp_path / "q.gguf"
    assert main(["quantize", str(path), str(out), "--to", "gguf", "--type", "i2_s"]) == 0
    assert "warning" in capsys.readouterr().err
    q = load_gguf_model(out)
    for name, w in want.items():
        t0, s0 = ternarize(w)
        t, s = q.get_submodule(name).ternary_weight(), q.get_submodule(name).weight_scale
        assert torch.equal(t, t0) and float(s) == float(s0)
    # a full-precision source cannot be converted to a ternary GGUF type without quantize
    assert main(["convert", str(path), str(tmp_path / "x.gguf"), "--to", "gguf", "--type", "tq2_0"]) == 2
    assert "bitnet quantize" in capsys.readouterr().err


def test_convert_to_onnx_and_inspect(hf_dir, tmp_path, capsys):
    out = tmp_path / "m.onnx"
    assert main(["convert", str(hf_dir), str(out), "--to", "onnx"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["ternary_parameters"] == 2 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512)
    assert info["bits_per_ternary_weight"] == 2.0
    g = tmp_path / "m.gguf"
    assert main(["convert", str(hf_dir), str(g), "--to", "gguf", "--type", "tq1_0"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(g), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["bits_per_ternary_weight"] == pytest.approx(54 * 8 / 256)
    row = next(t for t in info["tensors"] if t["name"] == "blk.0.attn_q.weight")
    assert row["dtype"] == "TQ1_0" and row["shape"] == [256, 256]
    assert main(["inspect", str(g)]) == 0
    assert "| blk.0.ffn_down.weight | TQ1_0 |" in capsys.readouterr().out


def _gguf_576(path, tq_fits_down: bool = True) -> dict[str, np.ndarray]:
    """A one-layer llama GGUF with SmolLM2's 576-wide rows (9 heads of 64, 3 KV heads), written by the gguf
    package itself; returns its float tensors."""
    import gguf

    rng = np.random.default_rng(0)
    h, ffn, kv, vocab = 576, 256 if tq_fits_down else 320, 192, 300
    shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,), "blk.0.attn_norm.weight": (h,)}
    shapes.update(
        {"blk.0.ffn_norm.weight": (h,), "blk.0.attn_q.weight": (h, h), "blk.0.attn_k.weight": (kv, h)}
    )
    shapes.update({"blk.0.attn_v.weight": (kv, h), "blk.0.attn_output.weight": (h, h)})
    shapes.update({"blk.0.ffn_gate.weight": (ffn, h), "blk.0.ffn_up.weight": (ffn, h)})
    shapes["blk.0.ffn_down.weight"] = (h, ffn)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, val in (("block_count", 1), ("embedding_length", h), ("feed_forward_length", ffn)):
        w.add_uint32(f"llama.{key}", val)
    w.add_uint32("llama.attention.head_count", 9)
    w.add_uint32("llama.attention.head_count_kv", 3)
    w.add_uint32("llama.context_length", 64)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            out[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (0.05 * rng.standard_normal(shape)).astype(np.float16)
        w.add_tensor(name, out[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


GGUF_PROJ = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def test_quantize_gguf_with_576_wide_rows_picks_a_type_that_fits(tmp_path, capsys):
    """`bitnet quantize x.gguf out.gguf --to gguf` on SmolLM2-shaped rows (576, not a multiple of 256) used to
    fail after all the work; now the default type fits (I2_S) and --to comes from the extension."""
    src = tmp_path / "fp.gguf"
    fp = _gguf_576(src)
    assert main(["quantize", str(src), str(tmp_path / "a.gguf"), "--to", "gguf", "-q"]) == 0
    out = tmp_path / "b.gguf"
    assert main(["quantize", str(src), str(out), "-q"]) == 0  # no --to: a GGUF file, from the extension
    assert out.is_file() and out.read_bytes()[:4] == b"GGUF"
    f = read_gguf(out)
    assert {f.tensors[f"blk.0.{g}.weight"].type_name for g in GGUF_PROJ} == {"I2_S"}
    q = load_gguf_model(out)
    for g, ours in zip(
        GGUF_PROJ, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    ):
        m = q.get_submodule(f"layers.0.{'self_attn' if 'attn' in g else 'mlp'}.{ours}")
        t0, s0 = ternarize(torch.from_numpy(fp[f"blk.0.{g}.weight"].astype(np.float32)))
        if g in ("attn_q", "attn_k"):  # llama GGUF rows are permuted for GGML's RoPE; ours are not
            from bitnetlm.formats.gguf_tensors import unpermute_qk

            t0 = unpermute_qk(t0, 9 if g == "attn_q" else 3)
        assert torch.equal(m.ternary_weight(), t0) and float(m.weight_scale) == float(s0), g
    back = tmp_path / "back"
    assert main(["convert", str(out), str(back)]) == 0 and (back / "config.json").is_file()  # --to hf


def test_quantize_gguf_tq_types_fall_back_per_tensor(tmp_path, capsys):
    """An explicit TQ type stores the projections whose rows it cannot hold as F16 T*s, per tensor (as llama.cpp's
    quantizer falls back), saying so in one line; the gguf package reads every tensor back to T * fp16(s)."""
    import gguf

    src = tmp_path / "fp.gguf"
    fp = _gguf_576(src)
    out = tmp_path / "tq.gguf"
    assert main(["quantize", str(src), str(out), "--type", "tq2_0", "-q"]) == 0
    (note,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note:")]
    assert "6 of 7 projections" in note and "--type i2_s" in note
    r = gguf.GGUFReader(str(out))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.ffn_down.weight"] == "TQ2_0"
    assert {types[f"blk.0.{g}.weight"] for g in GGUF_PROJ[:-1]} == {"F16"}
    for t in r.tensors:
        g = t.name.split(".")[2] if t.name.startswith("blk.") else None
        if g not in GGUF_PROJ:
            continue
        t0, s0 = ternarize(torch.from_numpy(fp[t.name].astype(np.float32)))
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(t0.shape)
        want = t0.numpy().astype(np.float32) * np.float32(np.float16(float(s0)))
        assert np.array_equal(got, want), t.name
    q = load_gguf_model(out)  # every projection comes back ternary
    assert sum(isinstance(m, BitLinear) for m in q.modules()) == 7


def test_quantize_validates_from_the_header_before_loading(tmp_path, monkeypatch, capsys):
    import bitnetlm.convert as conv
    from bitnetlm import zoo

    def never(*a, **k):
        raise AssertionError("the tensors were read before the request was validated")

    monkeypatch.setattr(conv, "load_source", never)
    tiny = zoo.bundled_dir(zoo.DEFAULT_MODEL)  # already ternary
    assert main(["quantize", str(tiny), str(tmp_path / "x.gguf")]) == 2
    assert "already a ternary model" in capsys.readouterr().err
    src = tmp_path / "fp.gguf"
    _gguf_576(src)
    assert main(["quantize", str(src), str(tmp_path / "x.onnx")]) == 2
    assert "writing onnx is not supported" in capsys.readouterr().err
