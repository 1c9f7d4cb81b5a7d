"""Greedy generation through the CUDA-graph engine equals the CPU reference path token for token (GPU only)."""

from __future__ import annotations

import pytest
import torch
from oracle import greedy_with_cache

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("keys", ["range", "small", "default"])
@pytest.mark.parametrize("variant", ["packed-autobitlinear", "online", "1bitllm", "llama"])
def test_greedy_64_tokens_equal_cpu_reference(oracle_dirs, variant, keys):
    """keys: the step's attention runs its short-context splits (71 keys at most: "range"), the default splits
    over small blocks ("small") or over the default ones (by the engine's DecodePlan)."""
    from bitnetlm.kernels.triton.plan import DecodePlan
    from bitnetlm.loading import load_model
    from bitnetlm.runtime.cuda.engine import CudaEngine, EngineConfig

    plan = DecodePlan(
        attn_range_max_b=8 if keys == "range" else 0, attn_small_max_b=2 if keys == "small" else 0
    )

    ours, _ = oracle_dirs[variant]
    model = load_model(ours, device="cpu", backend="reference").eval()
    prompt = torch.randint(3, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    ref = greedy_with_cache(model, prompt, 64)
    weights = "dense" if model.mode == "fp" else "ternary"
    ecfg = EngineConfig(max_batch=2, max_seq_len=80, dtype=torch.float32, weights=weights, plan=plan)
    eng = CudaEngine.from_model(model, ecfg, device="cuda")
    got = eng.generate(prompt, 64).cpu()
    assert torch.equal(got, ref), (got != ref).nonzero()[:5]


# ---- generate / batch_generate on CUDA through the CUDA runner (bitnetlm/runtime/cuda/runner.py) ------------
def _graph_engine_of(model):
    from bitnetlm.runtime import kept_runner

    return getattr(kept_runner(model), "eng", None)


@pytest.mark.parametrize("variant", ["packed-autobitlinear", "online", "1bitllm", "llama"])
def test_graph_generate_equals_cpu_reference(oracle_dirs, variant):
    """Single prompts and a batch of different-length prompts (each prefilled into its own cache row, decoded
    together at their own positions) give the CPU reference's greedy tokens."""
    from serve_parts import tiny_tokenizer

    from bitnetlm.generate import SamplingParams, batch_generate, generate
    from bitnetlm.loading import load_model

    ours, _ = oracle_dirs[variant]
    cpu = load_model(ours, device="cpu", backend="reference").eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 11, 8)]
    ref = [greedy_with_cache(cpu, torch.tensor([p]), 40)[0].tolist() for p in prompts]
    model = load_model(ours, device="cuda", dtype=torch.float32).eval()
    tok = tiny_tokenizer()
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    one = [generate(model, tok, p, sp).tokens for p in prompts]
    assert _graph_engine_of(model) is not None, "generate on CUDA did not take the CUDA-graph path"
    assert one == ref
    assert [r.tokens for r in batch_generate(model, tok, prompts, sp)] == ref
    eng = _graph_engine_of(model)
    assert eng.ecfg.max_batch == 3
    if eng.ecfg.weights == "ternary":  # one copy of the packed weights: the projections read engine rows
        for blk, L in zip(model.layers, eng.layers):
            v, up = blk.self_attn.v_proj.packed, blk.mlp.up_proj.packed
            assert v.untyped_storage().data_ptr() == L.qkv.untyped_storage().data_ptr()
            assert up.untyped_storage().data_ptr() == L.gate_up.untyped_storage().data_ptr()
            assert blk.mlp.down_proj.packed.data_ptr() == L.down.data_ptr()


@pytest.mark.parametrize("head", ["int8", "bf16"])
def test_load_head_dtype_on_cuda_picks_the_engine_head(oracle_dirs, head):
    """load(..., device="cuda", head_dtype=...) keeps the float head on the model and picks the CUDA-graph
    engine's head: "int8" gives the tokens of an engine built directly with the int8 head (its kernel is checked
    against exact products in test_kernels_triton.py), "bf16" the float head's (the CPU reference's tokens)."""
    from serve_parts import tiny_tokenizer

    from bitnetlm.generate import SamplingParams, generate
    from bitnetlm.loading import load_model
    from bitnetlm.runtime.cuda.engine import CudaEngine, EngineConfig

    ours, _ = oracle_dirs["packed-autobitlinear"]
    prompt = torch.randint(3, 500, (1, 9), generator=torch.Generator().manual_seed(4))
    plain = load_model(ours, device="cuda", dtype=torch.float32).eval()
    if head == "int8":
        direct = CudaEngine.from_model(
            plain, EngineConfig(max_seq_len=64, dtype=torch.float32, head="int8"), device="cuda"
        )
        want = direct.generate(prompt, 24).cpu()[0].tolist()
        del direct
    else:
        want = greedy_with_cache(load_model(ours, device="cpu").eval(), prompt, 24)[0].tolist()
    model = load_model(ours, device="cuda", dtype=torch.float32, head_dtype=head).eval()
    assert model.embed_tokens.weight.numel() > 0  # the model itself keeps its float embedding and head
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    got = generate(model, tiny_tokenizer(), prompt[0].tolist(), sp).tokens
    eng = _graph_engine_of(model)
    assert eng is not None and eng.ecfg.head == ("int8" if head == "int8" else "fp")
    assert got == want


def test_graph_generate_stops_lengths_and_stale_weights():
    """Stop token ids, stop strings and max_tokens end the rows of the graph path where the eager loop ends
    them; a batch whose rows stop at different steps keeps decoding the others; a weight changed in place
    after a call rebuilds the engine instead of decoding with stale weights."""
    from serve_parts import tiny_model_and_tokenizer

    from bitnetlm.generate import SamplingParams, batch_generate, generate

    model, tok = tiny_model_and_tokenizer(max_len=256, layers=2, hidden=64)
    model = model.to("cuda")
    prompt = "It is a truth universally acknowledged"
    full = generate(model, tok, prompt, max_tokens=30, temperature=0, ignore_eos=True)
    eng = _graph_engine_of(model)
    assert eng is not None and len(full.tokens) == 30 and full.finish_reason == "length"
    eager = generate(model, tok, prompt, max_tokens=30, temperature=0, ignore_eos=True, enforce_eager=True)
    assert full.tokens == eager.tokens and str(full) == str(eager)
    assert full.logprobs == pytest.approx(eager.logprobs, abs=1e-3)

    stop_id = full.tokens[12]
    cut = full.tokens.index(stop_id) + 1
    r = generate(model, tok, prompt, max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    assert r.tokens == full.tokens[:cut] and r.finish_reason == "stop"
    text = str(full)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    r = generate(model, tok, prompt, max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    assert str(r) == text[: text.index(stop)] and r.finish_reason == "stop"
    short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    long = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    rows = batch_generate(model, tok, [prompt, prompt + " that"], [short, long])
    assert rows[0].tokens == full.tokens[:4] and rows[0].finish_reason == "length"
    assert rows[1].tokens == generate(model, tok, prompt + " that", long).tokens

    down = model.layers[0].mlp.down_proj  # the engine holds its own copy of the packed projections
    down.load_ternary(-down.ternary_weight(), down.scale())
    flipped = generate(model, tok, prompt, max_tokens=30, temperature=0, ignore_eos=True)
    assert _graph_engine_of(model) is not eng
    eager = generate(model, tok, prompt, max_tokens=30, temperature=0, ignore_eos=True, enforce_eager=True)
    assert flipped.tokens == eager.tokens and flipped.tokens != full.tokens


def test_graph_generate_sampling_is_seeded():
    """Sampled rows draw from their own seeded generators, as in the eager loop: same seed, same tokens."""
    from serve_parts import tiny_model_and_tokenizer

    from bitnetlm.generate import SamplingParams, generate

    model, tok = tiny_model_and_tokenizer(max_len=256, layers=2, hidden=64)
    model = model.to("cuda")
    p = SamplingParams(max_tokens=24, temperature=0.9, top_k=40, top_p=0.95, seed=5, ignore_eos=True)
    a, b = generate(model, tok, "Hello", p), generate(model, tok, "Hello", p)
    assert a.tokens == b.tokens
    c = generate(model, tok, "Hello", SamplingParams(**{**p.__dict__, "seed": 6}))
    assert c.tokens != a.tokens
    greedy = generate(model, tok, "Hello", max_tokens=24, temperature=0, ignore_eos=True)
    assert (
        generate(model, tok, "Hello", max_tokens=24, top_k=1, seed=1, ignore_eos=True).tokens == greedy.tokens
    )


def _runner_steps(model, prompts, params, steps: int, steady: bool):
    """Drive a CudaRunner by hand: prefill each prompt into its row, sample the first tokens, then `steps` decode
    steps with carried tokens, through the captured sampler; beside it the host sampler over the same logits with
    its own copy of every row's stream. steady: decode_sample (step and sampler in one replay when steady) or
    decode then sample (the step's logits intact for the host sampler). Returns (captured, host) per step:
    (tokens, logprobs, top ids) each."""
    from bitnetlm.runtime.base import SampleSpec, host_sample
    from bitnetlm.runtime.config import RuntimeConfig
    from bitnetlm.runtime.cuda.runner import CudaRunner
    from bitnetlm.sampling import RowRandom

    runner = CudaRunner(model, RuntimeConfig(), len(prompts), 256)

    def specs():
        return [
            SampleSpec(i, p, RowRandom(p.make_generator("cuda"), "cuda"), p.max_tokens, owner=object())
            for i, p in enumerate(params)
        ]

    cap, host = specs(), specs()
    rows = list(range(len(prompts)))
    with torch.inference_mode():
        logits = torch.stack([runner.prefill(i, p) for i, p in enumerate(prompts)])
        want = host_sample(logits, host)
        got = runner.collect(runner.sample(cap, logits, carry=True))
        out = [((got.tokens, got.logprobs, got.top_ids), (want.tokens, want.logprobs, want.top_ids))]
        pos = [len(p) for p in prompts]
        for _ in range(steps):
            if steady:
                pend = runner.decode_sample(rows, [None] * len(rows), pos, cap, carry=True)
            else:
                runner.decode(rows, [None] * len(rows), pos)
                want = host_sample(runner.logits[rows], host)
                pend = runner.sample(cap, carry=True)
            got = runner.collect(pend)
            out.append(
                (
                    (got.tokens, got.logprobs, got.top_ids),
                    None if steady else (want.tokens, want.logprobs, want.top_ids),
                )
            )
            pos = [p + 1 for p in pos]
    return out


def test_graph_sampler_equals_the_host_sampler(monkeypatch):
    """The captured samplers (runtime/cuda/graph_sampler.py) against the host sampler over the same logits: rows
    mixing llama.cpp's sampler, top-p alone (the full sort), a biased greedy row and top log-probabilities give
    the same tokens and log-probabilities, step after step; steady decoding (the step and its sampler in one
    replay) the same tokens as the two replays; all-greedy rows take the one-launch greedy sampler; and through
    generate, a batch and a stream with top log-probabilities equal the rows decoded alone."""
    from serve_parts import tiny_model_and_tokenizer

    from bitnetlm.generate import SamplingParams, batch_generate, generate, stream_generate
    from bitnetlm.runtime.cuda import graph_sampler as graph_sampler_mod

    model, tok = tiny_model_and_tokenizer(max_len=256, layers=2, hidden=64)
    model = model.to("cuda")
    prompts = [tok.encode(t) for t in ("Hello", "It is a truth universally acknowledged", "the quick brown")]
    params = [
        SamplingParams(
            max_tokens=40, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1, ignore_eos=True
        ),
        SamplingParams(max_tokens=40, temperature=0.7, top_p=0.9, seed=2, ignore_eos=True, top_logprobs=3),
        SamplingParams(max_tokens=40, temperature=0, logit_bias={7: 3.0}, ignore_eos=True),
    ]
    two = _runner_steps(model, prompts, params, 20, steady=False)
    for (gt, glp, gtop), (ht, hlp, htop) in two:
        assert gt == ht and glp == pytest.approx(hlp, abs=1e-5)
        assert [r[:3] for r in gtop] == [r[:3] for r in htop]
    one = _runner_steps(model, prompts, params, 20, steady=True)
    assert [g[0] for g, _ in one] == [g[0] for g, _ in two]
    assert len({t[0] for (t, _, _), _ in two}) > 5  # row 0 samples varied tokens

    fused, real = [], graph_sampler_mod.greedy_sample

    def spy(
        *args,
    ):  # the all-greedy rows' sampler, one launch (reductions.greedy_sample), seen at its capture
        fused.append(real(*args))
        return fused[-1]

    monkeypatch.setattr(graph_sampler_mod, "greedy_sample", spy)
    greedy = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (30, 12, 30)]
    texts = ["Hello", "It is a truth universally acknowledged", "the quick brown"]
    rows = batch_generate(model, tok, texts, greedy)
    assert True in fused and [len(r.tokens) for r in rows] == [30, 12, 30]
    assert [r.tokens for r in rows] == [generate(model, tok, t, p).tokens for t, p in zip(texts, greedy)]
    sampled = batch_generate(model, tok, texts, params)
    for t, p, r in zip(texts, params, sampled, strict=True):
        alone = generate(model, tok, t, p)
        assert r.tokens == alone.tokens and r.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    chunks = list(stream_generate(model, tok, texts[1], params[1]))
    assert [c.token for c in chunks] == sampled[1].tokens and len(chunks[0].top_logprobs) == 3


def test_row_random_on_cuda_is_one_stream():
    """On a CUDA generator one draw of n numbers is not n draws of one: RowRandom's blocks make a request's
    up-front run (the graph sampler) the numbers its one-a-step draws (the server's host sampler) get."""
    from bitnetlm.sampling.sampler import BLOCK, RowRandom

    n = BLOCK + 9
    r = RowRandom(torch.Generator("cuda").manual_seed(8), "cuda")
    one = torch.cat([r.take(1) for _ in range(n)])
    run = RowRandom(torch.Generator("cuda").manual_seed(8), "cuda").take(n)
    g = torch.Generator("cuda").manual_seed(8)
    plain = torch.cat([torch.rand(1, generator=g, device="cuda", dtype=torch.float64) for _ in range(n)])
    assert torch.equal(one, run) and not torch.equal(one, plain)


def test_captured_prefill_equals_eager_and_touches_only_its_row(oracle_dirs):
    """CudaEngine.prefill (the prompt padded to `prefill_len`: 16, 32, 64, then multiples of 128; one graph
    replay in the scratch row, then copied to its row) gives the eager prefill's logits and keys/values at every
    padding bucket and its edges; capturing it writes no other row. A prompt padded to the whole context (400
    tokens -> 512 = max_seq_len) prefills eagerly: the captured copy's source would be all of its target."""
    from bitnetlm.loading import load_model
    from bitnetlm.runtime.cuda.engine import CudaEngine, EngineConfig
    from bitnetlm.runtime.cuda.graphs import prefill_len

    ours, _ = oracle_dirs["packed-autobitlinear"]
    model = load_model(ours, device="cuda", dtype=torch.float32).eval()
    eng = CudaEngine.from_model(
        model, EngineConfig(max_batch=3, max_seq_len=512, dtype=torch.float32), device="cuda"
    )
    for c in eng.k_cache + eng.v_cache:
        c[0].fill_(7.0)  # row 0 holds another sequence
    lengths = (1, 16, 17, 37, 64, 65, 130, 400)
    assert [prefill_len(t) for t in lengths] == [16, 16, 32, 64, 64, 128, 256, 512]
    for t in lengths:
        ids = torch.randint(3, 500, (t,), generator=torch.Generator().manual_seed(t)).tolist()
        with torch.no_grad():
            got = eng.prefill(ids, 2)  # captures the padded length's graph, then replays it
            got2 = eng.prefill(ids, 2)  # a replay only
            zero = torch.zeros((1,), dtype=torch.int32, device="cuda")
            want = eng.forward(torch.tensor([ids], device="cuda"), zero, row0=1)[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda e, t=t: f"{t} tokens: {e}")
        assert torch.equal(got, got2)
        for c in eng.k_cache + eng.v_cache:
            torch.testing.assert_close(c[2, :, :t], c[1, :, :t], rtol=1e-5, atol=1e-5)
            assert bool((c[0] == 7.0).all())
