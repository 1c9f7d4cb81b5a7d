"""Whole models on the C kernels: greedy generation equals the reference backend; compact bf16/int8 heads."""

from __future__ import annotations

import pytest
import torch
from oracle import greedy_with_cache

from bitnetlm.kernels.cpu.head import CompactHead, quantize_rows_int8
from bitnetlm.loading import load_model
from bitnetlm.runtime.cpu import set_head_dtype


@pytest.mark.parametrize("variant", ["packed-autobitlinear", "packed-bitlinear", "1bitllm"])
def test_greedy_equals_reference_backend(oracle_dirs, variant):
    ours, _ = oracle_dirs[variant]
    ref = load_model(ours, backend="reference").eval()
    fast = load_model(ours, backend="cpu").eval()
    layouts = {m.layout.value for m in fast.modules() if hasattr(m, "layout")}
    assert layouts == {"cpu-2bit-v2"}
    prompt = torch.randint(3, ref.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    # logits of the prompt: bit-identical (same float32 operations on the same exact integer products)
    with torch.inference_mode():
        assert torch.equal(fast(prompt), ref(prompt))
    assert torch.equal(greedy_with_cache(fast, prompt, 40), greedy_with_cache(ref, prompt, 40))


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_compact_head_matches_its_dequantized_weights(oracle_dirs, dtype):
    ours, _ = oracle_dirs["packed-autobitlinear"]  # tied embedding
    model = load_model(ours, backend="cpu").eval()
    w = model.embed_tokens.weight.detach().clone()
    if dtype == "bf16":
        wd = w.bfloat16().float()
    else:
        q, s = quantize_rows_int8(w)
        wd = q.float() * s[:, None]
        assert (wd - w).abs().max() <= (w.abs().amax(1) / 127).max() / 2 + 1e-6  # half a step per row
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        model.embed_tokens.weight.copy_(wd)
        want = model(ids)
        set_head_dtype(model, dtype)
        assert isinstance(model.lm_head, CompactHead) and model.embed_tokens.head is model.lm_head
        assert sum(p.numel() for p in model.parameters()) < w.numel()  # one copy of the table only
        got = model(ids)
    # int8: the head's activations go through int16 (<= 1.5e-5 of max|h| per element)
    tol = 1e-4 if dtype == "bf16" else 3e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_compact_head_untied_and_torch_fallback():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(300, 64, generator=gen)
    x = torch.randn(3, 64, generator=gen)
    for dt in ("bf16", "int8"):
        h = CompactHead(w, dt)
        fast = h(x)
        h.weight = h.weight.clone()
        from bitnetlm.kernels import cpu

        # the torch fallback (used off-CPU or without the C library) computes the same thing
        ref = torch.nn.functional.linear(x, h.weight.float()) * (1 if h.scale is None else h.scale)
        tol = 1e-4 if dt == "bf16" else 3e-3  # int8 path: int16 activations
        torch.testing.assert_close(fast, ref, rtol=tol, atol=tol)
        e = h.embed(torch.tensor([[0, 299]]))
        assert e.shape == (1, 2, 64) and e.dtype == torch.float32
        assert cpu.available()
    with pytest.raises(ValueError, match="head dtype"):
        CompactHead(w, "fp8")
