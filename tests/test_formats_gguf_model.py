"""GGUF models: HF -> GGUF (each ternary type) -> HF round trips, llama permutation vs transformers, tokenizers."""

import copy
import json

import numpy as np
import pytest
import torch
from oracle import random_model

from bitnetlm.formats import gguf_codecs as codecs
from bitnetlm.formats.gguf import load_gguf_model, save_gguf
from bitnetlm.formats.gguf_file import read_gguf
from bitnetlm.formats.gguf_tokenizer import tokenizer_from_gguf_metadata, tokenizer_metadata
from bitnetlm.formats.hf import load_hf, save_hf
from bitnetlm.quant.bitlinear import BitLinear

TYPES = ("tq1_0", "tq2_0", "i2_s")


def _tiny(arch="bitnet", seed=0, **kw):
    return random_model(arch, seed, **kw)


def _ternaries(model):
    return [(n, m.ternary_weight(), m.scale()) for n, m in model.named_modules() if isinstance(m, BitLinear)]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "tiny"
    save_hf(_tiny("bitnet"), d)
    return load_hf(d), d


@pytest.mark.parametrize("qtype", TYPES)
def test_hf_gguf_hf_round_trip(hf_model, tmp_path, qtype):
    model, _ = hf_model
    ids = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(1))
    path = save_gguf(model, tmp_path / f"m.{qtype}.gguf", qtype)
    f = read_gguf(path)
    assert f.metadata["general.architecture"] == "bitnet-b1.58"
    assert f.tensors["blk.0.attn_q.weight"].type_id == codecs.TERNARY_TYPES[qtype]
    assert "output.weight" not in f.tensors  # tied
    g = load_gguf_model(path)
    back = tmp_path / "back"
    save_hf(g, back)
    h = load_hf(back)
    for (n1, t1, s1), (n2, t2, _), (n3, t3, s3) in zip(_ternaries(model), _ternaries(g), _ternaries(h)):
        assert n1 == n2 == n3
        assert torch.equal(t1, t2) and torch.equal(t1, t3), n1
        if qtype == "i2_s":
            assert float(s3) == float(s1)  # float32 per-tensor scale: lossless
        else:
            assert float(s3) == float(np.float16(float(s1)))  # fp16 block scale
    # the exact expectation: the original model with every scale rounded to fp16 (TQ) or kept (I2_S)
    expected = copy.deepcopy(model)
    if qtype != "i2_s":
        for m in expected.modules():
            if isinstance(m, BitLinear):
                m.weight_scale = m.weight_scale.half().float()
    with torch.no_grad():
        ref, out, exp = model(ids), h(ids), expected(ids)
    torch.testing.assert_close(out, exp, rtol=0, atol=0)
    diff = (ref - out).abs().max().item()
    print(
        f"\n{qtype}: max |logit diff| vs original after HF->GGUF->HF = {diff:.3g} (max |logit| {ref.abs().max():.3g})"
    )
    if qtype == "i2_s":
        assert diff == 0.0
    else:
        assert diff < 0.01 * ref.abs().max().item()


def test_gguf_metadata_and_bits(hf_model, tmp_path):
    model, _ = hf_model
    f = read_gguf(save_gguf(model, tmp_path / "m.gguf", "tq1_0"))
    p = "bitnet-b1.58"
    assert f.metadata[f"{p}.block_count"] == 2 and f.metadata[f"{p}.embedding_length"] == 256
    assert f.metadata[f"{p}.attention.head_count_kv"] == 2 and f.metadata[f"{p}.feed_forward_length"] == 512
    ti = f.tensors["blk.1.ffn_down.weight"]
    assert ti.shape == (256, 512) and ti.nbytes * 8 / ti.n_values == pytest.approx(1.6875)
    assert f.tensors["blk.0.attn_norm.weight"].type_name == "F32"


def test_1bitllm_arch_round_trip(tmp_path):
    m = _tiny("1bitllm").eval()
    path = save_gguf(m, tmp_path / "one.gguf", "i2_s")
    assert read_gguf(path).metadata["general.architecture"] == "bitnet"
    g = load_gguf_model(path)
    assert g.config.arch == "1bitllm" and g.config.hidden_act == "silu" and not g.config.tie_word_embeddings
    ids = torch.randint(0, 300, (1, 9))
    from bitnetlm.quant import to_inference_

    ref = to_inference_(m)
    with torch.no_grad():
        torch.testing.assert_close(g(ids), ref(ids), rtol=0, atol=0)


def test_llama_fp_gguf_matches_transformers_gguf_loader(tmp_path):
    """Our llama GGUF writer permutes q/k like llama.cpp: transformers' GGUF loader (the oracle) un-permutes it."""
    transformers = pytest.importorskip("transformers")
    m = _tiny("llama", num_key_value_heads=2).eval()
    path = save_gguf(m, tmp_path / "llama.gguf", embed_type="f32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="llama.gguf", dtype=torch.float32
    )
    g = load_gguf_model(path, mode="fp")
    ids = torch.randint(0, 300, (1, 11))
    with torch.no_grad():
        ours, theirs, orig = g(ids), ref(ids).logits, m(ids)
    torch.testing.assert_close(ours, orig, rtol=0, atol=0)
    torch.testing.assert_close(theirs, orig, rtol=1e-5, atol=1e-4)


TEXTS = [
    "Hello world",
    "  leading spaces and\ttabs\n\nnewlines",
    "numbers 1234567 and 3.14159",
    "Ünïcödé 日本語 emoji 🙂",
    "<|begin_of_text|>special<|eot_id|> tokens",
    "don't won't I'll",
]


def test_llama3_tokenizer_round_trip_through_gguf(tmp_path):
    from assets import asset
    from tokenizers import Tokenizer

    d = asset("llama3-tokenizer")
    orig = Tokenizer.from_file(str(d / "tokenizer.json"))
    meta, _ = tokenizer_metadata(d)
    assert meta["tokenizer.ggml.pre"] == "llama-bpe" and len(meta["tokenizer.ggml.tokens"]) == 128256
    assert meta["tokenizer.ggml.bos_token_id"] == 128000
    tk, cfg = tokenizer_from_gguf_metadata(meta)
    for t in TEXTS:
        assert tk.encode(t).ids == orig.encode(t).ids, t
        assert tk.decode(tk.encode(t).ids, skip_special_tokens=False) == orig.decode(
            orig.encode(t).ids, skip_special_tokens=False
        )
    assert tk.encode("Hello world").ids == [128000, 9906, 1917]
    assert cfg["chat_template"] == json.loads((d / "tokenizer_config.json").read_text())["chat_template"]


def test_sentencepiece_style_tokenizer_round_trip(tmp_path):
    """`tokenizer.ggml.model = llama` (SentencePiece BPE with byte fallback, as 1bitLLM / LLaMA-2 use)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in [
        "\u2581",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "\u2581h",
        "el",
        "lo",
        "\u2581hel",
        "\u2581w",
        "or",
    ]:
        vocab[piece] = len(vocab)
    merges = [("\u2581", "h"), ("e", "l"), ("l", "o"), ("\u2581h", "el"), ("\u2581", "w"), ("o", "r")]
    tk = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tk.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True})
    )
    meta, _ = tokenizer_metadata(tmp_path)
    assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.add_space_prefix"] is True
    assert meta["tokenizer.ggml.token_type"][vocab["<0x41>"]] == 6  # BYTE
    back, cfg = tokenizer_from_gguf_metadata(meta)
    for text in ["hello world", "h\u00e9llo  world", "ordered </s> words"]:
        assert back.encode(text).ids == tk.encode(text).ids, text
        assert back.decode(back.encode(text).ids) == tk.decode(tk.encode(text).ids)
    assert back.encode("hello").ids[0] == 1 and cfg["add_bos_token"] is True
    # without merges in the file, they are derived from the scores (SentencePiece order)
    meta.pop("tokenizer.ggml.merges")
    derived, _ = tokenizer_from_gguf_metadata(meta)
    assert derived.encode("hello world").ids == tk.encode("hello world").ids


def test_tokenizer_without_merges_writes_and_reads_back(tmp_path):
    """A byte-fallback BPE with no merges (byte tokens only): GGUF cannot hold an empty array, so the merges key
    is left out (gguf-py refused the whole file before), and the file reads back to the same encodings."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}, "\u2581": 259}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    tk.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    d = tmp_path / "tok"
    d.mkdir()
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    path = save_gguf(_tiny("1bitllm").eval(), tmp_path / "m.gguf", "tq2_0", tokenizer=d)
    meta = read_gguf(path).metadata
    assert "tokenizer.ggml.merges" not in meta and len(meta["tokenizer.ggml.tokens"]) >= 260
    back, _ = tokenizer_from_gguf_metadata(meta)
    for text in ["hi there", "\u00e9t\u00e9 \U0001f642"]:
        assert back.encode(text).ids == tk.encode(text).ids, text


def test_bf16_embedding_and_bitnet25_arch(hf_model, tmp_path):
    model, _ = hf_model
    m = copy.deepcopy(model)
    with torch.no_grad():
        m.embed_tokens.weight.copy_(m.embed_tokens.weight.bfloat16().float())  # bf16-exact values
    path = save_gguf(m, tmp_path / "b25.gguf", "i2_s", arch_name="bitnet-25")
    f = read_gguf(path)
    assert f.metadata["general.architecture"] == "bitnet-25" and f.metadata["general.file_type"] == 40
    assert f.tensors["token_embd.weight"].type_name == "BF16"  # smallest lossless type
    g = load_gguf_model(path)
    assert g.config.arch == "bitnet" and g.config.hidden_act == "relu2"
    assert torch.equal(g.embed_tokens.weight, m.embed_tokens.weight)
    with pytest.raises(ValueError, match="does not describe"):
        save_gguf(
            m, tmp_path / "x.gguf", "i2_s", arch_name="bitnet"
        )  # llama.cpp's bitnet is the SiLU 1bitLLM


def test_llama_cpp_variants_scale_tensor_and_f16_ternary(hf_model, tmp_path):
    """Files from llama.cpp's converters: F16 projections holding T*s, and TQ2_0 with d=1 plus a `.scale` tensor."""
    from bitnetlm.formats.gguf_file import TensorToWrite, write_gguf

    model, _ = hf_model
    src = read_gguf(save_gguf(model, tmp_path / "ref.gguf", "i2_s"))
    ternaries = {n: (t, s) for n, t, s in _ternaries(model)}
    for variant in ("f16", "scale"):
        tensors = []
        for name, ti in src.tensors.items():
            if ti.type_id == codecs.TYPE_I2_S:
                t, s = src.ternary(name)
                if variant == "f16":
                    w = (t.astype(np.float32) * np.float32(s)).astype(np.float16)
                    tensors.append(TensorToWrite(name, w, codecs.TYPE_F16, ti.shape))
                else:
                    tensors.append(
                        TensorToWrite(name, codecs.encode_tq2_0(t, 1.0), codecs.TYPE_TQ2_0, ti.shape)
                    )
                    sc = np.array([s], np.float32)
                    tensors.append(
                        TensorToWrite(name.removesuffix(".weight") + ".scale", sc, codecs.TYPE_F32, (1,))
                    )
            else:
                tensors.append(TensorToWrite(name, np.array(src.raw(name)), ti.type_id, ti.shape))
        meta = {k: v for k, v in src.metadata.items() if k != "general.architecture"}
        path = tmp_path / f"{variant}.gguf"
        write_gguf(path, "bitnet-b1.58", meta, tensors, value_types=src.value_types)
        g = load_gguf_model(path)
        for n, t, s in _ternaries(g):
            t0, s0 = ternaries[n]
            assert torch.equal(t, t0), (variant, n)
            want = float(np.float16(float(s0))) if variant == "f16" else float(s0)
            assert float(s) == want, (variant, n)
