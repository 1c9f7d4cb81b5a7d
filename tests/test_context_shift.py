"""Context shift (llama.cpp's): a generation past the context window keeps its first tokens, drops the oldest half
of the rest, re-rotates the moved keys and goes on, equal to a reference of the same shift built from the model's
plain forward over its own KV cache; without it, generation ends at the window with "length" and says why."""

from __future__ import annotations

import json

import pytest
import torch

import bitnetlm
from bitnetlm.cli import main
from bitnetlm.engine.scheduler import ContextShift
from bitnetlm.engine.speculative import SpeculativeConfig
from bitnetlm.generate import SamplingParams, batch_generate, format_stats, generate, sample
from bitnetlm.models import ModelConfig, build_model
from bitnetlm.models.transformer import rotate_half
from bitnetlm.runtime import RuntimeConfig, make_runner

PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"


@pytest.fixture(scope="module")
def tiny(one_torch_thread):
    return bitnetlm.load("bitnet-tiny")  # 1,024 positions; CPU runner (the fused C step)


@pytest.fixture(scope="module")
def full_precision(one_torch_thread):
    """A random full-precision LLaMA (no int8 activations: the shifted keys' float error stays float error)."""
    from oracle import tiny_config_kwargs
    from serve_parts import tiny_tokenizer

    cfg = ModelConfig(arch="llama", quant="none", rope_theta=10000.0, **tiny_config_kwargs("llama"))
    torch.manual_seed(0)
    m = build_model(cfg, "fp")
    with torch.no_grad():
        m.embed_tokens.weight.normal_()
    return m.eval(), tiny_tokenizer()


def shift_cache(model, cache, n: int, keep: int, drop: int) -> None:
    """The shift on the model's own KVCache (row 0, n positions), the keys rotated by the model's RoPE at
    position -drop (`CausalLM.rope`, the rotate-half form of `Attention.forward`)."""
    cos, sin = model.rope(torch.full((1, 1), -drop), torch.float32)  # [1, 1, D]
    for k, v in zip(cache.k, cache.v, strict=True):
        moved = k[0, :, keep + drop : n].float()
        k[0, :, keep : n - drop] = (moved * cos[0] + rotate_half(moved) * sin[0]).to(k.dtype)
        v[0, :, keep : n - drop] = v[0, :, keep + drop : n].clone()
    cache.valid[0, n - drop :] = False


def reference_shift(model, prompt: list[int], params: SamplingParams, ctx: int, keep: int, n: int):
    """The same shift built from the model's plain forward over its own KVCache, one token at a time: at the
    window's end the first `keep` positions stay and half of the rest goes (`shift_cache`). Penalties see the
    whole generated text. -> (tokens, the chosen tokens' log-probabilities, shifts)."""
    out, lps, shifts = [], [], 0
    cache = model.new_cache(1, ctx)
    length = len(prompt)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]), cache=cache, last_only=True)[0, -1].float()
        for i in range(n):
            tok = int(sample(logits[None], [params], [None], [prompt], [out]).tokens[0])
            out.append(tok)
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            if i == n - 1:
                break
            if length == ctx:  # the token would be fed at position ctx
                drop = (length - keep) // 2
                shift_cache(model, cache, length, keep, drop)
                length, shifts = length - drop, shifts + 1
            pos = torch.tensor([[length]])
            logits = model(torch.tensor([[tok]]), positions=pos, cache=cache)[0, -1].float()
            length += 1
    return out, lps, shifts


@pytest.mark.parametrize("which", ["tiny", "full_precision"])
def test_runner_shift_equals_reference(request, which):
    """Runner.shift equals the shift on the model's own cache (keys within float error, values exact, the next
    decode's logits within 1e-4; the fused C step within its usual distance of the plain forward, its int8
    activations rounding a little differently); the other row is untouched. The first layer's re-rotated keys are those the
    kept tokens get at their new positions (RoPE composes); deeper layers' keys keep what the kept tokens saw of
    the dropped ones, as in llama.cpp, so they are not a recomputation's."""
    model, _ = request.getfixturevalue(which)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(3, model.config.vocab_size, (50,), generator=g).tolist()
    runner = make_runner(model, RuntimeConfig(), rows=2, max_seq_len=64)
    runner.prefill(0, toks[:30])
    runner.prefill(1, toks[:48])
    before = [k[0, :, :30].clone() for k in runner.cache.k]  # (its slot 30: padding of the decode)
    runner.shift(1, 4, 20)
    assert runner.lengths[1] == 28
    got = runner.decode([1], [toks[48]], [28])[0]

    cache = model.new_cache(1, 64)
    with torch.inference_mode():
        model(torch.tensor([toks[:48]]), cache=cache)
        shift_cache(model, cache, 48, 4, 20)
        want = model(torch.tensor([[toks[48]]]), positions=torch.tensor([[28]]), cache=cache)[0, -1].float()
    tol = 1e-4 if which == "full_precision" else 5e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert int(got.argmax()) == int(want.argmax())
    for k, v, kr, vr, k0 in zip(runner.cache.k, runner.cache.v, cache.k, cache.v, before, strict=True):
        torch.testing.assert_close(k[1, :, :29], kr[0, :, :29], atol=tol, rtol=tol)
        torch.testing.assert_close(v[1, :, :29], vr[0, :, :29], atol=tol, rtol=tol)
        assert torch.equal(k[0, :, :30], k0)
    assert not runner.cache.valid[1, 29:].any() and runner.cache.valid[1, :29].all()

    fresh = make_runner(model, RuntimeConfig(), rows=1, max_seq_len=64)
    fresh.prefill(0, toks[:4] + toks[24:48])
    torch.testing.assert_close(
        runner.cache.k[0][1, :, :28], fresh.cache.k[0][0, :, :28], atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("which, penalty", [("full_precision", 1.0), ("full_precision", 1.3), ("tiny", 1.0)])
def test_generate_past_window_equals_reference(request, which, penalty):
    """Greedy tokens equal the reference's exactly (the fused C step's too); on the full-precision model the
    log-probabilities agree within float error."""
    model, tok = request.getfixturevalue(which)
    p = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True, repetition_penalty=penalty)
    ids = tok.encode(PROMPT)
    ref, ref_lp, shifts = reference_shift(model, ids, p, ctx=48, keep=3, n=120)
    assert shifts >= 4
    r = generate(model, tok, PROMPT, p, ctx_size=48, context_shift=True, n_keep=2)  # + BOS: 3 kept
    assert r.tokens == ref and r.finish_reason == "length" and r.finish_detail is None
    if which == "full_precision":  # (a ternary model's int8 activations turn float error into rounding steps)
        assert r.logprobs == pytest.approx(ref_lp, abs=1e-4)


def test_batch_rows_shift_alone(full_precision):
    """Rows of a batch shift at their own steps, each as it would alone."""
    model, tok = full_precision
    prompts = [PROMPT, "Call me Ishmael.", "The quick brown fox jumps over the lazy dog, and then"]
    p = SamplingParams(max_tokens=70, temperature=0, ignore_eos=True)
    rows = batch_generate(model, tok, prompts, p, ctx_size=40, context_shift=True, n_keep=-1)
    for text, r in zip(prompts, rows, strict=True):
        ids = tok.encode(text)
        ref, _, shifts = reference_shift(model, ids, p, ctx=40, keep=min(len(ids), 38), n=70)
        assert shifts >= 1 and r.tokens == ref


def test_without_shift_length_says_why(tiny):
    model, tok = tiny
    r = generate(model, tok, PROMPT, max_tokens=100, temperature=0, ignore_eos=True, ctx_size=40)
    n = len(tok.encode(PROMPT))
    assert r.finish_reason == "length" and r.generation_tokens == 40 - n
    assert "context window is full" in r.finish_detail and "--context-shift" in r.finish_detail
    assert r.finish_detail in format_stats(r)
    short = generate(model, tok, PROMPT, max_tokens=5, temperature=0, ignore_eos=True, ctx_size=40)
    assert short.finish_reason == "length" and short.finish_detail is None  # max_tokens, not the window


@pytest.mark.parametrize("draft", ["lookup", "model"])
def test_speculative_with_shift_unchanged(tiny, draft):
    """Prompt lookup drafts through shifts (verify stays inside the window); a draft model stops drafting for a
    shifted row: the tokens are those of plain decoding with the same shift."""
    model, tok = tiny
    text = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"
    p = SamplingParams(max_tokens=90, temperature=0, ignore_eos=True)
    kw = dict(ctx_size=48, context_shift=True, n_keep=4)
    base = generate(model, tok, text, p, **kw)
    spec = SpeculativeConfig(num_tokens=4, lookup=3) if draft == "lookup" else SpeculativeConfig(draft=model)
    r = generate(model, tok, text, p, speculative=spec, **kw)
    assert r.tokens == base.tokens and r.draft_tokens > 0


def test_keep_and_errors():
    assert ContextShift(0).keep([1, 5, 6, 7], bos=1, context=10) == 1  # BOS always stays
    assert ContextShift(2).keep([5, 6, 7], bos=1, context=10) == 2
    assert ContextShift(-1).keep([1, 5, 6, 7], bos=1, context=10) == 4
    assert ContextShift(-1).keep(list(range(9)), bos=None, context=10) == 8  # each shift drops one at least
    with pytest.raises(ValueError, match="--keep -2"):
        ContextShift(-2)


@pytest.mark.parametrize("shift", [None, ContextShift(4)])
def test_chat_answer_past_the_window(tiny, shift):
    """`bitnet chat --context-shift`: an answer goes on past the window; without it, it ends there and says why."""
    import io

    from bitnetlm.commands.chat import chat_session

    model, tok = tiny
    out, err = io.StringIO(), io.StringIO()
    p = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    kw = dict(ctx_size=64, out=out, err=err, json_lines=True, context_shift=shift)
    chat_session(model, tok, ["Tell me a long story."], p, **kw)
    turn = json.loads(out.getvalue().splitlines()[-1])
    if shift is None:
        assert turn["finish_reason"] == "length" and turn["generation_tokens"] < 100
        assert "context window is full" in turn["finish_detail"]
    else:
        assert turn["generation_tokens"] == 100 and turn["finish_detail"] is None


@pytest.fixture(scope="module")
def model_1024(tmp_path_factory):
    """A saved tiny ternary model of 1,024 positions with its tokenizer."""
    from serve_parts import tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer(max_len=1024, layers=2, hidden=64, backend=None)
    d = tmp_path_factory.mktemp("ctx") / "tiny1024"
    bitnetlm.save(model, d, tokenizer=tok)
    return d


def test_cli_n_2000_on_a_1024_token_model(model_1024, capsys):
    """`-n 2000` on a model of 1,024 positions: 2000 tokens with --context-shift; without it, a stop with the
    reason in --json and -v."""
    common = ["generate", "-m", str(model_1024), "-p", "Once upon a time", "--temp", "0", "--ignore-eos"]
    common += ["--device", "cpu", "--threads", "1"]
    assert main([*common, "-n", "2000", "--context-shift", "--keep", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["generation_tokens"] == 2000 and len(out["tokens"]) == 2000 and out["finish_detail"] is None
    assert main([*common, "-n", "2000", "--json", "-v"]) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert out["finish_reason"] == "length" and out["generation_tokens"] == 1024 - out["prompt_tokens"]
    assert "context window is full" in out["finish_detail"] and "context window is full" in cap.err


@pytest.mark.gpu
def test_cuda_generation_past_window_equals_reference(full_precision):
    """The CUDA runner's shift (plain torch ops on the engine's cache, queued between captured steps) gives the
    reference's greedy tokens; a sampled row that draws more tokens than the runner holds positions reloads its
    stream's next uniforms (top_k=1: the greedy tokens; a seed: the same tokens twice)."""
    import copy

    from bitnetlm.runtime import kept_runner
    from bitnetlm.runtime.cuda.runner import CudaRunner

    model, tok = full_precision
    gpu = copy.deepcopy(model).to("cuda")
    ids = tok.encode(PROMPT)
    p = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    ref, ref_lp, shifts = reference_shift(model, ids, p, ctx=48, keep=3, n=120)
    r = generate(gpu, tok, ids, p, ctx_size=48, context_shift=True, n_keep=2)
    assert isinstance(kept_runner(gpu), CudaRunner) and shifts >= 4
    assert r.tokens == ref and r.logprobs == pytest.approx(ref_lp, abs=1e-3)

    n = kept_runner(gpu).max_seq_len + 100
    kw = dict(max_tokens=n, ignore_eos=True, ctx_size=48, context_shift=True)
    greedy = generate(gpu, tok, ids, temperature=0, **kw)
    assert generate(gpu, tok, ids, top_k=1, seed=1, **kw).tokens == greedy.tokens
    a, b = (generate(gpu, tok, ids, temperature=0.9, seed=5, **kw) for _ in range(2))
    assert len(a.tokens) == n and a.tokens == b.tokens


@pytest.mark.parametrize("shift", [False, True])
def test_serve_context_shift(one_torch_thread, shift):
    """`bitnet serve --context-shift`: a completion past the window is accepted and equals offline generation
    with the shift; without it such a request is refused, and one that fills the window (max_tokens null) says
    why it ended, in the body and in the stream's last chunk."""
    import httpx
    from serve_parts import tiny_model_and_tokenizer

    from bitnetlm.serve import start

    model, tok = tiny_model_and_tokenizer(max_len=256)
    body = {"model": "m", "prompt": PROMPT, "temperature": 0, "ignore_eos": True}
    with start(
        model, tok, port=0, max_seq_len=48, context_shift=shift, model_name="m", log_level="warning"
    ) as h:
        r = httpx.post(h.url + "/v1/completions", json={**body, "max_tokens": 100}, timeout=60)
        if not shift:
            assert r.status_code == 400 and "maximum context length is 48" in r.text
            r = httpx.post(h.url + "/v1/completions", json={**body, "max_tokens": None}, timeout=60)
            c = r.json()["choices"][0]
            assert c["finish_reason"] == "length" and "context window is full" in c["finish_detail"]
            with httpx.stream(
                "POST",
                h.url + "/v1/completions",
                json={**body, "max_tokens": None, "stream": True},
                timeout=60,
            ) as s:
                frames = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
            assert "context window is full" in frames[-1]["choices"][0]["finish_detail"]
            return
        c = r.json()["choices"][0]
        assert "finish_detail" not in c and c["finish_reason"] == "length"
    p = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    assert c["text"] == str(generate(model, tok, PROMPT, p, ctx_size=48, context_shift=True))
