"""The float8 (e4m3) KV cache: the reference forward stores exactly k.to(float8) and v.to(float8) and attends over
them; the CUDA engine (Triton kernels, captured prefill, graph generate) stores the same bytes and gives the
reference's greedy tokens. CLI flag --kv-cache-dtype. (The attention kernel over a float8 cache: test_kernels_triton.py.)"""

from __future__ import annotations

import copy

import pytest
import torch
from triton_interp import DEV, triton_modules

FP8 = torch.float8_e4m3fn


def _prefill(model, tok, dtype):
    model = copy.deepcopy(model)
    cache = model.new_cache(1, 16, dtype=dtype)
    with torch.no_grad():
        logits = model(tok, positions=torch.arange(tok.shape[1])[None], cache=cache)
    return logits, cache


def test_reference_cache_holds_the_float8_of_what_it_would_store(tiny_model):
    tok = torch.randint(0, 512, (1, 7), generator=torch.Generator().manual_seed(0))
    ref_logits, ref = _prefill(tiny_model, tok, None)
    logits, c8 = _prefill(tiny_model, tok, FP8)
    assert c8.k[0].dtype == FP8 and c8.nbytes() * 4 == ref.nbytes()  # float32 model: a quarter of the bytes
    # layer 0's keys and values come from the embeddings alone: the float8 of the float32 cache's, bit for bit
    # (later layers' differ: their inputs went through attention over the rounded ones)
    for a, b in ((c8.k[0], ref.k[0]), (c8.v[0], ref.v[0])):
        assert torch.equal(a[:, :, :7].view(torch.uint8), b[:, :, :7].to(FP8).view(torch.uint8))
    # the first layer's queries see its rounded keys only: same shape of result, not the same numbers
    assert logits.shape == ref_logits.shape and not torch.equal(logits, ref_logits)
    assert torch.allclose(logits, ref_logits, atol=0.5, rtol=0.1)


def test_cli_kv_cache_dtype_values():
    from bitnetlm.runtime.config import kv_cache_dtype as parse_kv_cache_dtype

    assert parse_kv_cache_dtype("auto") is None and parse_kv_cache_dtype(None) is None
    assert parse_kv_cache_dtype("fp8") is FP8 and parse_kv_cache_dtype("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="--kv-cache-dtype 'int4': expected auto, bf16 or fp8"):
        parse_kv_cache_dtype("int4")


@pytest.mark.gpu  # Triton's interpreter rounds float32 -> float8 wrongly when the mantissa carries (0.489 -> 0.25)
def test_engine_float8_cache_equals_reference_bytes(tiny_model):
    """CudaEngine with kv_dtype float8 (float32 activations): layer 0's cache is the float8 of the float32
    engine's, bit for bit, at prefill (rope_cache) and at a decode step (the fused q|k|v + RoPE kernel); every
    layer's cache and the logits agree with the reference forward over a float8 KVCache."""
    triton_modules("attention", "rope", "decode")
    from bitnetlm.runtime.cuda.engine import CudaEngine, EngineConfig

    model = copy.deepcopy(tiny_model).to(DEV)
    tok = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(1)).to(DEV)
    engines = [
        CudaEngine.from_model(model, EngineConfig(max_seq_len=16, dtype=torch.float32, kv_dtype=kv), DEV)
        for kv in (None, FP8)
    ]
    pos = torch.zeros(1, dtype=torch.int32, device=DEV)
    nxt = torch.tensor([[17]], device=DEV)
    with torch.no_grad():
        for e in engines:
            e.forward(tok, pos)  # prefill: positions 0..5
            last = e.forward(nxt, torch.full((1,), 6, dtype=torch.int32, device=DEV))  # one decode step
    f32, f8 = engines
    assert f8.k_cache[0].dtype == FP8
    for a, b in ((f8.k_cache[0], f32.k_cache[0]), (f8.v_cache[0], f32.v_cache[0])):
        assert torch.equal(a[:1, :, :7].view(torch.uint8), b[:1, :, :7].to(FP8).view(torch.uint8))
    ref = copy.deepcopy(tiny_model)
    cache = ref.new_cache(1, 16, dtype=FP8)
    with torch.no_grad():
        ref(tok.cpu(), positions=torch.arange(6)[None], cache=cache)
        ref_last = ref(nxt.cpu(), positions=torch.tensor([[6]]), cache=cache)[:, -1]
    for a, b in zip(f8.k_cache + f8.v_cache, cache.k + cache.v):
        assert torch.allclose(a[:1, :, :7].float().cpu(), b[:, :, :7].float(), atol=0.07, rtol=0.07)
    assert torch.allclose(last.cpu(), ref_last, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["packed-autobitlinear", "1bitllm"])
def test_graph_generate_float8_cache_equals_reference(oracle_dirs, variant):
    """generate / batch_generate on CUDA with kv_cache_dtype="fp8" (the CUDA-graph engine, captured prefill) give
    the greedy tokens of the CPU reference forward over a float8 KVCache."""
    from oracle import greedy_with_cache
    from serve_parts import tiny_tokenizer

    from bitnetlm.generate import SamplingParams, batch_generate, generate
    from bitnetlm.loading import load_model
    from bitnetlm.runtime import config_for, kept_runner

    ours, _ = oracle_dirs[variant]
    cpu = load_model(ours, device="cpu", backend="reference").eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 11, 8)]
    ref = [greedy_with_cache(cpu, torch.tensor([p]), 24, cache_dtype=FP8)[0].tolist() for p in prompts]
    model = load_model(ours, device="cuda", dtype=torch.float32, kv_cache_dtype="fp8").eval()
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    tok = tiny_tokenizer()
    assert [generate(model, tok, p, sp).tokens for p in prompts] == ref
    eng = kept_runner(model).eng
    assert eng is not None and eng.k_cache[0].dtype == FP8
    assert [r.tokens for r in batch_generate(model, tok, prompts, sp)] == ref
    auto = config_for(model).replace(kv_cache_dtype="auto")  # a different cache type rebuilds the engine
    generate(model, tok, prompts[0], sp, runtime=auto)
    assert kept_runner(model).eng.k_cache[0].dtype == torch.float32
