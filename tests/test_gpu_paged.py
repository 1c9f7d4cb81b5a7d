"""The CUDA runner over a paged KV cache (`--kv-tokens` on a GPU) gives what the static CUDA runner gives: the
same logits through prefills, captured decode steps, a verified draft rolled back, a shared prefix and a context
shift, and the same greedy tokens through the engine with prompt prefixes reused, drafts, context shifts and
preemption (GPU only; the kernels' and the engine forward's paged paths are checked on the CPU by
test_triton_kvtable.py and test_engine_paged.py)."""

from __future__ import annotations

import pytest
import torch
from serve_parts import tiny_model_and_tokenizer
from test_paged import VOCAB, _prompt, _script, _serve_all

from bitnetlm.kernels import prepare
from bitnetlm.runtime import make_runner
from bitnetlm.runtime.blocks import OutOfBlocks
from bitnetlm.runtime.config import RuntimeConfig

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_model():
    model, tok = tiny_model_and_tokenizer(max_len=256, backend="reference")
    return prepare(model, "cuda").eval(), tok


def _pair(model, rows=3, ctx=96, bs=4, tokens=256, **kw):
    from bitnetlm.runtime.cuda.paged_runner import PagedCudaRunner
    from bitnetlm.runtime.cuda.runner import CudaRunner

    static = make_runner(model, RuntimeConfig(device="cuda", **kw), rows, ctx)
    paged = make_runner(
        model, RuntimeConfig(device="cuda", kv_tokens=tokens, kv_block_size=bs, **kw), rows, ctx
    )
    assert type(static) is CudaRunner and isinstance(paged, PagedCudaRunner)
    return static, paged


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_paged_cuda_runner_equals_static(cuda_model, kv):
    static, paged = _pair(cuda_model[0], kv_cache_dtype=kv)
    prompts = [_prompt(n, i) for i, n in enumerate((18, 11, 6))]
    a, b = _script(static, prompts), _script(paged, prompts)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    for r in range(3):
        paged.reset(r)
    assert paged.pool.in_use() == 0


def test_paged_cuda_out_of_blocks_changes_nothing(cuda_model):
    static, paged = _pair(cuda_model[0], rows=2, tokens=16)  # 4 blocks of 4
    p = _prompt(10, 5)
    paged.prefill(0, p)
    static.prefill(0, p)
    with pytest.raises(OutOfBlocks):
        paged.prefill(1, _prompt(8, 6))
    assert paged.blocks[1] == [] and paged.pool.available() == 1
    assert torch.equal(paged.decode([0], [3], [10]), static.decode([0], [3], [10]))


@pytest.mark.parametrize("case", ["reuse", "speculative", "context_shift", "preempt"])
def test_paged_cuda_engine_equals_static(cuda_model, case):
    """32 requests sharing a system prompt (reuse), prompt-lookup drafts, context shifts at a 48-position window,
    and a pool of 20 blocks for 8 rows (admission waits for blocks; a step short of them preempts): the static
    runner's greedy tokens."""
    from bitnetlm.engine.scheduler import ContextShift
    from bitnetlm.engine.speculative import SpeculativeConfig

    model = cuda_model[0]
    system = [int(t) % VOCAB for t in _prompt(40, 9)]
    prompts = [system + [int(t) % VOCAB for t in _prompt(3 + i % 5, 100 + i)] for i in range(32)]
    opts, n, tokens = {}, 6, 512
    if case == "speculative":
        opts, n = dict(speculative=SpeculativeConfig(4, lookup=3)), 24
    elif case == "context_shift":
        opts, n = dict(context=48, context_shift=ContextShift(4)), 70
    elif case == "preempt":
        tokens = 160
    static, paged = _pair(model, rows=8, ctx=128, bs=8, tokens=tokens)
    want, _, _ = _serve_all(cuda_model, static, prompts, True, n, **opts)
    got, counters, _ = _serve_all(cuda_model, paged, prompts, True, n, **opts)
    assert got == want and paged.pool.in_use() == 0
    assert counters["prefix_cache_hits_total"] > 0
