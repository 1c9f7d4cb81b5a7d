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
    from bitnetlm.generate import sampling

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
    from bitnetlm.generate.sampling import CDF_CHUNK

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
    assert math.isclose(float(out.top_logprobs[0].exp().sum()), float(raw[0].topk(5).values.exp().sum()))


def test_bad_params():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="logit_bias"):
        process_logits(_logits(1), [SamplingParams(logit_bias={V + 5: 1.0})])
