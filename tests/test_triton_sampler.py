"""The samplers' kernels (kernels/triton/sampler.py) and `generate.reductions` over them, against PyTorch and the
host sampler's own ops. Under Triton's interpreter on the CPU (CI), compiled on a GPU."""

from __future__ import annotations

import pytest
import torch
from test_triton_ends import _logits_with_ties
from triton_interp import DEV, triton_modules


@pytest.mark.parametrize("b,v,chunks", [(7, 1000, 4), (7, 300, 1), (1, 257, 3), (3, 1000, 0)])
def test_logit_stats_equal_argmax_and_logsumexp(b, v, chunks):
    """One pass a row: torch.argmax's index (ties, NaNs, a row of -inf) and torch.logsumexp's value (NaN with
    a NaN, +inf with an infinity, -inf for a row of -inf), over one chunk a row and several; the counters reset
    themselves between calls, and a strided batch of rows reads only its own."""
    (sampler,) = triton_modules("sampler")
    g = torch.Generator().manual_seed(b * v + chunks)
    for i in range(3):
        x = _logits_with_ties(b, v, g) * (1 + i)
        if b > 2:
            x[2, 3] = float("inf")  # +inf, no NaN: logsumexp inf
        wide = torch.full((b, v + 40), 77.0, device=DEV)
        wide[:, :v] = x
        for t in (x, wide[:, :v]):
            idx, lse = sampler.logit_stats(t, chunks=chunks)
            assert idx.dtype == torch.long and torch.equal(idx, x.argmax(dim=-1)), (idx, x.argmax(dim=-1))
            torch.testing.assert_close(lse, torch.logsumexp(x, dim=-1), rtol=1e-6, atol=1e-5, equal_nan=True)
    spread = torch.randn(2, v, generator=g).to(DEV) * 30  # exp() of most entries underflows next to the max
    torch.testing.assert_close(
        sampler.logit_stats(spread)[1], torch.logsumexp(spread, dim=-1), rtol=1e-6, atol=1e-5
    )


@pytest.mark.parametrize("b,v", [(7, 1000), (1, 257), (2, 200)])
def test_greedy_sample_ends_a_greedy_step(b, v):
    """One launch: the argmax (ties, NaNs, a row of -inf; several chunks a row and one), its raw log-probability
    (x[token] - logsumexp, as `sampling.raw_logprobs` computes it), the token into a strided next-step input,
    and every row's draw index advanced; twice, so the counters reset between calls."""
    (sampler,) = triton_modules("sampler")
    g = torch.Generator().manual_seed(b * v)
    step = torch.arange(b, dtype=torch.long, device=DEV) * 10
    inp = torch.full((b, 3), -1, dtype=torch.long, device=DEV)
    for i in range(2):
        x = _logits_with_ties(b, v, g) * (1 + i)
        tok = torch.full((b,), -1, dtype=torch.long, device=DEV)
        lp = torch.zeros((b,), device=DEV)
        sampler.greedy_sample(x, tok, lp, inp[:, 1:2], step)
        want = x.argmax(dim=-1)
        assert torch.equal(tok, want) and torch.equal(inp[:, 1], want), (tok, want)
        assert torch.equal(inp[:, 0], torch.full_like(want, -1)) and torch.equal(inp[:, 2], inp[:, 0])
        ref = x.gather(1, want[:, None])[:, 0].float() - torch.logsumexp(x.float(), dim=-1)
        torch.testing.assert_close(lp, ref, rtol=1e-6, atol=1e-5, equal_nan=True)
        assert torch.equal(step, torch.arange(b, device=DEV) * 10 + i + 1)
    with pytest.raises(ValueError, match="lp must be"):
        sampler.greedy_sample(x, tok, lp.double(), inp[:, 1:2], step)


@pytest.mark.parametrize("b,n", [(3, 0), (70, 3), (1, 20)])
def test_export_rows_fill_alternate_slots(b, n):
    """A sampler's outputs into slot seq % 2 of two-slot outputs (pinned host memory on a GPU, which the kernel
    stores into directly), the other slot untouched, seq advanced on the device and copied to out_seq; 70 rows
    cross the kernel's 64-row block."""
    (sampler,) = triton_modules("sampler")
    g = torch.Generator().manual_seed(b + n)
    seq = torch.full((1,), 5, dtype=torch.long, device=DEV)
    pin = DEV == "cuda"  # (pinned memory needs a GPU)
    out = [
        torch.full(shape, -7, dtype=dt).pin_memory() if pin else torch.full(shape, -7, dtype=dt)
        for shape, dt in (
            ((2, b), torch.long),
            ((2, b), torch.float32),
            ((2, b, n), torch.float32),
            ((2, b, n), torch.long),
            ((1,), torch.long),
        )
    ]
    for i in range(2):
        src = (
            torch.randint(0, 1000, (b,), generator=g),
            torch.randn(b, generator=g),
            torch.randn(b, n, generator=g),
            torch.randint(0, 1000, (b, n), generator=g),
        )
        sampler.export_rows(*(t.to(DEV) for t in src[:4]), seq, *out)
        if pin:
            torch.cuda.synchronize()
        slot = (5 + i) % 2
        for o, t in zip(out[:4], src, strict=True):
            assert torch.equal(o[slot], t)
            if i == 0:
                assert (o[1 - slot] == -7).all()
        assert int(seq[0]) == int(out[4][0]) == 6 + i
    with pytest.raises(ValueError, match="out_lp must be"):
        sampler.export_rows(*(t.to(DEV) for t in src[:4]), seq, out[0], out[1].double(), *out[2:])


def test_logit_stats_read_bf16_logits():
    (sampler,) = triton_modules("sampler")
    x = (torch.randn(3, 700, generator=torch.Generator().manual_seed(5)) * 4).to(torch.bfloat16).to(DEV)
    idx, lse = sampler.logit_stats(x, chunks=2)
    assert torch.equal(idx, x.argmax(dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(x.float(), dim=-1), rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="unit stride"):
        sampler.logit_stats(x.t())


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 8])
def test_gpu_wide_sampler_reductions_equal_torch(b, monkeypatch):
    """Over a 128k vocabulary, `generate.reductions` against PyTorch's own ops, and
    a captured llama.cpp-default sampler built on them against one built on PyTorch's: the same tokens and
    log-probabilities over 20 steps."""
    from bitnetlm.runtime.cuda.graph_sampler import GraphSampler
    from bitnetlm.sampling import reductions
    from bitnetlm.sampling.sampler import RowRandom, SamplingParams, row_tensors

    g = torch.Generator(device="cuda").manual_seed(b)
    v = 128256
    x = torch.randn(b, v, device="cuda", generator=g) * 3
    idx, lse = reductions.argmax_logsumexp(x)
    assert torch.equal(idx, x.argmax(dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(x, dim=-1), rtol=1e-6, atol=1e-5)
    p = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=3)
    logits = torch.zeros(b, v, device="cuda")
    runs = []
    from bitnetlm.runtime.cuda import graph_sampler as gsm

    on = reductions.wide
    for wide in (False, True):  # PyTorch's own ops, then the wide reductions
        for mod in (reductions, gsm):
            monkeypatch.setattr(mod, "wide", on if wide else (lambda x: False))
        t = row_tensors([p] * b, v, "cuda")
        gs = GraphSampler(logits, torch.zeros(b, 1, dtype=torch.long, device="cuda"), t, 2, 64, False)
        gs.load(t, [p] * b, [RowRandom(p.make_generator("cuda"), "cuda") for _ in range(b)], [32] * b)
        out = []
        for s in range(20):
            logits.copy_(
                torch.randn(b, v, device="cuda", generator=torch.Generator("cuda").manual_seed(s)) * 3
            )
            gs.run()
            out.append((gs.tok.clone(), gs.lp.clone(), gs.top_i.clone(), gs.top_v.clone()))
        runs.append(out)
    for (t0, l0, i0, v0), (t1, l1, i1, v1) in zip(*runs, strict=True):
        assert torch.equal(t0, t1) and torch.equal(i0, i1)
        torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-5)


def _compiled(*kernels) -> set:
    """The compiled variants (kernel, specialization key) the JIT kernels hold, over every device."""
    return {(k.fn.__name__, key) for k in kernels for c in k.device_caches.values() for key in c[0]}


@pytest.mark.gpu
def test_gpu_warm_compiles_every_kernel_a_server_samples_with():
    """After `reductions.warm` over batches up to 24 (as a server's `GraphRows` warms them), the host sampler
    over any number of prompts' logits and the step samplers (greedy rows, llama.cpp's defaults, top-k alone,
    top-k with top-p at temperature 1, top-k classes 9 to 100) and the captured sampler of all-greedy rows
    compile nothing more; warm itself compiled what they needed (the count grew: no other test draws from top-k
    classes 32 or 128)."""
    from bitnetlm.kernels.triton import sampler
    from bitnetlm.runtime.cuda.graph_sampler import GraphSampler
    from bitnetlm.sampling import reductions
    from bitnetlm.sampling.sampler import SamplingParams, choose, raw_logprobs, row_tensors, sample

    n, v = 24, 128256
    kernels = (sampler._logit_stats_kernel, sampler._candidate_draw_kernel)
    before = _compiled(*kernels)
    reductions.warm(torch.zeros(n, v, device="cuda"))
    warmed = _compiled(*kernels)
    assert warmed > before  # (a proper superset)
    x = torch.randn(n, v, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 3
    u = torch.rand(n, device="cuda", dtype=torch.float64)
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1),
        SamplingParams(temperature=1.0, top_k=50, seed=2),
        SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=3),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=4),  # (Qwen's suggested settings)
        SamplingParams(temperature=1.0, top_k=100, min_p=0.1, seed=5),
        SamplingParams(temperature=0.6, top_k=9, seed=6),
    ]
    for p in kinds:
        tokens = choose(x, row_tensors([p] * n, v, "cuda"), u, full=True)
        raw_logprobs(x, tokens)
        for r in (13, 5, 19):  # prompts ready at once: the host sampler's batch is any size
            sample(torch.stack(list(x[:r])), [p] * r, [p.make_generator("cuda") for _ in range(r)])
    for r in (13, 5, 1):  # the server's captured sampler of all-greedy rows: one fused launch
        t = row_tensors([kinds[0]] * r, v, "cuda")
        GraphSampler(x[:r], torch.zeros(r, 1, dtype=torch.long, device="cuda"), t, 0, 8, False).run()
    torch.cuda.synchronize()
    assert _compiled(*kernels) == warmed, _compiled(*kernels) - warmed


def _rows():
    from bitnetlm.sampling.sampler import SamplingParams

    return [
        SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),  # llama.cpp's defaults
        SamplingParams(temperature=1.3, top_k=7),
        SamplingParams(temperature=0.0),  # greedy: drawn, then replaced by the argmax
        SamplingParams(temperature=0.5, top_k=60, top_p=0.5),
        SamplingParams(temperature=1.0, top_k=33, min_p=0.2),
    ]


@pytest.mark.parametrize("which", ["mixed", "top_k only"])
def test_candidate_draw_equals_the_host_samplers_draw(which):
    """Rows mixing temperatures, top-k, top-p and min-p (or top-k alone: no probabilities pass) over 40 steps of
    logits and uniforms: the token `_candidate_probs` + `_draw_sorted` draw, for every row."""
    (sampler,) = triton_modules("sampler")
    from bitnetlm.sampling.sampler import _candidate_probs, _draw_sorted, row_tensors

    params = _rows() if which == "mixed" else _rows()[1:3]
    b, v = len(params), 300
    t = row_tensors(params, v, DEV)
    assert t.need_p == (which == "mixed") and t.scale
    g = torch.Generator().manual_seed(7)
    for _ in range(40):
        x = (torch.randn(b, v, generator=g) * 2).to(DEV)
        u = torch.rand(b, generator=g, dtype=torch.float64).to(DEV)
        probs, order = _candidate_probs(x, t)
        want = order.gather(1, _draw_sorted(probs, u)[:, None])[:, 0]
        vals, order = x.topk(t.kmax, dim=-1)
        got = sampler.candidate_draw(vals, order, t.temps[:, 0], t.k, t.top_p, t.min_p, u, t.scale, t.need_p)
        assert torch.equal(got, want), (got, want)
    edge = torch.tensor([0.0, 1 - 1e-12, 0.5, 0.999, 1e-9], dtype=torch.float64)[:b].to(DEV)
    probs, order = _candidate_probs(x, t)  # u at 0 and just below 1: the first and the last kept candidate
    want = order.gather(1, _draw_sorted(probs, edge)[:, None])[:, 0]
    vals, order = x.topk(t.kmax, dim=-1)
    got = sampler.candidate_draw(vals, order, t.temps[:, 0], t.k, t.top_p, t.min_p, edge, t.scale, t.need_p)
    assert torch.equal(got, want)
