"""Qwen3, Gemma 3 (text) and GPT-2 against transformers, on tiny checkpoints transformers writes itself (full
precision, online ternary from float master weights, offline packed): logits, greedy generation, save / convert
round trips, and the runners (the fused CPU step and the CUDA engine decline them; the model's own forward runs)."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from oracle import byte_level_bpe, greedy_with_cache, pinned_quantizer_inputs
from oracle_families import FAMILIES, QUANT_VARIANTS, make_checkpoint, oracle_model

import bitnetlm
from bitnetlm.formats.names import GPT2_LAYER
from bitnetlm.quant import BitLinear

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CASES = [(f, v) for f in FAMILIES for v in QUANT_VARIANTS]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(family, variant) -> a checkpoint directory written by transformers, with a byte-level BPE tokenizer."""
    base = tmp_path_factory.mktemp("families")
    tok = byte_level_bpe()
    out = {}
    for i, (family, variant) in enumerate(CASES):
        d = make_checkpoint(base / f"{family}-{variant}", family, variant, seed=300 + i)
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
        out[family, variant] = d
    return out


def _ids(n=24, seed=0, rows=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (rows, n), generator=g)


def _rename(family: str):
    """transformers' module name -> ours (GPT-2 spells its modules differently)."""
    if family != "gpt2":
        return None
    inverse = {v: k for k, v in GPT2_LAYER.items()}

    def rename(n: str) -> str:
        _, _, i, rest = n.split(".", 3)  # transformer.h.N.<module>
        return f"layers.{i}.{inverse[rest]}"

    return rename


def _pinned(ref, model, ids, family, variant):
    if variant == "fp":
        return contextlib.nullcontext()
    return pinned_quantizer_inputs(ref, model, ids, rename=_rename(family))


def _max_diff(ref, model, ids, family, variant) -> float:
    with torch.no_grad(), _pinned(ref, model, ids, family, variant):
        expected, got = ref(ids).logits, model(ids)
    assert got.shape == expected.shape
    return (got - expected).abs().max().item()


@pytest.mark.parametrize("family,variant", CASES)
def test_logits_match_transformers(dirs, family, variant):
    ref = oracle_model(dirs[family, variant])
    model, _ = bitnetlm.load(dirs[family, variant], backend="reference")
    assert model.config.arch == family
    assert any(isinstance(m, BitLinear) for m in model.modules()) == (variant != "fp")
    diff = _max_diff(ref, model, _ids(), family, variant)  # 24 tokens: past Gemma3's sliding window of 6
    assert diff <= 1e-4, f"{family}/{variant}: max |logits diff| = {diff}"


@pytest.mark.parametrize("family,variant", CASES)
def test_greedy_matches_transformers(dirs, family, variant):
    ref = oracle_model(dirs[family, variant])
    model, tok = bitnetlm.load(dirs[family, variant])  # the CPU backend and runner
    prompt = _ids(7, seed=3, rows=1)
    with torch.no_grad():
        expected = ref.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, 7:].tolist()
        cached = greedy_with_cache(model, prompt, 24)[0].tolist()
    got = bitnetlm.generate(model, tok, prompt[0].tolist(), max_tokens=24, temperature=0, ignore_eos=True)
    assert cached == expected
    assert got.tokens == expected


def test_gemma3_window_is_honoured(dirs):
    """Past the window, a local layer must not see the oldest tokens: dropping the window changes the logits
    (and with it the match with transformers), on the full forward and on cached decoding alike."""
    path = dirs["gemma3", "fp"]
    ref = oracle_model(path)
    model, _ = bitnetlm.load(path, backend="reference")
    ids = _ids(20, seed=5, rows=1)
    with torch.no_grad():
        want = ref(ids).logits
        cache = model.new_cache(1, 32)
        steps = [model(ids[:, :9], cache=cache)]
        for p in range(9, 20):
            steps.append(model(ids[:, p : p + 1], positions=torch.tensor([[p]]), cache=cache))
        wide = model.config.replace(sliding_window=64)
        model.config = wide
        unwindowed = model(ids)
    torch.testing.assert_close(torch.cat(steps, 1), want, atol=1e-4, rtol=0)
    assert (unwindowed[:, 8:] - want[:, 8:]).abs().max() > 1e-2


def test_qwen3_sliding_window_matches_transformers(tmp_path):
    """Qwen3 with use_sliding_window (layers from max_window_layers on are local; refused before): logits and
    cached decoding equal transformers' past the window; saved, its window survives; GGUF (llama.cpp's qwen3 has
    no window) refuses it in one line."""
    from bitnetlm.formats.gguf import save_gguf

    kw = dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)
    src = make_checkpoint(tmp_path / "src", "qwen3", "fp", seed=11, **kw)
    ref = oracle_model(src)
    model, _ = bitnetlm.load(src, backend="reference")
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    ids = _ids(20, seed=6, rows=1)
    with torch.no_grad():
        want = ref(ids).logits
        cache = model.new_cache(1, 32)
        steps = [model(ids[:, :8], cache=cache)]
        for p in range(8, 20):
            steps.append(model(ids[:, p : p + 1], positions=torch.tensor([[p]]), cache=cache))
    torch.testing.assert_close(torch.cat(steps, 1), want, atol=1e-4, rtol=0)
    again, _ = bitnetlm.load(bitnetlm.save(model, tmp_path / "saved"), backend="reference")
    assert again.config == model.config
    with torch.no_grad():
        assert (again(ids) - want).abs().max().item() <= 1e-4
        model.config = model.config.replace(sliding_window=64)
        assert (model(ids)[:, 6:] - want[:, 6:]).abs().max() > 1e-2  # the window is what matches
    with pytest.raises(ValueError, match="no sliding-window attention"):
        save_gguf(again, tmp_path / "q.gguf", qtype=None)


@pytest.mark.parametrize("family,variant", CASES)
def test_save_roundtrip_and_transformers_reads_it(dirs, tmp_path, family, variant):
    model, _ = bitnetlm.load(dirs[family, variant], backend="reference")
    out = bitnetlm.save(model, tmp_path / "saved")
    again, _ = bitnetlm.load(out, backend="reference")
    sd1, sd2 = model.state_dict(), again.state_dict()
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == {"gemma3": "gemma3_text"}.get(family, family)
    if variant != "fp":
        assert cfg["quantization_config"]["quantization_mode"] == "offline"
    ref = oracle_model(
        out
    )  # transformers (GPT-2 ternary: its AutoBitLinear layers) reads the saved directory
    assert _max_diff(ref, again, _ids(), family, variant) <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_to_hf_and_quantize(dirs, tmp_path, family):
    from bitnetlm.convert import convert, quantize

    src = dirs[family, "offline"]
    out = convert(src, tmp_path / "hf", to="hf")
    a, _ = bitnetlm.load(src, backend="reference")
    b, _ = bitnetlm.load(out, backend="reference")
    ids = _ids(12)
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))
    q = quantize(dirs[family, "fp"], tmp_path / "q", to="hf", quiet=True)
    model, _ = bitnetlm.load(q, backend="reference")
    assert model.config.quant == "ternary" and model.config.arch == family
    ref = oracle_model(q)
    assert _max_diff(ref, model, ids, family, "offline") <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_runners_decline_and_batches_are_invariant(dirs, family):
    """The fused C step and the CUDA engine take LLaMA-shaped layers only and say so; the CPU runner then runs
    the model's own layers over the C projections, and a prompt decodes the same alone as in a batch."""
    from bitnetlm.runtime.cpu import why_not
    from bitnetlm.runtime.cuda.weights import from_model

    model, tok = bitnetlm.load(dirs[family, "offline"])
    assert family in why_not(model)
    with pytest.raises(TypeError, match=family):
        from_model(model, "ternary", torch.float32, torch.device("cpu"))
    prompts = [_ids(n, seed=n, rows=1)[0].tolist() for n in (3, 11, 7)]
    kw = dict(max_tokens=12, temperature=0, ignore_eos=True)
    batch = bitnetlm.batch_generate(model, tok, prompts, **kw)
    for p, r in zip(prompts, batch, strict=True):
        assert r.tokens == bitnetlm.generate(model, tok, p, **kw).tokens


@pytest.mark.parametrize("family", ["gemma3", "gpt2"])
def test_serve_runs_the_family_on_cpu(dirs, family):
    """The server's engine drives the same CPU runner: concurrent greedy completions equal offline generation."""
    import concurrent.futures

    import httpx

    from bitnetlm.serve import start

    model, tok = bitnetlm.load(dirs[family, "offline"])
    prompts = [_ids(n, seed=n, rows=1)[0].tolist() for n in (4, 9, 13)]
    kw = dict(max_tokens=10, temperature=0, ignore_eos=True)
    want = [bitnetlm.generate(model, tok, p, **kw).tokens for p in prompts]
    h = start(model, tok, port=0, max_batch=4, log_level="warning")
    try:

        def ask(p):
            body = {"model": "bitnet", "prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            r = httpx.post(h.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            texts = list(pool.map(ask, prompts))
    finally:
        h.stop()
    assert texts == [tok.decode(w) for w in want]


@pytest.mark.parametrize("family", FAMILIES)
def test_context_shift_where_one_rope_angle_moves_the_keys(dirs, family):
    """Qwen3's cached keys re-rotate like LLaMA's: generation goes past the window. Gemma 3 (two RoPE bases) and
    GPT-2 (learned positions) refuse the option in one line instead of shifting wrongly."""
    model, tok = bitnetlm.load(dirs[family, "fp"])
    kw = dict(max_tokens=40, temperature=0, ignore_eos=True, ctx_size=32, context_shift=True)
    prompt = _ids(8, rows=1)[0].tolist()
    if family == "qwen3":
        assert len(bitnetlm.generate(model, tok, prompt, **kw).tokens) == 40
    else:
        with pytest.raises(ValueError, match=f"--context-shift: not available for {family} models"):
            bitnetlm.generate(model, tok, prompt, **kw)
