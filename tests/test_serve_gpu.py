"""The serving engine on a CUDA GPU against offline generate on the same GPU (32 concurrent requests).

On CPU the server is token-for-token equal to offline generate (tests/test_serve.py). On CUDA the model's
kernels are not batch-invariant: a different batch shape (rows, cache length) changes float rounding, and the
per-token int8 activation quantization can turn that into a visibly different logit. Measured on an H100
(2026-11-26, reference backend): offline `generate` and offline `batch_generate` disagree on 2 of 32 greedy
prompts; the server disagrees with `generate` on 1 of 32. So this test demands exact equality for nearly all
requests (a scheduling bug such as a wrong position or a stale cache row breaks every request, not one).
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("path", ["cuda-graph", "pipelined", "eager"])
def test_engine_on_cuda_matches_offline_generate(path):
    """The server on its CUDA runner (default; prompts prefilled in 16-token chunks, so most continue at a
    position > 0) and on the eager forward, each against offline generate on the same path. The requests mix
    greedy rows, seeded sampled rows with and without a top-k (and log-probabilities), and rows with a repetition
    penalty (the host sampler's beside the captured one's, in the same steps: those steps are not pipelined).
    "pipelined": no penalties, so every decode step is queued before the last one's tokens are read, a third of
    the requests end at a stop token, one step after their last step was queued, a sixth at their first token
    (sampled on the device and decoded before it is read) and one wants a single token."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")  # deselected in CI by -m "not gpu"
    from serve_parts import tiny_model_and_tokenizer

    from bitnetlm.generate import SamplingParams, generate
    from bitnetlm.runtime.config import RuntimeConfig
    from bitnetlm.runtime.cuda.runner import CudaRunner
    from bitnetlm.serve.engine import Chunk, Engine, EngineConfig, Finished, GenerationRequest

    model, tok = tiny_model_and_tokenizer(max_len=256, layers=4, hidden=256)
    model = model.to("cuda")
    rng = random.Random(0)
    words = (
        "the quick brown fox jumps over lazy dog truth universally acknowledged single man fortune".split()
    )
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 40))) for _ in range(32)]
    kinds = [
        dict(temperature=0),
        dict(temperature=0.8),
        dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, logprobs=True, top_logprobs=2),
        dict(temperature=0.7, repetition_penalty=1.3),
    ]
    stops = path == "pipelined"
    if stops:
        kinds = kinds[:3]
    params = [
        SamplingParams(max_tokens=rng.randint(8, 40), ignore_eos=True, seed=i, **kinds[i % len(kinds)])
        for i in range(32)
    ]
    eager = path == "eager"
    res = [generate(model, tok, p, sp, enforce_eager=eager) for p, sp in zip(prompts, params)]
    refs = [r.tokens for r in res]
    if stops:  # every third request stops at the token it samples halfway, every sixth at its first token
        for i in range(0, 32, 3):  # (a prompt's first token is decoded before it is read, when pipelining)
            params[i].stop_token_ids = [refs[i][len(refs[i]) // 2]]
        for i in range(1, 32, 6):
            params[i].stop_token_ids = [refs[i][0]]
        params[2].max_tokens = 1  # (and one request wants its first token only)
        for i in [*range(0, 32, 3), *range(1, 32, 6), 2]:
            res[i] = generate(model, tok, prompts[i], params[i], enforce_eager=eager)
            refs[i] = res[i].tokens
    eng = Engine(
        model, tok, EngineConfig(prefill_chunk=16), runtime=RuntimeConfig(max_batch=16, enforce_eager=eager)
    )
    assert isinstance(eng.runner, CudaRunner) != eager
    out, lps = {i: [] for i in range(32)}, {i: [] for i in range(32)}
    done = threading.Semaphore(0)
    for i, (p, sp) in enumerate(zip(prompts, params)):

        def sink(e, i=i):
            if isinstance(e, Chunk):
                out[i] += e.token_ids
                lps[i] += e.logprobs or []
            elif isinstance(e, Finished):
                done.release()

        eng.submit(GenerationRequest(tok.encode(p), sp), sink)
    for _ in range(32):
        assert done.acquire(timeout=300)
    eng.shutdown()
    if (
        not eager
    ):  # the captured sampler ran, for several kinds of rows, each storing its outputs into its ring
        assert eng.runner.sampler is not None and len(eng.runner.sampler.samplers) > 1
        assert all(gs.exports for gs in eng.runner.sampler.samplers.values())
    if stops:  # steps queued before the last one's tokens were read
        assert eng.core.overlapped > 0
    if stops:
        assert sum(len(refs[i]) < params[i].max_tokens for i in range(0, 32, 3)) >= 8
    bad = [i for i in range(32) if out[i] != refs[i]]
    for i in bad:
        j = next(
            (k for k, (a, b) in enumerate(zip(out[i], refs[i])) if a != b), min(len(out[i]), len(refs[i]))
        )
        print(
            f"request {i} (temperature {params[i].temperature}): first difference at token {j} of {len(refs[i])}"
        )
    assert all(len(out[i]) == len(refs[i]) for i in range(32))
    # the log-probabilities (those rows' entries: a stop token has none) are offline generate's for nearly all
    # tokens (rounding, as above: one of 26 entries was 0.064 off on an H200), and each is at most its row's
    # best top entry (which come in order). A misread buffer or slot would be off at most of them.
    asked = [i for i in range(32) if params[i].logprobs and i not in bad]
    assert asked
    off = n = 0
    for i in asked:
        got = [e["logprob"] for e in lps[i]]
        assert len(refs[i]) - 1 <= len(got) <= len(refs[i])
        off += sum(abs(a - b) > 0.01 for a, b in zip(got, res[i].logprobs))
        n += len(got)
        for e in lps[i]:
            top = [v for _, v in e["top"]]
            assert top == sorted(top, reverse=True) and e["logprob"] <= top[0] + 1e-5, (i, e)
    assert off <= 0.1 * n, f"{off} of {n} log-probabilities differ from offline generate's by more than 0.01"
    assert len(bad) <= 3, f"{len(bad)} of 32 requests differ from offline generate"


def test_graph_rows_share_a_prompt_between_choices():
    """n = 2 greedy choices of one request on the CUDA-graph rows: the second row gets the first's prefilled
    keys and values by copy, and both decode the tokens of offline generate."""
    from serve_parts import tiny_model_and_tokenizer

    from bitnetlm.generate import SamplingParams, generate
    from bitnetlm.runtime.config import RuntimeConfig
    from bitnetlm.runtime.cuda.runner import CudaRunner
    from bitnetlm.serve.engine import Chunk, Engine, EngineConfig, Finished, GenerationRequest

    model, tok = tiny_model_and_tokenizer(max_len=256, layers=2, hidden=64)
    model = model.to("cuda")
    prompt = "It is a truth universally acknowledged, that a single man"
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ref = generate(model, tok, prompt, sp).tokens
    eng = Engine(model, tok, EngineConfig(prefill_chunk=8), runtime=RuntimeConfig(max_batch=4))
    assert isinstance(eng.runner, CudaRunner)
    out, done = {0: [], 1: []}, threading.Event()

    def sink(e):
        if isinstance(e, Chunk):
            out[e.index] += e.token_ids
        elif isinstance(e, Finished):
            done.set()

    eng.submit(GenerationRequest(tok.encode(prompt), sp, n=2), sink)
    assert done.wait(timeout=300)
    eng.shutdown()
    assert out[0] == ref and out[1] == ref
