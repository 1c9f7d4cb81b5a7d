"""Greedy generation through the CUDA-graph engine equals the CPU reference path token for token (GPU only)."""

from __future__ import annotations

import pytest
import torch
from oracle import greedy_with_cache

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("variant", ["packed-autobitlinear", "online", "1bitllm", "llama"])
def test_greedy_64_tokens_equal_cpu_reference(oracle_dirs, variant):
    from bitnetlm.engine_cuda import CudaEngine, EngineConfig
    from bitnetlm.loading import load_model

    ours, _ = oracle_dirs[variant]
    model = load_model(ours, device="cpu", backend="reference").eval()
    prompt = torch.randint(3, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    ref = greedy_with_cache(model, prompt, 64)
    weights = "dense" if model.mode == "fp" else "ternary"
    eng = CudaEngine.from_model(
        model, EngineConfig(max_batch=2, max_seq_len=80, dtype=torch.float32, weights=weights), device="cuda"
    )
    got = eng.generate(prompt, 64).cpu()
    assert torch.equal(got, ref), (got != ref).nonzero()[:5]
