"""Qwen3, Gemma 3 (text) and GPT-2 as GGUF, under llama.cpp's architecture and tensor names (the `gguf` package's
tables): transformers' own GGUF loader reads our full-precision files to the same logits; ternary files hold
TQ1_0 / TQ2_0 that `gguf.quants` dequantizes to our weights, and read back (TQ1_0 / TQ2_0 / I2_S) to transformers'
logits on the checkpoint they came from."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from oracle import byte_level_bpe
from oracle_families import FAMILIES, make_checkpoint, model_class, oracle_model

import bitnetlm
from bitnetlm.formats.gguf import save_gguf
from bitnetlm.quant import BitLinear

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# shapes transformers' GGUF loader can rebuild: it reads no head_dim for Qwen3, no n_positions for GPT-2, and for
# Gemma 3 only the window (its query scalar, local RoPE base and layer pattern stay at their defaults)
TRANSFORMERS_GGUF = {
    "qwen3": dict(head_dim=128),
    "gpt2": dict(n_positions=1024),
    "gemma3": dict(
        head_dim=256,
        query_pre_attn_scalar=256,
        num_hidden_layers=6,
        layer_types=None,
        sliding_window_pattern=6,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        final_logit_softcapping=None,
    ),
}
# rows of 256 (TQ1_0 / TQ2_0 blocks)
WIDE = {
    "qwen3": dict(hidden_size=256, intermediate_size=512, head_dim=64),
    "gemma3": dict(hidden_size=256, intermediate_size=512, head_dim=64),
    "gpt2": dict(n_embd=256),
}
QTYPE = {"qwen3": "tq1_0", "gemma3": "tq2_0", "gpt2": "tq2_0"}


def _checkpoint(path, family, variant, **overrides):
    d = make_checkpoint(path, family, variant, seed=7, **overrides)
    byte_level_bpe().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    return d


def _ids(n=20):
    return torch.randint(3, 400, (1, n), generator=torch.Generator().manual_seed(n))


def _arch(family: str):
    return {"qwen3": gguf.MODEL_ARCH.QWEN3, "gemma3": gguf.MODEL_ARCH.GEMMA3, "gpt2": gguf.MODEL_ARCH.GPT2}[
        family
    ]


def _llamacpp_names(family: str, n_layers: int) -> set[str]:
    """Every tensor name llama.cpp's table allows for this architecture (blocks expanded)."""
    names = set()
    for t in gguf.MODEL_TENSORS[_arch(family)]:
        fmt = gguf.TENSOR_NAMES[t]
        for i in range(n_layers) if "{bid}" in fmt else [None]:
            names.update((fmt.format(bid=i) + ".weight", fmt.format(bid=i) + ".bias"))
    return names


@pytest.mark.parametrize("family", FAMILIES)
def test_full_precision_gguf_transformers_reads_ours(tmp_path, family):
    src = _checkpoint(tmp_path / "src", family, "fp", **TRANSFORMERS_GGUF[family])
    model, tok = bitnetlm.load(src, backend="reference")
    path = save_gguf(model, tmp_path / f"{family}.gguf", qtype=None, tokenizer=tok, embed_type="f32")
    ref = model_class(family).from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    )
    again, tok2 = bitnetlm.load(path, backend="reference")
    assert again.config.arch == family and again.config.quant == "none"
    ids = _ids(24)  # past Gemma's window of 6... and its global 6th layer
    with torch.no_grad():
        want = ref.eval()(ids).logits
        got = again(ids)
        assert torch.equal(got, model(ids))
    assert (got - want).abs().max().item() <= 1e-4
    text = "Hello world, hello 1234!"
    assert tok2.encode(text) == tok.encode(text)
    r = gguf.GGUFReader(str(path))
    assert r.fields["general.architecture"].contents() == gguf.MODEL_ARCH_NAMES[_arch(family)]
    assert (
        r.fields["tokenizer.ggml.model"].contents() == "gpt2"
    )  # byte-level BPE, as llama.cpp writes Qwen/GPT-2


@pytest.mark.parametrize("family", FAMILIES)
def test_ternary_gguf_llamacpp_names_types_and_logits(tmp_path, family):
    src = _checkpoint(tmp_path / "src", family, "offline", **WIDE[family])
    model, tok = bitnetlm.load(src, backend="reference")
    ref = oracle_model(src)
    ids = _ids()
    with torch.no_grad():
        want = ref(ids).logits
    qtype = QTYPE[family]
    path = save_gguf(model, tmp_path / f"{family}.{qtype}.gguf", qtype=qtype, tokenizer=tok)
    r = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in r.tensors}
    assert set(tensors) <= _llamacpp_names(family, model.config.num_hidden_layers)
    from bitnetlm.formats.gguf_families import tensor_name

    for name, m in model.named_modules():
        if isinstance(m, BitLinear):
            t = tensors[tensor_name(name, family) + ".weight"]
            assert t.tensor_type == gguf.GGMLQuantizationType[qtype.upper()], name
            deq = gguf.quants.dequantize(t.data, t.tensor_type)
            expected = (m.ternary_weight().float() * m.scale().float()).numpy()
            np.testing.assert_allclose(deq, expected, rtol=1e-3, atol=0, err_msg=name)
    for q in (qtype, "i2_s"):
        p = save_gguf(model, tmp_path / f"{family}.{q}.b.gguf", qtype=q, tokenizer=tok)
        again, _ = bitnetlm.load(p, backend="reference")
        assert again.config.quant == "ternary" and again.config.arch == family
        with torch.no_grad():
            got = again(ids)
        assert (got - want).abs().max().item() <= 1e-4, q


def test_gemma3_gguf_keeps_layer_pattern_and_caps(tmp_path):
    """A layer pattern other than llama.cpp's every-sixth, a local RoPE base and query scalar of its own, and final
    soft-capping travel in the metadata; attention soft-capping, which llama.cpp's gemma3 lacks, is refused."""
    src = _checkpoint(tmp_path / "src", "gemma3", "fp")
    model, tok = bitnetlm.load(src, backend="reference")
    path = save_gguf(model, tmp_path / "g.gguf", qtype=None, tokenizer=tok, embed_type="f32")
    again, _ = bitnetlm.load(path, backend="reference")
    for field in (
        "layer_types",
        "sliding_window",
        "rope_local_theta",
        "rope_theta",
        "final_logit_softcapping",
    ):
        assert getattr(again.config, field) == getattr(model.config, field), field
    assert again.config.query_pre_attn_scalar == pytest.approx(model.config.query_pre_attn_scalar)
    ids = _ids(24)
    with torch.no_grad():
        assert (again(ids) - oracle_model(src)(ids).logits).abs().max().item() <= 1e-4
    capped = model.config.replace(attn_logit_softcapping=50.0)
    model.config = capped
    with pytest.raises(ValueError, match="soft-capping"):
        save_gguf(model, tmp_path / "capped.gguf", qtype=None, tokenizer=tok)
    assert not (tmp_path / "capped.gguf").exists()


def test_family_gguf_refuses_another_architecture_name(tmp_path):
    src = _checkpoint(tmp_path / "src", "qwen3", "fp")
    model, tok = bitnetlm.load(src, backend="reference")
    with pytest.raises(ValueError, match="does not describe a qwen3 model"):
        save_gguf(model, tmp_path / "x.gguf", qtype=None, tokenizer=tok, arch_name="llama")


def test_qwen_pre_tokenizer_is_llamacpp_qwen2_and_reads_back(tmp_path):
    """Qwen's byte-level BPE splits digits one at a time (LLaMA-3's split takes up to three): llama.cpp names it
    `qwen2`; writing it used to fail ("no llama.cpp name"), and our reader rebuilds it to the same ids."""
    import json

    from tokenizers import Regex, pre_tokenizers

    from bitnetlm.formats.gguf_pretok import LLAMA_CPP_PRE_TOKENIZERS, QWEN2_SPLIT
    from bitnetlm.formats.gguf_tokenizer import tokenizer_from_gguf_metadata, tokenizer_metadata

    tok = byte_level_bpe()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    meta, _ = tokenizer_metadata(tmp_path)
    assert meta["tokenizer.ggml.pre"] == "qwen2" and "qwen2" in LLAMA_CPP_PRE_TOKENIZERS
    back, _ = tokenizer_from_gguf_metadata(meta)
    for text in ["In 2024, 12345 people didn't   go.\n\nWe'LL see 3.14159!", "x1y22z333 \t end"]:
        assert back.encode(text).ids == tok.encode(text).ids, text
    assert len(tok.encode("12345").ids) == 5


def test_sentencepiece_pieces_with_spaces_write_and_read_back(tmp_path):
    """Gemma's vocabulary holds pieces of literal whitespace ("  "), whose merges "a b" cannot spell: the merges
    are left out and derived from the scores on reading (reading the file used to fail: token '' unknown)."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    from bitnetlm.formats.gguf_tokenizer import tokenizer_from_gguf_metadata, tokenizer_metadata

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    vocab.update({f"<0x{b:02X}>": 4 + b for b in range(256)})
    pieces = [
        "\u2581",
        "h",
        "e",
        "l",
        "o",
        " ",
        "\t",
        "\u2581\u2581",
        "he",
        "ll",
        "hell",
        "hello",
        "  ",
        "    ",
    ]
    for p in pieces:
        vocab[p] = len(vocab)
    merges = [
        ("\u2581", "\u2581"),
        ("h", "e"),
        ("l", "l"),
        ("he", "ll"),
        ("hell", "o"),
        (" ", " "),
        ("  ", "  "),
    ]
    tk = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    tk.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tk.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<pad>", "<eos>", "<bos>")]
    )
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    meta, _ = tokenizer_metadata(tmp_path)
    back, _ = tokenizer_from_gguf_metadata(meta)
    assert meta["tokenizer.ggml.model"] == "llama" and "tokenizer.ggml.merges" not in meta
    for text in ["hello  hello", "  hell\to   o", "h\u00e9llo"]:
        assert back.encode(text).ids == tk.encode(text).ids, text
