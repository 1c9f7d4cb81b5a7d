"""Greedy generation through the CUDA-graph engine equals the CPU reference path token for token (GPU only)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _reference_greedy(model, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """The model's own forward on the CPU (reference kernels) with its KV cache, argmax each step."""
    b, t0 = prompt.shape
    cache = model.new_cache(b, t0 + n)
    with torch.no_grad():
        logits = model(prompt, cache=cache, last_only=True)[:, -1]
        out = [logits.argmax(-1)]
        for i in range(n - 1):
            pos = torch.full((b, 1), t0 + i, dtype=torch.long)
            logits = model(out[-1][:, None], positions=pos, cache=cache)[:, -1]
            out.append(logits.argmax(-1))
    return torch.stack(out, 1)


@pytest.mark.parametrize("variant", ["packed-autobitlinear", "online", "1bitllm", "llama"])
def test_greedy_64_tokens_equal_cpu_reference(oracle_dirs, variant):
    from bitnetlm.engine_cuda import CudaEngine, EngineConfig
    from bitnetlm.loading import load_model

    ours, _ = oracle_dirs[variant]
    model = load_model(ours, device="cpu", backend="reference").eval()
    prompt = torch.randint(3, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    ref = _reference_greedy(model, prompt, 64)
    weights = "dense" if model.mode == "fp" else "ternary"
    eng = CudaEngine.from_model(
        model, EngineConfig(max_batch=2, max_seq_len=80, dtype=torch.float32, weights=weights), device="cuda"
    )
    got = eng.generate(prompt, 64).cpu()
    assert torch.equal(got, ref), (got != ref).nonzero()[:5]
