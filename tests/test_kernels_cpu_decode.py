"""Fused CPU decode / prefill step (kernels.cpu.decode, run by runtime.cpu): same logits as the unfused C-backend
layers, same greedy tokens as the reference backend, and the torch layers whenever a step does not qualify."""

from __future__ import annotations

import pytest
import torch
from oracle import greedy_with_cache, random_model

from bitnetlm.kernels import cpu, prepare
from bitnetlm.loading import load_model
from bitnetlm.quant import to_inference_
from bitnetlm.runtime.config import RuntimeConfig
from bitnetlm.runtime.cpu import CpuRunner, fused_forward, fused_step, why_not

# The fused step sums RMSNorm means and attention dot products / softmax in another order than torch, so it
# is not bit-exact; everything else (projections, RoPE, activation, residuals) repeats torch's fp32 ops.
# Measured on the oracle checkpoints: max |difference| <= 2.3e-7 x max |logit| with an fp32 cache; with bf16
# a k/v value at a rounding boundary can round to the neighbouring bf16 number, seen up to 2.4e-6 x max |logit|.
# Bound: 1e-5 x max |logit| (a fault such as a wrong slot, mask, head or norm gives differences of order 1e-2).
REL_BOUND = 1e-5


class Fused:
    """`model` called with its layers in the fused C step (`runtime.cpu.fused_forward`, what CpuRunner runs)."""

    def __init__(self, model):
        step = fused_step(model)
        assert not isinstance(step, str), step
        self.model, self.step, self.config = model, step, model.config

    @property
    def calls(self) -> int:
        return self.step.calls

    def new_cache(self, *args, **kwargs):
        return self.model.new_cache(*args, **kwargs)

    def __call__(self, ids, *args, **kwargs):
        return fused_forward(self.model, self.step, ids, *args, **kwargs)


def greedy_with_runner(runner, prompt, n: int) -> torch.Tensor:
    """Greedy decoding through a runner: prompt [B, T] (one row each, one prefill forward) -> [B, n]."""
    b, t0 = prompt.shape
    logits = runner.prefill_many(list(range(b)), prompt.tolist())
    out = [logits.argmax(-1)]
    for i in range(n - 1):
        logits = runner.decode(list(range(b)), out[-1].tolist(), [t0 + i] * b)
        out.append(logits.argmax(-1))
    return torch.stack(out, 1)


def _fused_vs_unfused(model, batch: int, kv_dtype: torch.dtype, steps: int = 12, ctx: int = 0):
    """Prefill rows with padding, then decode `steps` tokens twice per step: fused into one cache, unfused into
    a copy. Batch 3: rows at different positions, rows 1 and 2 left-padded (masked slots before the query),
    row 2 a padding query every other step. ctx: extra prompt length for every row."""
    fused = Fused(model)
    gen = torch.Generator().manual_seed(7)
    left, lens = torch.tensor([0, 2, 3][:batch]), torch.tensor([9, 5, 7][:batch]) + ctx
    t0 = int(lens.max())
    prompt = torch.randint(3, model.config.vocab_size, (batch, t0), generator=gen)
    pmask = (torch.arange(t0)[None] >= left[:, None]) & (torch.arange(t0)[None] < lens[:, None])
    caches = [model.new_cache(batch, t0 + steps, dtype=kv_dtype) for _ in range(2)]
    worst = 0.0
    with torch.inference_mode():
        # the same (unfused) prefill for both: long fused and unfused prefills may differ by an activation
        # rounding flip (see _prefill_fused_vs_unfused); this test is about the decode steps
        for c in caches:
            model(prompt, cache=c, input_mask=pmask)
        pos, tok = lens.clone(), prompt[:, 0]
        for s in range(steps):
            real = torch.ones(batch, dtype=torch.bool)
            if batch == 3:
                real[2] = s % 2 == 0
            args = dict(positions=pos[:, None], input_mask=real[:, None])
            n = fused.calls
            got = fused(tok[:, None], cache=caches[0], **args)
            assert fused.calls == n + 1  # the fused step ran
            want = model(tok[:, None], cache=caches[1], **args)
            err = (got - want).abs().max().item()
            assert err <= REL_BOUND * want.abs().max().item(), (s, err)
            worst = max(worst, err / want.abs().max().item())
            tok = want[:, -1].argmax(-1)
            pos = pos + real.long()
    _assert_caches_close(caches[0], caches[1], kv_dtype)
    return worst


def _assert_caches_close(c0, c1, kv_dtype):
    # the caches hold the same k, v up to float rounding: in bf16 a value at a rounding boundary may land on
    # the neighbouring bf16 number (one step, 2^-7 relative at most)
    tol = 1e-5 if kv_dtype == torch.float32 else 2**-7
    for a, b in zip(c0.k + c0.v, c1.k + c1.v):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=1e-5)
    assert torch.equal(c0.valid, c1.valid)


@pytest.mark.parametrize("variant", ["packed-autobitlinear", "1bitllm"])  # relu2 GQA / silu MHA
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_logits_match_unfused(oracle_dirs, one_torch_thread, variant, kv_dtype, batch):
    model = load_model(oracle_dirs[variant][0], backend="cpu").eval()
    assert why_not(model) is None
    _fused_vs_unfused(model, batch, kv_dtype)


@pytest.mark.parametrize("heads,kv_heads", [(8, 1), (6, 2)])  # 8 and 3 query heads per KV head
def test_fused_logits_match_unfused_wide_gqa(one_torch_thread, heads, kv_heads):
    """Query-head blocks of 3, 4 and 8 (the oracle checkpoints have 1 and 2): random model of ours."""
    model = random_model(
        hidden=16 * heads, inter=128, num_attention_heads=heads, num_key_value_heads=kv_heads
    )
    model = prepare(to_inference_(model).eval(), backend="cpu")
    _fused_vs_unfused(model, 3, torch.float32, steps=4, ctx=30)
    _fused_vs_unfused(model, 3, torch.bfloat16, steps=4, ctx=30)


@pytest.mark.parametrize("isa", [None, "scalar"])  # AVX2/AVX-512 machines: vector and portable attention
def test_fused_long_context_threaded_attention(oracle_dirs, one_torch_thread, isa):
    """~200 cached positions in 3 rows: enough work for the attention to be shared out over 2 threads."""
    model = load_model(oracle_dirs["packed-autobitlinear"][0], backend="cpu").eval()
    threads = cpu.get_num_threads()
    cpu.set_num_threads(2)
    try:
        with cpu.use_isa(isa):
            _fused_vs_unfused(model, 3, torch.float32, steps=4, ctx=190)
            _fused_vs_unfused(model, 3, torch.bfloat16, steps=4, ctx=190)
    finally:
        cpu.set_num_threads(threads)


@pytest.mark.parametrize("variant", ["packed-autobitlinear", "packed-bitlinear", "1bitllm"])
@pytest.mark.parametrize("kv", [None, torch.bfloat16])
def test_fused_greedy_equals_reference_backend(oracle_dirs, one_torch_thread, variant, kv):
    """Greedy tokens of the fused C steps (the CPU runner) equal the reference backend's, with the model's default
    cache and with kv_cache_dtype="bf16" (`--kv-cache-dtype bf16`: a bf16 cache for both)."""
    ours, _ = oracle_dirs[variant]
    ref = load_model(ours, backend="reference").eval()
    fast = load_model(ours, backend="cpu").eval()
    rt = RuntimeConfig(kv_cache_dtype="bf16" if kv else "auto")
    refs, fasts = CpuRunner(ref, rt, 2, 7 + 40), CpuRunner(fast, rt, 2, 7 + 40)
    assert refs.fused is None and fasts.fused is not None
    assert fasts.cache.k[0].dtype == (kv or torch.float32)
    prompt = torch.randint(3, ref.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(11))
    got = greedy_with_runner(fasts, prompt, 40)
    assert fasts.fused.calls == 40  # the prefill and every step after it
    assert torch.equal(got, greedy_with_runner(refs, prompt, 40))


def test_fused_steps_from_several_threads(oracle_dirs, one_torch_thread):
    """One model decoding from 4 threads at once (each with its own cache, as a server without a batching
    worker would): every thread's tokens equal the same decode run alone."""
    import threading

    ours, _ = oracle_dirs["packed-autobitlinear"]
    fast = load_model(ours, backend="cpu").eval()
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(3, fast.config.vocab_size, (1, 5 + i), generator=gen) for i in range(4)]
    rt = RuntimeConfig()
    want = [greedy_with_runner(CpuRunner(fast, rt, 1, 40), p, 24) for p in prompts]
    got: list = [None] * 4
    start = threading.Barrier(4)

    def run(i):
        start.wait()
        got[i] = greedy_with_runner(CpuRunner(fast, rt, 1, 40), prompts[i], 24)

    for _ in range(3):
        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for i in range(4):
            assert torch.equal(got[i], want[i]), i


def _prefill_fused_vs_unfused(
    model, batch: int, t: int, kv_dtype: torch.dtype, padded: bool = False, vs_unfused: bool = True
):
    """Chunked prefill of `batch` rows: a chunk of t tokens at slots 0..t-1, then one of t tokens at later slots
    (row r starts at t + 3 r, leaving unwritten slots in between), fused into one cache, unfused into another
    (logits and caches compared within the bounds) and as fused t == 1 steps into a third (hidden states and
    cache bit-identical). padded: the first chunk has input_mask padding (row 0 left-padded by 1, row 1
    right-padded by 1) so padding queries and masked keys occur.

    Fused and unfused attention sum in another order (~1e-7 apart); where an activation lies within ~1e-6 of
    an int8 rounding boundary of the next BitLinear, that token rounds the other way on one path and it and
    the later tokens attending to it differ by ~1e-3 of the logit scale (seen in 1 of 256 such calls over 8
    seeds; hooks on the unfused path showed an o_proj input 2e-6 from a boundary). The seed is one whose data
    have no such token; long prefills (vs_unfused=False) are checked against the fused t == 1 steps only,
    which have no such ambiguity."""
    fused = Fused(model)
    gen = torch.Generator().manual_seed(1000 + 100 * t + batch)
    caches = [model.new_cache(batch, 2 * t + 3 * batch + 2, dtype=kv_dtype) for _ in range(3)]
    starts = [torch.zeros(batch, dtype=torch.long), t + 3 * torch.arange(batch)]
    worst = 0.0
    with torch.inference_mode():
        for k, start in enumerate(starts):
            ids = torch.randint(3, model.config.vocab_size, (batch, t), generator=gen)
            pos = start[:, None] + torch.arange(t)[None]
            mask = None
            if padded and k == 0:
                mask = torch.ones(batch, t, dtype=torch.bool)
                mask[0, 0] = False
                mask[-1, -1] = False
            n = fused.calls
            got, hid = fused(ids, positions=pos, cache=caches[0], input_mask=mask, return_hidden=True)
            assert fused.calls == n + 1  # the fused step ran
            want = model(ids, positions=pos, cache=caches[1], input_mask=mask)
            # the same tokens one by one through fused t == 1 steps (same kernels, same summation order): the
            # same hidden states bit for bit (the logits not: torch's LM head matmul sums differently for t = 1)
            steps = [
                fused(
                    ids[:, i : i + 1],
                    positions=pos[:, i : i + 1],
                    cache=caches[2],
                    input_mask=None if mask is None else mask[:, i : i + 1],
                    return_hidden=True,
                )[1]
                for i in range(t)
            ]
            assert fused.calls == n + 1 + t
            assert torch.equal(hid, torch.cat(steps, 1))
            if not vs_unfused:
                continue
            scale = want.abs().max().item()
            err = (got - want).abs().max().item()
            assert err <= REL_BOUND * scale, (k, err, scale)
            worst = max(worst, err / scale)
    for a, b in zip(
        caches[0].k + caches[0].v + [caches[0].valid], caches[2].k + caches[2].v + [caches[2].valid]
    ):
        assert torch.equal(a, b)
    if vs_unfused:
        _assert_caches_close(caches[0], caches[1], kv_dtype)
    return worst


@pytest.mark.parametrize("variant", ["packed-autobitlinear", "1bitllm"])  # relu2 GQA / silu MHA
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("t", [2, 9])
def test_fused_prefill_matches_unfused(oracle_dirs, one_torch_thread, variant, kv_dtype, batch, t):
    model = load_model(oracle_dirs[variant][0], backend="cpu").eval()
    _prefill_fused_vs_unfused(model, batch, t, kv_dtype)
    _prefill_fused_vs_unfused(model, batch, t, kv_dtype, padded=True)


@pytest.mark.parametrize("isa", [None, "scalar"])
def test_fused_prefill_threaded_wide_gqa(one_torch_thread, isa):
    """64-token chunks on 2 threads (the attention is shared out), 4 query heads per KV head; against the fused
    t == 1 steps (bit-identical) only: 256 tokens make an activation rounding flip vs unfused likely."""
    model = random_model(hidden=128, inter=128, num_attention_heads=8, num_key_value_heads=2)
    model = prepare(to_inference_(model).eval(), backend="cpu")
    threads = cpu.get_num_threads()
    cpu.set_num_threads(2)
    try:
        with cpu.use_isa(isa):
            _prefill_fused_vs_unfused(model, 2, 64, torch.float32, padded=True, vs_unfused=False)
            _prefill_fused_vs_unfused(model, 2, 64, torch.bfloat16, vs_unfused=False)
    finally:
        cpu.set_num_threads(threads)


def test_unfused_c_path_equals_the_reference_backend(oracle_dirs, one_torch_thread):
    """The model's own forward on the C kernels (projections in C, no fused step): bit-identical to the reference
    backend, logits included."""
    ours, _ = oracle_dirs["packed-autobitlinear"]
    prompt = torch.randint(3, 512, (1, 6), generator=torch.Generator().manual_seed(12))
    ref = load_model(ours, backend="reference").eval()
    want = greedy_with_cache(ref, prompt, 16)
    model = load_model(ours, backend="cpu").eval()
    cache, cache_ref = model.new_cache(1, 8), ref.new_cache(1, 8)
    with torch.inference_mode():
        for pos in range(3):
            ids, p = prompt[:, pos : pos + 1], torch.tensor([[pos]])
            assert torch.equal(model(ids, positions=p, cache=cache), ref(ids, positions=p, cache=cache_ref))
    assert torch.equal(greedy_with_cache(model, prompt, 16), want)


def test_steps_that_do_not_qualify_run_the_torch_layers(oracle_dirs, one_torch_thread):
    ours, _ = oracle_dirs["packed-autobitlinear"]
    model = load_model(ours, backend="cpu").eval()
    fused = Fused(model)
    ids = torch.tensor([[5]])
    with torch.no_grad():
        cache = model.new_cache(1, 8)
        fused(ids, cache=cache)  # plain no_grad qualifies
        assert fused.calls == 1
        fused(
            torch.tensor([[5, 6]]), cache=model.new_cache(1, 8), positions=torch.tensor([[3, 3]])
        )  # slot twice
        fused(ids)  # no cache
        fused(ids, cache=model.new_cache(1, 8, dtype=torch.float16))  # fp16 cache
        # one layer's tensors unlike the first's: the C step would index them with layer 0's shape
        odd = model.new_cache(1, 8)
        odd.v[-1] = odd.v[-1].transpose(2, 3).contiguous().transpose(2, 3)  # same shape, not contiguous
        fused(ids, cache=odd)
        odd = model.new_cache(1, 8)
        odd.k[1] = model.new_cache(1, 9).k[1][:, :, :8].contiguous().double()  # another dtype
        fused(ids, cache=odd)
    fused(ids, cache=model.new_cache(1, 8))  # autograd on: the torch layers build the graph
    assert fused.calls == 1


def test_models_it_does_not_take(oracle_dirs):
    ours, _ = oracle_dirs["packed-autobitlinear"]
    ref = load_model(ours, backend="reference")
    assert "backend" in why_not(ref) and CpuRunner(ref, RuntimeConfig(), 1, 8).fused is None
    gelu = load_model(ours, backend="cpu")
    gelu.config.hidden_act = "gelu"
    assert "gelu" in why_not(gelu) and CpuRunner(gelu, RuntimeConfig(), 1, 8).fused is None
    fp = load_model(oracle_dirs["llama"][0], backend="cpu")
    assert "Linear" in why_not(fp) and CpuRunner(fp, RuntimeConfig(), 1, 8).fused is None


@pytest.mark.parametrize("isa", [None, "scalar"])  # the AVX2 vector exp (where the CPU has it) and libm's
def test_silu_mul_matches_torch(isa):
    """The fused step's SiLU middle, silu(g) * u, against torch in float64 over values from -100 to 100 (exp's
    clamp below -87.3, the sign change, a length that leaves a scalar tail after the 8-lane loop)."""
    from bitnetlm.kernels.cpu import _lib

    lib = _lib.load()
    g = torch.cat(
        [torch.linspace(-100, 100, 2001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 3.0])]
    )
    u = torch.randn(g.numel(), generator=torch.Generator().manual_seed(0))
    y = torch.full_like(g, float("nan"))
    with cpu.use_isa(isa):
        lib.bn_silu_mul_f32(g.data_ptr(), u.data_ptr(), y.data_ptr(), g.numel())
    ref = torch.nn.functional.silu(g.double()) * u.double()
    # atol: the vector exp is 0 below -87.3, where |silu| < 1e-36 (float32 denormals)
    torch.testing.assert_close(y.double(), ref, rtol=4e-7, atol=1e-35)


def test_phase_timers(oracle_dirs, one_torch_thread):
    """The fused step's phase timers (cpu_profile.py --phases): while on, every phase of a layer gets time and the
    sum stays within the steps' wall time; off, steps add nothing; each read starts the sums again."""
    import time

    from bitnetlm.kernels.cpu.decode import PHASES, phase_timers

    model = Fused(load_model(oracle_dirs["packed-autobitlinear"][0], backend="cpu").eval())
    prompt = torch.randint(3, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(3))
    phase_timers(False)
    try:
        greedy_with_cache(model, prompt, 4)
        assert sum(phase_timers(True).values()) == 0  # off: nothing counted
        t0 = time.perf_counter()
        greedy_with_cache(model, prompt, 4)
        wall = time.perf_counter() - t0
        got = phase_timers(True)
        assert list(got) == list(PHASES) and all(v > 0 for v in got.values()), got
        assert sum(got.values()) <= wall
        assert sum(phase_timers(False).values()) == 0  # read: zeroed
    finally:
        phase_timers(False)


@pytest.mark.parametrize("head", ["bf16", "int8"])
def test_compact_head_keeps_a_float_cache_and_the_fused_step(oracle_dirs, one_torch_thread, head):
    """A model loaded with head_dtype bf16 / int8 (its embedding stored compactly) runs the fused step over a cache
    of its activations' dtype, not of the compact embedding's storage."""
    model = load_model(oracle_dirs["packed-autobitlinear"][0], backend="cpu", head_dtype=head).eval()
    runner = CpuRunner(model, RuntimeConfig(), 1, 16)
    assert runner.cache.k[0].dtype == torch.float32 and runner.fused is not None
    prompt = torch.randint(3, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    greedy_with_runner(runner, prompt, 4)
    assert runner.fused.calls == 4
