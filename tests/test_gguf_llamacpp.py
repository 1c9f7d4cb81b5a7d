"""The GGUF files we write, loaded by llama.cpp itself: its tokenizer gives our token ids, its greedy decoding our
tokens. The build is llama.cpp's tree in the llama-cpp-python sdist (scripts/build_llama_bench.sh: llama-tokenize
and llama-simple beside llama-bench). It took 6 min 21 s on a 2-core Intel Xeon (2026-12-07; llama.cpp 0c1e57098,
sdist already downloaded), more than a CI run can spend, so these tests carry the marker `llamacpp`, which
scripts/test.sh deselects. Run them after the build:

    scripts/build_llama_bench.sh && python -m pytest -m llamacpp tests/test_gguf_llamacpp.py

Encoders (`bert`) are checked by llama.cpp's tokenizer (a float file: upstream has no I2_S).
Upstream llama.cpp runs the SiLU architectures (`bitnet`, `llama`) and `qwen3`, `gemma3`, `gpt2` with TQ1_0 / TQ2_0
and float tensors, which is every kind tested here. The ReLU^2 `bitnet-b1.58` architecture and I2_S are microsoft/BitNet's fork (bitnet.cpp),
and llama.cpp's `bitnet` has no `output` tensor, so an untied SiLU BitNet (1bitLLM) loads only in bitnet-lm.
"""

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from assets import ASSETS, asset
from oracle import random_model
from tokenizers import Tokenizer
from zoo_parts import teacher_forced

import bitnetlm
from bitnetlm import zoo
from bitnetlm.formats.gguf import save_gguf
from bitnetlm.formats.gguf_file import read_gguf
from bitnetlm.formats.gguf_pretok import LLAMA_CPP_COMMIT, LLAMA_CPP_PRE_TOKENIZERS

pytestmark = pytest.mark.llamacpp

TEXTS = [
    "Hello world",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune",
    "  leading spaces,\ttabs\n\nand newlines  ",
    "numbers 1234567 and 3.14159, 2024-12-07",
    "Ünïcödé 日本語 and emoji 🙂🦙",
    "don't won't I'll we'VE",
]
N_PREDICT = 16
MIN_MATCHED = 6  # greedy tokens that must agree before a divergence at a near-tie is accepted
NEAR_TIE = 0.05  # top-2 logit gap, in logit standard deviations, below which the two may pick differently


def _tool(name: str):
    path = ASSETS / "llama.cpp" / "bin" / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: build it with scripts/build_llama_bench.sh")
    return path


def _run(*args, stdin: bytes | None = None) -> bytes:
    r = subprocess.run([str(a) for a in args], input=stdin, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-2000:]
    return r.stdout


def _tokenizer_dirs():
    return {
        "gpt-2": Path(zoo.resolve("bitnet-tiny")),  # bitnet-tiny's own byte-level BPE
        "smollm": zoo.models_dir() / "smollm2-135m-1.58",
        "llama-bpe": asset("llama3-tokenizer"),
    }


def test_vendored_pre_tokenizer_names_match_the_built_source():
    """The names we may write come from this very llama.cpp tree (src/llama-vocab.cpp of the build's source)."""
    srcs = list(
        (ASSETS / "llama.cpp" / "src").glob("llama_cpp_python-*/vendor/llama.cpp/src/llama-vocab.cpp")
    )
    assert len(srcs) == 1, srcs
    commit = (ASSETS / "llama.cpp" / "COMMIT").read_text().strip()
    assert commit == LLAMA_CPP_COMMIT
    text = srcs[0].read_text()
    body = text[text.index('tokenizer_pre == "default"') : text.index("unknown pre-tokenizer type")]
    assert tuple(dict.fromkeys(re.findall(r'tokenizer_pre == "([^"]+)"', body))) == LLAMA_CPP_PRE_TOKENIZERS


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe"])
def test_llama_cpp_tokenizes_our_gguf_as_we_do(pre, tmp_path):
    d = _tokenizer_dirs()[pre]
    ref = Tokenizer.from_file(str(d / "tokenizer.json"))
    m = random_model("bitnet", vocab_size=ref.get_vocab_size(), hidden_act="silu")  # tied: one embedding
    path = save_gguf(m, tmp_path / "t.gguf", "tq2_0", tokenizer=d, embed_type="f16")
    assert read_gguf(path).metadata["tokenizer.ggml.pre"] == pre
    ours = bitnetlm.load(path)[1]
    for text in TEXTS:
        out = _run(
            _tool("llama-tokenize"),
            "-m",
            path,
            "--stdin",
            "--ids",
            "--no-escape",
            "--log-disable",
            stdin=text.encode(),
        )
        theirs = json.loads(out.decode().strip().splitlines()[-1])
        assert theirs == ours.encode(text) == ref.encode(text).ids, text


def test_llama_cpp_tokenizes_our_bert_gguf_as_we_do(tmp_path):
    """A `bert` file's WordPiece vocabulary (phantom-space tokens, [CLS] / [SEP]) read by llama.cpp's tokenizer."""
    from oracle_bert import make_bert

    path = make_bert(tmp_path / "m", "fp")
    model, tok = bitnetlm.load(path)
    out = save_gguf(model, tmp_path / "b.gguf", tokenizer=tok, embed_type="f32")
    ours = bitnetlm.load(out)[1]
    for text in TEXTS[:4] + ["Ünïcödé, the FIRST entering of a neighbourhood!"]:
        got = _run(
            _tool("llama-tokenize"),
            "-m",
            out,
            "--stdin",
            "--ids",
            "--no-escape",
            "--log-disable",
            stdin=text.encode(),
        )
        theirs = json.loads(got.decode().strip().splitlines()[-1])
        assert theirs == ours.encode(text) == tok.encode(text), text


def _model(kind: str, vocab: int):
    """Tiny random models of each kind llama.cpp runs. llama.cpp's `bitnet` has no `output` tensor (its head is
    always the embedding), so the BitNet kinds are tied; their embedding is scaled down so that the layers, not the
    input token's own embedding, decide the next token."""
    kw = dict(vocab_size=vocab, hidden=256, inter=256)
    if kind == "llama":  # a ternarized LLaMA
        return random_model("llama", seed=0, quant="ternary", **kw)
    if kind == "llama-fp":
        return random_model("llama", seed=1, **kw)
    if kind == "bitnet":  # 1bitLLM's block: SiLU, sub-norms, no GQA
        m = random_model("1bitllm", seed=2, tie_word_embeddings=True, **kw)
    else:  # smollm2-135m-1.58's: SiLU BitNet with GQA
        m = random_model("bitnet", seed=0, hidden_act="silu", **kw)
    with torch.no_grad():
        m.embed_tokens.weight.mul_(0.05)
    return m


def _gaps(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """Each greedy token's lead over the runner-up, in standard deviations of that step's logits."""
    logits, _ = teacher_forced(model, prompt, tokens)
    top2 = logits.topk(2, dim=-1).values
    return ((top2[:, 0] - top2[:, 1]) / logits.std(dim=-1)).tolist()


def _piece_bytes(tok, ids: list[int]) -> bytes:
    """The bytes llama.cpp prints for byte-level BPE tokens (special tokens as their text)."""
    from bitnetlm.formats.gguf_tokenizer import _bytes_to_unicode

    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    out = b""
    for i in ids:
        s = tok.id_to_token(i)
        out += bytes(byte_of[c] for c in s) if all(c in byte_of for c in s) else s.encode()
    return out


@pytest.mark.parametrize(
    "kind, qtype",
    [
        ("bitnet", "tq1_0"),
        ("bitnet", "tq2_0"),
        ("bitnet-gqa", "tq1_0"),
        ("bitnet-gqa", "tq2_0"),
        ("llama", "tq1_0"),
        ("llama", "tq2_0"),
        ("llama-fp", "f32"),
        ("llama-fp", "f16"),
    ],
)
def test_llama_cpp_generates_our_greedy_tokens(kind, qtype, tmp_path):
    d = _tokenizer_dirs()["gpt-2"]
    m = _model(kind, 8192).eval()
    fp = kind == "llama-fp"
    path = save_gguf(
        m,
        tmp_path / f"{kind}.gguf",
        "tq2_0" if fp else qtype,
        tokenizer=d,
        embed_type=qtype if fp else "auto",
    )
    want_arch = "llama" if kind.startswith("llama") else "bitnet"
    assert read_gguf(path).metadata["general.architecture"] == want_arch
    model, tok = bitnetlm.load(path)
    prompt = "It is a truth universally acknowledged"
    ids = tok.encode(prompt)
    ours = bitnetlm.generate(model, tok, ids, max_tokens=N_PREDICT, temperature=0).tokens
    out = _run(_tool("llama-simple"), "-m", path, "-n", N_PREDICT, prompt)
    # llama.cpp keeps K/V in fp16 (and the TQ types quantize activations per 256-value block, here one row), so
    # its logits differ from ours in the last bits: its tokens must be ours up to the first near-tie, if any.
    gaps = _gaps(model, ids, ours)
    n = 0
    while n < len(ours) and out.startswith(_piece_bytes(tok, ids + ours[: n + 1])):
        n += 1
    assert out.startswith(_piece_bytes(tok, ids)), out
    assert n == len(ours) or (n >= MIN_MATCHED and gaps[n] < NEAR_TIE), (n, gaps, out, ours)


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "gpt2"])
@pytest.mark.parametrize("variant", ["fp", "offline"])
def test_llama_cpp_runs_our_family_gguf(family, variant, tmp_path):
    """Qwen3, Gemma 3 and GPT-2 files (llama.cpp's qwen3 / gemma3 / gpt2, float or TQ2_0) written from checkpoints
    transformers wrote: llama.cpp's greedy tokens are ours up to the first near-tie."""
    from oracle_families import make_checkpoint

    d = _tokenizer_dirs()["gpt-2"]
    vocab = Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab_size()
    # every projection 256 wide: one TQ2_0 block per row, so llama.cpp's per-block int8 activations are our
    # per-token ones
    wide = {
        "gpt2": dict(n_embd=256, n_inner=256, n_positions=256),
        "qwen3": dict(hidden_size=256, intermediate_size=256, head_dim=64),
        "gemma3": dict(hidden_size=256, intermediate_size=256, head_dim=64, final_logit_softcapping=None),
    }[family]
    src = make_checkpoint(tmp_path / "src", family, variant, seed=3, vocab_size=vocab, **wide)
    model, _ = bitnetlm.load(src, backend="reference")
    with torch.no_grad():
        model.embed_tokens.weight.mul_(0.05)  # the layers, not the input token's embedding, decide
    qtype = None if variant == "fp" else "tq2_0"
    path = save_gguf(model, tmp_path / f"{family}.gguf", qtype, tokenizer=d, embed_type="f32")
    assert read_gguf(path).metadata["general.architecture"] == family
    model, tok = bitnetlm.load(path)
    prompt = "It is a truth universally acknowledged"
    ids = tok.encode(prompt)
    ours = bitnetlm.generate(model, tok, ids, max_tokens=N_PREDICT, temperature=0).tokens
    out = _run(_tool("llama-simple"), "-m", path, "-n", N_PREDICT, prompt)
    gaps = _gaps(model, ids, ours)
    n = 0
    while n < len(ours) and out.startswith(_piece_bytes(tok, ids + ours[: n + 1])):
        n += 1
    assert out.startswith(_piece_bytes(tok, ids)), out
    assert n == len(ours) or (n >= MIN_MATCHED and gaps[n] < NEAR_TIE), (n, gaps, out, ours)
