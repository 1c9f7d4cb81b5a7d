"""generate / stream_generate / batch_generate on a tiny random BitNet model with the real LLaMA-3 tokenizer."""

from __future__ import annotations

import pytest
import torch
from assets import asset

import bitnetlm
from bitnetlm.generate import SamplingParams, Tokenizer, batch_generate, generate, stream_generate
from bitnetlm.kernels import prepare
from bitnetlm.models import ModelConfig, build_model
from bitnetlm.quant import to_inference_

PROMPTS = [
    "The capital of France is",
    "Hi",
    "Once upon a time, in a land far away, there lived a llama 🦙 who",
]


def tiny_llama3_bitnet(seed: int = 0, max_pos: int = 128, backend: str = "reference"):
    """2-layer BitNet with the full LLaMA-3 vocabulary, random weights with a realistic spread."""
    cfg = ModelConfig(
        arch="bitnet", vocab_size=128256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_pos,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    m = build_model(cfg, "train")
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    # the reference kernels by default: this file tests generation logic, not a kernel backend
    return prepare(to_inference_(m).eval(), "cpu", backend)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(asset("llama3-tokenizer"))


@pytest.fixture(scope="module")
def model():
    return tiny_llama3_bitnet()


def _greedy_no_cache(model, ids, n):
    """Oracle: full causal forward over the whole sequence at every step (no KV cache, no padding)."""
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids], device=model.embed_tokens.weight.device))
            t = int(logits[0, -1].argmax())
            out.append(t)
            ids.append(t)
    return out


def test_greedy_equals_no_cache_oracle(model, tok):
    ids = tok.encode(PROMPTS[0])
    r = generate(model, tok, PROMPTS[0], max_tokens=12, temperature=0, ignore_eos=True)
    assert r.tokens == _greedy_no_cache(model, ids, 12)
    assert len(set(r.tokens)) > 3  # the model does not just repeat one token
    assert r.finish_reason == "length" and r.generation_tokens == 12 and r.prompt_tokens == len(ids)
    assert str(r) == tok.decode(r.tokens, skip_special_tokens=True)


def test_batched_equals_individual(model, tok):
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    seeded = [
        SamplingParams(max_tokens=8, temperature=1.0, top_k=50, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.7, top_p=0.9, seed=8, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.3, ignore_eos=True),
    ]
    for params in ([greedy] * 3, seeded):
        batch = batch_generate(model, tok, PROMPTS, params)
        for prompt, p, b in zip(PROMPTS, params, batch, strict=True):
            alone = generate(model, tok, prompt, p)
            assert b.tokens == alone.tokens
            assert str(b) == str(alone)
            assert b.prompt_tokens == len(tok.encode(prompt))
            torch.testing.assert_close(
                torch.tensor(b.logprobs), torch.tensor(alone.logprobs), atol=1e-4, rtol=0
            )
    assert len(batch[1].tokens) == 6  # per-row max_tokens


def test_stream_chunks(model, tok):
    chunks = list(stream_generate(model, tok, PROMPTS[1], max_tokens=8, temperature=0, ignore_eos=True))
    full = generate(model, tok, PROMPTS[1], max_tokens=8, temperature=0, ignore_eos=True)
    assert [c.token for c in chunks] == full.tokens
    assert "".join(c.text for c in chunks) == str(full)
    assert [c.finish_reason for c in chunks] == [None] * 7 + ["length"]
    assert [c.generation_tokens for c in chunks] == list(range(1, 9))
    assert all(c.prompt_tokens == 2 and c.ttft_s > 0 and c.prompt_tps > 0 for c in chunks)
    assert chunks[-1].generation_tps > 0
    assert all(c.logprob <= 0 for c in chunks)


def test_stop_string_spanning_tokens(model, tok):
    base = list(stream_generate(model, tok, PROMPTS[0], max_tokens=16, temperature=0, ignore_eos=True))
    full = "".join(c.text for c in base)
    texts = [c.text for c in base]
    # a stop string made of the end of one token's text and the start of the next one's
    i = next(
        i
        for i in range(2, len(texts) - 1)
        if texts[i].strip() and texts[i + 1].strip() and "\ufffd" not in full
    )
    stop = texts[i][-2:] + texts[i + 1][:2]
    assert len(tok.encode(stop, add_special_tokens=False)) >= 1
    chunks = list(
        stream_generate(model, tok, PROMPTS[0], max_tokens=16, temperature=0, ignore_eos=True, stop=[stop])
    )
    out = "".join(c.text for c in chunks)
    assert out == full[: full.find(stop)]
    assert stop not in out
    assert chunks[-1].finish_reason == "stop"
    assert len(chunks) <= i + 2  # stopped as soon as the stop string was complete
    # a stop string that never occurs changes nothing
    r = generate(model, tok, PROMPTS[0], max_tokens=16, temperature=0, ignore_eos=True, stop=["\u2603never"])
    assert str(r) == full and r.finish_reason == "length"


def test_stop_token_ids_and_eos(model, tok):
    ref = generate(model, tok, PROMPTS[2], max_tokens=12, temperature=0, ignore_eos=True)
    target = ref.tokens[5]
    k = ref.tokens.index(target)
    r = generate(
        model, tok, PROMPTS[2], max_tokens=12, temperature=0, stop_token_ids=[target], ignore_eos=True
    )
    assert r.tokens == ref.tokens[: k + 1] and r.finish_reason == "stop"
    assert str(r) == tok.decode(ref.tokens[:k], skip_special_tokens=True)
    # the tokenizer's <|eot_id|> stops generation and is not shown
    eot = tok.token_to_id("<|eot_id|>")
    r = generate(model, tok, PROMPTS[2], max_tokens=12, temperature=0, logit_bias={eot: 1e4})
    assert r.tokens == [eot] and str(r) == "" and r.finish_reason == "stop"


def test_context_limits(model, tok):
    ctx = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="context holds 128"):
        generate(model, tok, list(range(1000, 1000 + ctx)), max_tokens=4)
    # generation is cut at the end of the context: finish_reason "length"
    r = generate(model, tok, list(range(1000, 1000 + ctx - 3)), max_tokens=50, temperature=0, ignore_eos=True)
    assert r.generation_tokens == 3 and r.finish_reason == "length"
    r = generate(model, tok, "Hi", max_tokens=50, ctx_size=8, temperature=0, ignore_eos=True)
    assert r.generation_tokens == 6
    r = generate(model, tok, "Hi", max_tokens=0)
    assert str(r) == "" and r.tokens == []
    with pytest.raises(TypeError, match="unknown generation parameter"):
        generate(model, tok, "Hi", max_tokenz=3)


def test_chat_messages_and_lazy_exports(model, tok):
    msgs = [{"role": "user", "content": "Hello"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    r = bitnetlm.generate(model, tok, msgs, max_tokens=3, temperature=0, ignore_eos=True)
    assert r.prompt_tokens == len(ids)
    assert r.tokens == generate(model, tok, ids, max_tokens=3, temperature=0, ignore_eos=True).tokens
    sys_r = generate(model, tok, "Hello", system="Be brief.", max_tokens=2, temperature=0, ignore_eos=True)
    sys_ids = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}], tokenize=True
    )
    assert sys_r.prompt_tokens == len(sys_ids)
    assert next(iter(bitnetlm.stream_generate(model, tok, "Hi", max_tokens=1))).generation_tokens == 1
    assert len(bitnetlm.batch_generate(model, tok, ["a", "b"], max_tokens=1)) == 2


@pytest.mark.gpu
def test_cuda_batched_equals_individual_and_oracle(tok):
    model = tiny_llama3_bitnet().to("cuda")
    prepare(model, "cuda", "reference")
    ids = tok.encode(PROMPTS[0])
    r = generate(model, tok, PROMPTS[0], max_tokens=8, temperature=0, ignore_eos=True)
    assert r.tokens == _greedy_no_cache(model, ids, 8)
    params = [
        SamplingParams(max_tokens=8, temperature=1.0, top_k=50, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, min_p=0.05, seed=8, ignore_eos=True),
    ]
    batch = batch_generate(model, tok, PROMPTS, params)
    for prompt, p, b in zip(PROMPTS, params, batch, strict=True):
        assert b.tokens == generate(model, tok, prompt, p).tokens


def test_generation_runs_torch_on_one_thread_beside_the_c_kernels(model, tok):
    """With the C kernels torch's own ops run on one thread while a generation runs (libgomp's workers spin
    after each parallel op and take the kernel threads' cores), and the caller's count comes back after it;
    the reference backend's generation leaves torch's threads alone."""
    from bitnetlm.kernels import uses_c_kernels

    c_model = tiny_llama3_bitnet(backend="cpu")
    assert uses_c_kernels(c_model) and not uses_c_kernels(model)
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for m, inside in ((c_model, 1), (model, 2)):
            seen = [
                torch.get_num_threads() for _ in stream_generate(m, tok, "Hi", max_tokens=3, ignore_eos=True)
            ]
            assert seen == [inside] * 3 and torch.get_num_threads() == 2
        it = stream_generate(c_model, tok, "Hi", max_tokens=8, ignore_eos=True)
        next(it)
        it.close()  # a stream the caller abandons restores the count too
        assert torch.get_num_threads() == 2
        # the same greedy tokens as the reference kernels (bit-identical integer products)
        ref = generate(model, tok, PROMPTS[0], max_tokens=8, temperature=0, ignore_eos=True)
        assert (
            generate(c_model, tok, PROMPTS[0], max_tokens=8, temperature=0, ignore_eos=True).tokens
            == ref.tokens
        )
    finally:
        torch.set_num_threads(n)


def test_engine_config_follows_the_model(tiny_model):
    """The CUDA-graph engine's options come from the model and its RuntimeConfig: its activation dtype,
    kv_cache_dtype and head_dtype (on CUDA only "int8" changes the engine's head)."""
    from bitnetlm.runtime.config import RuntimeConfig
    from bitnetlm.runtime.cuda.runner import engine_config

    ec = engine_config(tiny_model, RuntimeConfig(), 3, 64)
    assert (ec.max_batch, ec.max_seq_len, ec.dtype, ec.head, ec.kv_dtype) == (
        3,
        64,
        torch.float32,
        "fp",
        None,
    )
    ec = engine_config(tiny_model, RuntimeConfig(head_dtype="int8", kv_cache_dtype="fp8"), 1, 16, "dense")
    assert (ec.head, ec.kv_dtype, ec.weights) == ("int8", torch.float8_e4m3fn, "dense")
    assert engine_config(tiny_model, RuntimeConfig(head_dtype="bf16"), 1, 16).head == "fp"
