"""The serving engine on a CUDA GPU: 32 concurrent greedy/seeded requests equal offline generate on the GPU."""

from __future__ import annotations

import random
import threading

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_engine_on_cuda_matches_offline_generate():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")  # deselected in CI by -m "not gpu"
    from bitnetlm.generate import SamplingParams, generate
    from bitnetlm.serve.engine import Chunk, Engine, EngineConfig, Finished, GenerationRequest
    from bitnetlm.serve.testing import tiny_model_and_tokenizer

    model, tok = tiny_model_and_tokenizer(max_len=256, layers=4, hidden=256)
    model = model.to("cuda")
    rng = random.Random(0)
    words = (
        "the quick brown fox jumps over lazy dog truth universally acknowledged single man fortune".split()
    )
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 40))) for _ in range(32)]
    params = [
        SamplingParams(
            max_tokens=rng.randint(8, 40), ignore_eos=True, temperature=0 if i % 2 else 0.8, seed=i
        )
        for i in range(32)
    ]
    refs = [generate(model, tok, p, sp).tokens for p, sp in zip(prompts, params)]
    eng = Engine(model, tok, EngineConfig(max_batch=16))
    out = {i: [] for i in range(32)}
    done = threading.Semaphore(0)
    for i, (p, sp) in enumerate(zip(prompts, params)):

        def sink(e, i=i):
            if isinstance(e, Chunk):
                out[i] += e.token_ids
            elif isinstance(e, Finished):
                done.release()

        eng.submit(GenerationRequest(tok.encode(p), sp), sink)
    for _ in range(32):
        assert done.acquire(timeout=300)
    eng.shutdown()
    assert [out[i] for i in range(32)] == refs
