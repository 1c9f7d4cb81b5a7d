"""HF -> GGUF -> generate: the same greedy tokens through every GGUF type, for every oracle variant and both zoo
models. A GGUF file has no activation key: its architecture name decides the MLP (ReLU^2 `bitnet-b1.58`, SiLU
`bitnet` and `llama`), so a SiLU BitNet written under a ReLU^2 name generated garbage while every tensor matched.
Also the metadata llama.cpp needs: pre-tokenizer names it knows, chosen as its converter chooses them.
"""

import json
from pathlib import Path

import pytest
import torch
from oracle import VARIANTS, byte_level_bpe, make_checkpoint
from tokenizers import pre_tokenizers

import bitnetlm
from bitnetlm.convert import convert, load_source, quantize, save_model
from bitnetlm.formats.gguf_file import read_gguf
from bitnetlm.formats.gguf_pretok import KNOWN_HASHES, LLAMA_CPP_PRE_TOKENIZERS, WRITABLE, pre_tokenizer_name
from bitnetlm.formats.hf import read_config
from bitnetlm.quant.bitlinear import BitLinear

TYPES = ("i2_s", "tq2_0", "tq1_0")
WIDE = dict(hidden_size=256, intermediate_size=256, head_dim=64)  # TQ types need rows of 256 values
PROMPT = "It is a truth universally acknowledged"
FORCED = ", that a single man in possession of a good fortune"
N_TOKENS = 12
# the GGUF architecture each source must get: it carries the activation and the sub-norms
ARCH = {"fp": "bitnet-b1.58", "online": "bitnet-b1.58", "packed-autobitlinear": "bitnet-b1.58"}
ARCH |= {"packed-bitlinear": "bitnet-b1.58", "1bitllm": "bitnet", "llama": "llama", "online-silu": "bitnet"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """name -> an HF directory of a ternary model with a tokenizer, built by transformers (oracle.py) at sizes
    every GGUF type holds; full-precision variants are ternarized first (`bitnet quantize`)."""
    base = tmp_path_factory.mktemp("gguf-gen")
    tok = byte_level_bpe()
    out = {}
    cases = [(v, v, {}) for v in VARIANTS] + [("online-silu", "online", {"hidden_act": "silu"})]
    for i, (name, variant, extra) in enumerate(cases):
        d = base / name
        make_checkpoint(d, variant, seed=200 + i, **WIDE, **extra)
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
        if variant in ("fp", "llama"):
            d = quantize(d, base / f"{name}-ternary", to="hf", quiet=True)
        out[name] = d
    return out


def _run(path) -> tuple[list[int], torch.Tensor]:
    """(greedy tokens after PROMPT, logits of PROMPT + FORCED): the tied oracle models repeat one token when
    left to themselves, so the teacher-forced logits are what tells two of them apart."""
    model, tok = bitnetlm.load(path)
    tokens = bitnetlm.generate(model, tok, PROMPT, max_tokens=N_TOKENS, temperature=0).tokens
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode(PROMPT + FORCED)]))
    return tokens, logits


def _expected(src, qtype: str, tmp_path):
    """The source itself for I2_S (lossless); for TQ1_0/TQ2_0 the source with each scale rounded to fp16, the
    one loss those types have (one fp16 scale per block), so the comparison is exact either way."""
    if qtype == "i2_s":
        return src
    model, tok_files = load_source(src)
    for m in model.modules():
        if isinstance(m, BitLinear):
            m.weight_scale = m.weight_scale.half().float()
    return save_model(model, tmp_path / "expected", "hf", tok_files)


def _round_trip(src, qtype: str, tmp_path, arch: str) -> tuple[list[int], torch.Tensor]:
    g = convert(src, tmp_path / f"m.{qtype}.gguf", to="gguf", qtype=qtype)
    meta = read_gguf(g).metadata
    assert meta["general.architecture"] == arch
    assert meta["general.quantization_version"] == 2
    cfg, want = bitnetlm.load(g)[0].config, read_config(src)
    assert (cfg.hidden_act, cfg.has_sub_norms) == (want.hidden_act, want.has_sub_norms)
    tokens, logits = _run(g)
    assert len(tokens) == N_TOKENS or tokens[-1] in cfg.eos_token_ids
    return tokens, logits


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("name", [*VARIANTS, "online-silu"])
def test_oracle_variants_generate_the_same_tokens_through_gguf(sources, name, qtype, tmp_path):
    src = sources[name]
    tokens, logits = _round_trip(src, qtype, tmp_path, ARCH[name])
    want_tokens, want_logits = _run(_expected(src, qtype, tmp_path))
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=0)


@pytest.fixture(scope="module")
def bitnet_tiny():
    from bitnetlm import zoo

    src = Path(zoo.resolve("bitnet-tiny"))
    return src, _run(src)[0]


@pytest.mark.parametrize("qtype", TYPES)
def test_bitnet_tiny_generates_the_same_tokens_through_gguf(bitnet_tiny, qtype, tmp_path):
    """The trained model's greedy tokens stand well clear of ties: TQ's fp16 scales leave them as they are."""
    src, want = bitnet_tiny
    assert _round_trip(src, qtype, tmp_path, "bitnet-b1.58")[0] == want


def test_smollm2_generates_the_same_tokens_through_gguf(tmp_path):
    """smollm2-135m-1.58 (a SiLU BitNet: bitnet) with its real ternary parts; I2_S only: its 576-wide rows do not
    fit the TQ types' 256-value blocks."""
    from zoo_parts import smollm2_random_embedding

    src = smollm2_random_embedding(tmp_path / "smollm2")
    tokens, logits = _round_trip(src, "i2_s", tmp_path, "bitnet")
    want_tokens, want_logits = _run(src)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=0)


# ---- tokenizer.ggml.pre -------------------------------------------------------------------------------


def test_every_pre_tokenizer_name_we_write_is_one_llama_cpp_accepts():
    assert set(WRITABLE) <= set(LLAMA_CPP_PRE_TOKENIZERS)
    assert set(KNOWN_HASHES.values()) <= set(WRITABLE)
    assert "gpt2" not in LLAMA_CPP_PRE_TOKENIZERS  # the name we used to write, which llama.cpp refuses


def test_pre_tokenizer_names_of_real_tokenizers():
    """llama.cpp's converter hashes each tokenizer's ids on its fixed text: LLaMA-3's hashes to its `llama-bpe`
    entry and SmolLM2's to `smollm` (the hashes come from llama.cpp, so this also checks the vendored text);
    bitnet-tiny's own BPE is unknown to llama.cpp and, being plain GPT-2 byte-level, gets `gpt-2`."""
    from assets import asset

    from bitnetlm import zoo

    cases = {
        asset("llama3-tokenizer"): "llama-bpe",
        zoo.models_dir() / "smollm2-135m-1.58": "smollm",
        Path(zoo.resolve("bitnet-tiny")): "gpt-2",
    }
    for d, want in cases.items():
        tj = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
        assert pre_tokenizer_name(tj) == want, d


def test_pre_tokenizer_names_by_structure_when_the_hash_is_unknown():
    """A vocabulary llama.cpp has never hashed gets the name of its pre-tokenizer's structure, one our reader
    rebuilds exactly; any other structure is a one-line error, not a name llama.cpp would tokenize differently."""
    from tokenizers import Regex

    from bitnetlm.formats.gguf_tokenizer import LLAMA3_SPLIT

    bl = pre_tokenizers.ByteLevel
    tok = byte_level_bpe()
    cases = [
        (bl(add_prefix_space=False), "gpt-2"),
        (
            pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), bl(add_prefix_space=False)]
            ),
            "smollm",
        ),
        (
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                    bl(add_prefix_space=False, use_regex=False),
                ]
            ),
            "llama-bpe",
        ),
        (bl(add_prefix_space=True), None),  # GPT-2's split, but a space before the first word
        (pre_tokenizers.Sequence([pre_tokenizers.Punctuation(), bl(add_prefix_space=False)]), None),
    ]
    for pre, want in cases:
        tok.pre_tokenizer = pre
        tj = json.loads(tok.to_str())
        if want is not None:
            assert pre_tokenizer_name(tj) == want
            continue
        with pytest.raises(ValueError, match="no llama.cpp name") as e:
            pre_tokenizer_name(tj, "x/tokenizer.json")
        assert "\n" not in str(e.value) and str(e.value).startswith("x/tokenizer.json: ")


def test_convert_writes_llama_cpp_pre_names_and_quantization_version(tmp_path):
    """What `bitnet convert --to gguf` writes for the zoo's byte-level BPE (was "gpt2": fatal in llama.cpp)."""
    from bitnetlm import zoo
    from bitnetlm.cli import main

    out = tmp_path / "tiny.gguf"
    assert main(["convert", str(zoo.resolve("bitnet-tiny")), str(out), "--to", "gguf", "--type", "i2_s"]) == 0
    meta = read_gguf(out).metadata
    assert meta["tokenizer.ggml.pre"] == "gpt-2" and meta["general.quantization_version"] == 2
    assert read_gguf(out).value_types["general.quantization_version"] == (4, None)  # UINT32, as llama.cpp
