"""Sampling: logit processing against transformers' warpers, and real sampling statistics."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from bitnetlm.generate import SamplingParams, process_logits, sample

V = 1000


def _logits(b=6, v=V, seed=0):
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


def _hf(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, rep=1.0, prompt=None):
    x = logits.clone()
    if rep != 1.0:
        x = RepetitionPenaltyLogitsProcessor(rep)(prompt, x)
    if temperature != 1.0:
        x = TemperatureLogitsWarper(temperature)(None, x)
    if top_k:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(None, x)
    if min_p:
        x = MinPLogitsWarper(min_p)(None, x)
    return x


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0.7),
        dict(top_k=50),
        dict(top_p=0.9),
        dict(min_p=0.05),
        dict(temperature=1.3, top_k=100, top_p=0.8, min_p=0.02),
        dict(temperature=0.5, top_p=0.5),
    ],
)
def test_processing_matches_transformers_warpers(kw):
    logits = _logits()
    ours = process_logits(logits, [SamplingParams(**kw)] * logits.shape[0])
    theirs = _hf(logits, **kw)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    keep = ~torch.isinf(ours)
    torch.testing.assert_close(ours[keep], theirs[keep])
    if set(kw) != {"temperature"}:
        assert keep.sum() < keep.numel()  # the filter really removed tokens


@pytest.mark.parametrize("scale", [8.0, 0.5])  # peaked: the cut lies in the top candidates; flat: full sort
@pytest.mark.parametrize(
    "kw", [dict(top_p=0.9), dict(min_p=0.1), dict(top_p=0.95, min_p=0.01, temperature=0.7)]
)
def test_candidate_fast_path_matches_transformers(kw, scale):
    from bitnetlm.sampling import sampler as sampling

    logits = _logits(4, 8 * sampling.CANDIDATES, seed=5) * scale / 3
    ours = process_logits(logits, [SamplingParams(**kw)] * 4)
    theirs = _hf(logits, **kw)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    keep = ~torch.isinf(ours)
    torch.testing.assert_close(ours[keep], theirs[keep])
    kept = keep.sum(-1)
    assert kept.max() > 1 and (kept < logits.shape[1]).all()
    if scale == 0.5:
        assert (kept > sampling.CANDIDATES).any()  # the fallback really was needed
    # mixed batch: filtered rows next to a temperature-only row and a greedy row
    mixed = [
        SamplingParams(**kw),
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=0),
        SamplingParams(top_k=3),
    ]
    out = process_logits(logits, mixed)
    for i, p in enumerate(mixed):
        assert torch.equal(out[i : i + 1], process_logits(logits[i : i + 1], [p]))
    assert not torch.isinf(out[1:3]).any()


def test_repetition_penalty_matches_transformers():
    logits = _logits(2)
    prompt = torch.tensor([[1, 5, 5, 900], [7, 8, 9, 10]])
    p = SamplingParams(repetition_penalty=1.3)
    ours = process_logits(logits, [p, p], prompt_tokens=[[1, 5], [7, 8, 9, 10]], output_tokens=[[5, 900], []])
    theirs = _hf(logits, rep=1.3, prompt=prompt)
    torch.testing.assert_close(ours, theirs)


def test_presence_frequency_penalty_openai_rule():
    logits = _logits(1)
    out = [3, 3, 3, 8]
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    ours = process_logits(logits, [p], prompt_tokens=[[8, 11]], output_tokens=[out])
    expect = logits.clone()
    expect[0, 3] -= 3 * 0.25 + 0.5
    expect[0, 8] -= 1 * 0.25 + 0.5  # prompt occurrences do not count (OpenAI: output only)
    torch.testing.assert_close(ours, expect)


def test_per_row_params_are_independent():
    logits = _logits(3)
    ps = [SamplingParams(top_k=5), SamplingParams(top_p=0.3, temperature=0.5), SamplingParams(temperature=0)]
    ours = process_logits(logits, ps)
    for i, p in enumerate(ps):
        alone = process_logits(logits[i : i + 1], [p])
        assert torch.equal(ours[i : i + 1], alone)
    assert not torch.isinf(ours[2]).any()  # greedy row: no filtering, argmax decides
    assert (~torch.isinf(ours[0])).sum() == 5


def test_greedy_and_logit_bias():
    logits = _logits(2)
    p = SamplingParams(temperature=0)
    out = sample(logits, [p, p])
    assert torch.equal(out.tokens, logits.argmax(-1))
    low = int(logits[0].argmin())
    biased = SamplingParams(temperature=0, logit_bias={low: 1000.0})
    assert int(sample(logits[:1], [biased]).tokens[0]) == low
    banned = SamplingParams(temperature=1.0, logit_bias={int(logits[1].argmax()): -float("inf")}, seed=1)
    toks = {int(sample(logits[1:2], [banned], [banned.make_generator()]).tokens[0]) for _ in range(50)}
    assert int(logits[1].argmax()) not in toks


def test_top_k_never_samples_outside_top_k():
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(3))
    n = 3000
    p = SamplingParams(top_k=4, temperature=1.5)
    g = torch.Generator().manual_seed(0)
    out = sample(logits.expand(n, -1), [p] * n, [g] * n)
    top4 = set(logits[0].topk(4).indices.tolist())
    seen = set(out.tokens.tolist())
    assert seen <= top4
    assert seen == top4  # all four do occur


def test_min_p_and_top_p_support():
    logits = torch.tensor([[4.0, 3.5, 2.0, 0.0, -1.0, -2.0]])
    probs = logits.softmax(-1)[0]
    n = 3000
    g = torch.Generator().manual_seed(0)
    p = SamplingParams(min_p=0.2)
    seen = set(sample(logits.expand(n, -1), [p] * n, [g] * n).tokens.tolist())
    assert seen == {i for i in range(6) if probs[i] >= 0.2 * probs.max()}
    p = SamplingParams(top_p=0.8)
    seen = set(sample(logits.expand(n, -1), [p] * n, [g] * n).tokens.tolist())
    order = probs.argsort(descending=True).tolist()
    before = torch.cumsum(probs[order], 0) - probs[order]
    assert seen == {order[i] for i in range(6) if before[i] < 0.8}


def test_frequencies_follow_tempered_softmax():
    # chi-square goodness of fit: 6 categories, 20000 draws; threshold is the 99.9% quantile for 5 dof
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 0.2]])
    t = 0.8
    n = 20000
    p = SamplingParams(temperature=t)
    g = torch.Generator().manual_seed(42)
    toks = sample(logits.expand(n, -1), [p] * n, [g] * n).tokens
    counts = torch.bincount(toks, minlength=6).double()
    expected = (logits[0] / t).softmax(-1).double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (counts, expected)


def test_draw_across_chunks_follows_the_probabilities():
    """The inverse-CDF draw searches chunk masses, then one chunk (sampling.CDF_CHUNK tokens; here 700 tokens: two
    whole chunks and a short last one): tokens at chunk edges and in the short chunk are drawn at their
    probabilities (chi-square, 20000 draws), and no removed token (-inf) ever is, not even one beside a kept one."""
    from bitnetlm.sampling.sampler import CDF_CHUNK

    assert CDF_CHUNK == 256  # the edges below
    probs = {3: 0.1, 255: 0.2, 256: 0.15, 511: 0.25, 512: 0.1, 699: 0.2}
    logits = torch.full((1, 700), float("-inf"))
    for i, q in probs.items():
        logits[0, i] = math.log(q)
    n = 20000
    g = torch.Generator().manual_seed(5)
    toks = sample(logits.expand(n, -1), [SamplingParams(temperature=1.0)] * n, [g] * n).tokens
    assert set(toks.tolist()) <= set(probs)
    counts = torch.tensor([(toks == i).sum().item() for i in probs], dtype=torch.float64)
    expected = torch.tensor(list(probs.values()), dtype=torch.float64) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (counts, expected)  # 99.9% quantile, 5 degrees of freedom


def test_seed_reproducible_and_independent_of_batch():
    logits = _logits(4, 200)
    p = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=1.0)

    def run(rows, params):
        gens = [q.make_generator() for q in params]
        return [sample(rows, params, gens).tokens.tolist() for _ in range(20)]

    alone = [r[0] for r in run(logits[:1], [p])]
    again = [r[0] for r in run(logits[:1], [p])]
    batched = [r[0] for r in run(logits, [p, other, other, other])]
    assert alone == again == batched
    different = [r[0] for r in run(logits[:1], [SamplingParams(temperature=1.0, seed=99)])]
    assert different != alone


def test_logprobs_are_raw_model_logprobs():
    logits = _logits(2)
    p = SamplingParams(temperature=0.5, top_k=3, seed=0)
    out = sample(logits, [p, p], [p.make_generator()] * 2, num_top_logprobs=5)
    raw = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.tokens[:, None])[:, 0])
    torch.testing.assert_close(out.top_logprobs, raw.topk(5).values)
    assert torch.equal(out.top_ids, raw.topk(5).indices)
    assert math.isclose(
        float(out.top_logprobs[0].exp().sum()), float(raw[0].topk(5).values.exp().sum()), rel_tol=1e-6
    )


def test_bad_params():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="logit_bias"):
        process_logits(_logits(1), [SamplingParams(logit_bias={V + 5: 1.0})])


def test_row_random_is_one_stream_however_it_is_taken():
    """A row's uniforms come in BLOCKs from its generator: one at a time (the host sampler), a run up front (the
    CUDA-graph sampler) or across a block edge, the numbers are the same; on a CPU generator they are also what
    one draw at a time gives (so seeded CPU sampling is what it was before blocks)."""
    from bitnetlm.sampling.sampler import BLOCK, RowRandom

    n = 2 * BLOCK + 37
    r = RowRandom(torch.Generator().manual_seed(3), "cpu")
    one = torch.cat([r.take(1) for _ in range(n)])
    r = RowRandom(torch.Generator().manual_seed(3), "cpu")
    runs = torch.cat([r.take(5), r.take(BLOCK), r.take(n - 5 - BLOCK)])
    g = torch.Generator().manual_seed(3)
    plain = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for _ in range(n)])
    assert torch.equal(one, runs) and torch.equal(one, plain)
    assert one.dtype == torch.float64 and len(set(one.tolist())) == n


def _mixed_params():
    return [
        SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1),  # llama.cpp's defaults
        SamplingParams(temperature=0.7, top_p=0.9, seed=2),  # no top-k: the full sort
        SamplingParams(temperature=0, logit_bias={7: 30.0}),  # greedy, biased
        SamplingParams(temperature=1.3, min_p=0.02, logit_bias={3: 2.5, 11: -4.0}, seed=3),
    ]


def test_full_filter_equals_the_candidates_and_fallback_path():
    """The CUDA-graph sampler's filter (full=True: rows without top-k always sort the whole vocabulary) removes
    exactly what the host's candidates-then-fallback path removes, for sharp and for flat rows."""
    from bitnetlm.sampling.sampler import CANDIDATES, _filter_mask_over, filtered, row_tensors

    params = _mixed_params()
    for scale in (3.0, 0.05):  # sharp: the candidates hold the cut; flat: the fallback sort is needed
        x = _logits(len(params), 8 * CANDIDATES, seed=11) * scale
        t = row_tensors(params, x.shape[1], "cpu")
        host, full = filtered(x, t), filtered(x, t, full=True)
        inside = _filter_mask_over(x / t.temps, t, t.n)[1]
        assert bool(inside[1]) == (scale == 3.0)  # the flat row's cut lies past the candidates
        assert torch.equal(host, full)
        assert torch.isinf(full[1]).any() and not torch.isinf(full[2]).any()


def _top_k_params():
    return [
        SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1),
        SamplingParams(temperature=1.2, top_k=5, seed=2),
        SamplingParams(temperature=0, logit_bias={7: 30.0}),
        SamplingParams(temperature=0.6, top_k=300, logit_bias={3: 2.5, 11: -4.0}, seed=3),
    ]


@pytest.mark.parametrize("rows", ["mixed", "top_k"])  # top_k: every sampled row draws among its candidates
def test_graph_sampler_ops_equal_the_host_sampler(rows):
    """GraphSampler's ops (run eagerly on a CPU), over 30 steps of a batch mixing llama.cpp's sampler, top-p
    alone (or only top-k rows), a biased greedy row and logit biases, with the top log-probabilities: the
    tokens, log-probabilities and top lists of `sample` with the same rows' streams, step for step. The graph
    samples every row each step; the host loop only the rows still running (rows 1 and 3 stop early)."""
    from bitnetlm.runtime.cuda.graph_sampler import GraphSampler
    from bitnetlm.sampling.sampler import RowRandom, row_tensors

    params = _mixed_params() if rows == "mixed" else _top_k_params()
    b, v, steps = len(params), 3 * 256 + 17, 30
    ends = [steps, 12, steps, 20]  # the step each row stops at
    logits = torch.zeros(b, v)
    nxt = torch.zeros(b, 1, dtype=torch.long)

    def streams():
        return [RowRandom(p.make_generator(), "cpu") for p in params]

    t = row_tensors(params, v, "cpu")
    gs = GraphSampler(logits, nxt, t, top_n=3, cap=64, bias=True)
    assert gs.t.cand == (rows == "top_k")
    gs.load(t, params, streams(), ends)
    host_rows = streams()
    seen = []
    for s in range(steps):
        logits.copy_(_logits(b, v, seed=100 + s) * 2)
        gs.run()
        act = [i for i in range(b) if s < ends[i]]
        ref = sample(logits[act], [params[i] for i in act], [host_rows[i] for i in act], num_top_logprobs=3)
        assert torch.equal(gs.tok[act], ref.tokens) and torch.equal(nxt[act, 0], ref.tokens), s
        torch.testing.assert_close(gs.lp[act], ref.logprobs)
        torch.testing.assert_close(gs.top_v[act], ref.top_logprobs)
        assert torch.equal(gs.top_i[act], ref.top_ids)
        seen.append(gs.tok.clone())
    toks = torch.stack(seen)  # [steps, B]
    assert (toks[:, 2] == 7).all()  # the biased greedy row
    assert len(set(toks[:, 0].tolist())) > 3 and len(set(toks[:, 1].tolist())) > 3  # really sampled
    with pytest.raises(ValueError, match="captured for"):
        greedy = [SamplingParams(temperature=0)] * b
        gs.load(row_tensors(greedy, v, "cpu"), greedy, streams(), [steps] * b)


def test_top_k_rows_draw_from_the_processed_distribution():
    """Rows that all have a top-k draw among their kmax best tokens (sampling._candidate_probs, no pass over the
    vocabulary besides the top-k): their probabilities are softmax(process_logits), itself checked against
    transformers' warpers above, and 20000 draws follow them (chi-square); no removed token is ever drawn."""
    from bitnetlm.sampling.sampler import _candidate_probs, row_tensors

    def chi2_999(k):  # the chi-square distribution's 99.9% quantile, Wilson-Hilferty (z = 3.09)
        return k * (1 - 2 / (9 * k) + 3.09 * math.sqrt(2 / (9 * k))) ** 3

    logits = _logits(2, 300, seed=21)
    params = [
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, seed=0),
        SamplingParams(temperature=1.4, top_k=8),
    ]
    t = row_tensors(params, 300, "cpu")
    assert t.cand and t.kmax == 20
    probs, order = _candidate_probs(logits, t)
    dense = torch.zeros(2, 300).scatter_(1, order, probs)
    expected = process_logits(logits, params).softmax(-1)
    torch.testing.assert_close(dense, expected, rtol=1e-5, atol=1e-7)
    assert (
        1 < int((expected[0] > 0).sum()) < 20 and int((expected[1] > 0).sum()) == 8
    )  # top-p/min-p cut row 0
    n = 20000
    g = torch.Generator().manual_seed(6)
    for row in range(2):
        toks = sample(logits[row : row + 1].expand(n, -1), [params[row]] * n, [g] * n).tokens
        kept = expected[row] > 0
        assert bool(kept[toks].all())
        counts = torch.bincount(toks, minlength=300)[kept].double()
        want = expected[row][kept].double() * n
        stat = float(((counts - want) ** 2 / want).sum())
        assert stat < chi2_999(int(kept.sum()) - 1), (counts, want)


def test_a_seeded_row_samples_the_same_tokens_whatever_the_batch():
    """A row's draw depends on its own parameters only (a top-k row draws among its top-k, a row without one over
    the vocabulary): the same seeded rows alone, together, beside greedy rows or rows of the other kind give the
    same tokens, step for step (the server batches requests of every kind; offline generate runs them alone)."""
    from bitnetlm.sampling.sampler import RowRandom

    logits = _logits(4, 700, seed=8)
    k_row = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1)
    p_row = SamplingParams(temperature=0.7, top_p=0.9, seed=2)
    greedy = SamplingParams(temperature=0)
    plain = SamplingParams(temperature=1.0, seed=3)

    def run(params, rows):
        streams = [RowRandom(p.make_generator(), "cpu") for p in params]
        return [sample(logits[rows], params, streams).tokens.tolist() for _ in range(25)]

    k_alone = [s[0] for s in run([k_row], [0])]
    p_alone = [s[0] for s in run([p_row], [1])]
    mixed = run([k_row, p_row, greedy, plain], [0, 1, 2, 3])
    assert [s[0] for s in mixed] == k_alone and [s[1] for s in mixed] == p_alone
    assert [s[1] for s in run([greedy, k_row], [2, 0])] == k_alone
    assert len(set(k_alone)) > 3 and len(set(p_alone)) > 3


def test_graph_samplers_are_cached_per_kind_and_bounded():
    """One captured sampler per kind of rows, reused while its kind comes back; past MAX_SAMPLERS the least
    recently used is dropped, and the engine's step graphs stay (GraphSampler eager on a CPU, on a stand-in
    for the engine's graph table)."""
    from types import SimpleNamespace

    from bitnetlm.runtime.cuda import graph_sampler as gsm
    from bitnetlm.sampling.sampler import RowRandom

    st = SimpleNamespace(logits=torch.zeros(2, 50), tok=torch.zeros(2, 1, dtype=torch.long))
    eng = SimpleNamespace(_graphs={(2, 0.0, 0, False, None): st}, ecfg=SimpleNamespace(max_seq_len=64))

    def get(k):
        params = [SamplingParams(temperature=0.7, top_k=k, seed=0)] * 2
        return gsm.graph_sampler(
            eng, st, params, [RowRandom(p.make_generator(), "cpu") for p in params], [4, 4], 0
        )

    first = get(1)
    assert get(1) is first
    for k in range(2, gsm.MAX_SAMPLERS + 1):
        get(k)
    assert get(1) is first  # used again: now the most recent
    get(gsm.MAX_SAMPLERS + 1)  # one past the bound: top-k 2's, the least recently used, goes
    kinds = [k for k in eng._graphs if k[0] == "sampler"]
    assert len(kinds) == gsm.MAX_SAMPLERS and (2, 0.0, 0, False, None) in eng._graphs
    assert get(1) is first and get(3) is get(3)
    assert len([k for k in eng._graphs if k[0] == "sampler"]) == gsm.MAX_SAMPLERS
    assert all(
        k[2][1] != 2 for k in eng._graphs if k[0] == "sampler"
    )  # (key[2] = RowTensors.key(): n, kmax, ...)


@pytest.mark.parametrize(
    "bound, dev", [(64, "cpu"), (2, "cpu"), pytest.param(2, "cuda", marks=pytest.mark.gpu, id="2-cuda")]
)
def test_continuous_sampler_rows_join_and_leave_in_their_streams(bound, dev):
    """The server's captured sampler (ContinuousSampler; eager on a CPU, CUDA graphs on a GPU) over 40 steps of
    continuous batching: occupants of every kind join rows (after a first token from the host sampler, as the
    server's prefill gives it), leave, and the batch size follows the highest row in use (1, 2, 4). Each
    occupant's tokens, log-probabilities and top lists equal the host sampler's for that row alone with its own
    stream, step for step: a change of batch size or of the other rows' kinds never moves a row in its stream,
    nor does a captured kind dropped from the cache (bound 2) and made again. On a GPU each replay also stores
    its outputs into its sampler's pinned HostRing, read back here after the step as the server reads them."""
    from bitnetlm.runtime.cuda.graph_sampler import ContinuousSampler
    from bitnetlm.sampling.sampler import RowRandom

    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")  # deselected in CI by -m "not gpu"

    v, steps = 2 * 256 + 33, 40
    kinds = [
        SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, logprobs=True, top_logprobs=2),
        SamplingParams(temperature=0.7, top_p=0.9, logit_bias={5: 2.0, 9: -50.0}),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, logprobs=True, top_logprobs=3),
        SamplingParams(temperature=1.3, top_k=7),
        SamplingParams(temperature=0, logit_bias={11: 100.0}),
    ]
    # (row, first step, last step, kind): row 0 hosts three occupants in turn, row 3 sets the batch to 4
    plan = [(0, 0, 9, 0), (1, 2, 30, 1), (0, 10, 10, 3), (3, 5, 16, 4), (2, 8, 39, 2), (0, 12, 39, 5)]
    plan += [(1, 31, 39, 3), (3, 20, 27, 0)]
    cs = ContinuousSampler(4, v, cap=64, device=dev, max_samplers=bound)
    occ = []
    for j, (row, a, z, kind) in enumerate(plan):
        p = SamplingParams(**{**kinds[kind].__dict__, "seed": 10 + j, "max_tokens": z - a + 2})
        mine, ref = RowRandom(p.make_generator(dev), dev), RowRandom(p.make_generator(dev), dev)
        first = _logits(1, v, seed=500 + j).to(dev)
        # the prefill's token (host sampler), before the row joins
        assert torch.equal(sample(first, [p], [mine]).tokens, sample(first, [p], [ref]).tokens)
        occ.append((row, a, z, p, mine, ref, object()))
    drawn = {j: [] for j in range(len(plan))}
    sizes = set()
    for s in range(steps):
        live = [o for o in occ if o[1] <= s <= o[2]]
        b = next(n for n in (1, 2, 4) if n > max(o[0] for o in live))
        sizes.add(b)
        logits = _logits(b, v, seed=s).to(dev) * 2
        rows = {o[0]: (o[6], o[3], o[4], o[3].max_tokens - 1 - (s - o[1])) for o in live}
        gs, n = cs.sample(logits, rows)
        assert (n is None) == (dev == "cpu")
        if n is not None:  # the ring's slot holds the replay's outputs, once it has run
            torch.cuda.synchronize()
            r = gs.host
            k = r.slot(n)
            for got, t in [(r.tok, gs.tok), (r.lp, gs.lp), (r.top_i, gs.top_i), (r.top_v, gs.top_v)]:
                assert torch.equal(got[k], t.cpu()), (s, n)
        for row, _, _, p, _, ref, who in live:
            k = p.top_logprobs if p.logprobs else 0
            want = sample(logits[row : row + 1], [p], [ref], num_top_logprobs=k)
            assert gs.tok[row] == want.tokens[0], (s, row)
            torch.testing.assert_close(gs.lp[row : row + 1], want.logprobs)
            if k:
                assert torch.equal(gs.top_i[row, :k], want.top_ids[0])
                torch.testing.assert_close(gs.top_v[row, :k], want.top_logprobs[0])
            drawn[[o[6] for o in occ].index(who)].append(int(gs.tok[row]))
    assert sizes == {1, 2, 4}
    assert set(drawn[5]) == {11}  # the biased greedy row
    assert 9 not in drawn[1] and len(set(drawn[1])) > 5  # -50 on token 9; really sampled
    # several kinds were met, over the one Draws; at most `bound` are kept
    assert len(cs.samplers) == bound if bound < 4 else len(cs.samplers) >= 4
