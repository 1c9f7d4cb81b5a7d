"""Speculative decoding: prompt lookup and draft models leave greedy outputs unchanged and sampled outputs
distributed as non-speculative sampling's (chi-square against the model's exact distribution)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import bitnetlm
from bitnetlm.engine.speculative import NgramIndex, SpeculativeConfig
from bitnetlm.generate import SamplingParams, batch_generate, generate
from bitnetlm.models import ModelConfig, build_model
from bitnetlm.quant import to_inference_

# input-grounded text: the continuation repeats what the prompt says, as in summarising or editing
GROUNDED = (
    "Mr. Bennet was so odd a mixture of quick parts, sarcastic humour, reserve, and caprice, that the experience "
    "of three and twenty years had been insufficient to make his wife understand his character. Repeat the "
    "sentence: Mr. Bennet was so odd a mixture of quick parts,"
)
REPETITIVE = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"


@pytest.fixture(scope="module")
def tiny(one_torch_thread):
    return bitnetlm.load("bitnet-tiny")


@pytest.fixture(scope="module")
def tiny_reference(one_torch_thread):
    return bitnetlm.load("bitnet-tiny", backend="reference")


def random_draft(vocab: int, seed: int = 3):
    """A one-layer random model with the target's vocabulary: a bad draft."""
    cfg = ModelConfig(
        arch="bitnet", vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rope_theta=10000.0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    m = build_model(cfg, "train")
    with torch.no_grad():
        m.embed_tokens.weight.normal_()
    return to_inference_(m).eval()


def scan_draft(t: list[int], n_max: int, n_min: int, k: int) -> list[int]:
    """Prompt lookup by its definition: a scan for the latest earlier occurrence of the longest tail n-gram."""
    for n in range(min(n_max, len(t) - 1), n_min - 1, -1):
        for i in range(len(t) - n - 1, -1, -1):
            if t[i : i + n] == t[-n:]:
                return t[i + n : i + n + k]
    return []


def lookup_draft(t: list[int], n_max: int, n_min: int, k: int) -> list[int]:
    return NgramIndex(n_max).draft(t, n_min, k)


def test_lookup_draft():
    t = [5, 6, 7, 8, 1, 2, 5, 6, 7]
    assert lookup_draft(t, 3, 1, 4) == [8, 1, 2, 5]  # the 3-gram 5 6 7 occurred at 0
    assert lookup_draft(t, 3, 1, 2) == [8, 1]
    assert lookup_draft([1, 2, 3, 9, 2, 3, 4, 2, 3], 2, 1, 3) == [4, 2, 3]  # the latest occurrence wins
    assert lookup_draft([1, 2, 3, 4], 3, 1, 4) == []
    assert lookup_draft([1, 2, 3, 9, 3], 3, 2, 4) == []  # only a 1-gram matches, below lookup_min
    assert lookup_draft([1, 2, 3, 9, 3], 3, 1, 4) == [9, 3]
    assert lookup_draft([4], 3, 1, 4) == []


def test_lookup_index_grown_token_by_token_equals_the_scan():
    g = torch.Generator().manual_seed(0)
    for vocab in (3, 8, 50):
        t = torch.randint(vocab, (300,), generator=g).tolist()
        index, grown = NgramIndex(4), []
        for i, x in enumerate(t):
            grown.append(x)
            if i % 3:  # (the index also takes several new tokens at once)
                continue
            for n_min in (1, 2, 4):
                assert index.draft(grown, n_min, 5) == scan_draft(grown, 4, n_min, 5), (vocab, i, n_min)


def test_config_errors():
    with pytest.raises(ValueError, match="--draft-max 0"):
        SpeculativeConfig(num_tokens=0, lookup=3)
    with pytest.raises(ValueError, match="--lookup"):
        SpeculativeConfig(lookup=3, lookup_min=4)
    assert SpeculativeConfig(lookup=3, draft=object()).enabled  # both: lookup, else the draft model
    assert not SpeculativeConfig().enabled


@pytest.mark.parametrize("which", ["cpu", "reference"])
@pytest.mark.parametrize("prompt", [GROUNDED, REPETITIVE])
def test_lookup_greedy_unchanged(request, which, prompt):
    model, tok = request.getfixturevalue("tiny" if which == "cpu" else "tiny_reference")
    base = generate(model, tok, prompt, max_tokens=48, temperature=0, ignore_eos=True)
    for k in (1, 4, 7):
        spec = SpeculativeConfig(num_tokens=k, lookup=3)
        r = generate(model, tok, prompt, max_tokens=48, temperature=0, ignore_eos=True, speculative=spec)
        assert r.tokens == base.tokens, k
        assert str(r) == str(base)
        assert r.draft_tokens > 0 and 0 < r.accepted_tokens <= r.draft_tokens
        assert r.logprobs == pytest.approx(base.logprobs, rel=2e-2, abs=2e-3)  # (bf16 activations)


@pytest.mark.parametrize(
    "variant", ["fp", "online", "packed-autobitlinear", "packed-bitlinear", "1bitllm", "llama"]
)
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_oracle_checkpoints_greedy_unchanged(oracle_dirs, tiny, variant, backend):
    """Every checkpoint variant, on both CPU backends: token-id prompts (vocabulary 512) that repeat."""
    from bitnetlm.loading import load_model

    model = load_model(oracle_dirs[variant][0], backend=backend).eval()
    tok = tiny[1]  # (decodes the ids; the checkpoints have no tokenizer)
    g = torch.Generator().manual_seed(1)
    prompts = [(torch.randint(3, 512, (9,), generator=g).tolist() * 3)[:-2] for _ in range(3)]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (24, 13, 30)]
    spec = SpeculativeConfig(num_tokens=4, lookup=3)
    alone = batch_generate(model, tok, prompts, params)
    both = batch_generate(model, tok, prompts, params, speculative=spec)
    assert [b.tokens for b in both] == [a.tokens for a in alone]
    assert sum(b.accepted_tokens for b in both) > 0
    r = generate(model, tok, prompts[0], params[2], speculative=SpeculativeConfig(num_tokens=3, draft=model))
    assert (
        r.tokens == generate(model, tok, prompts[0], params[2]).tokens and r.accepted_tokens == r.draft_tokens
    )


def test_smollm2_greedy_unchanged(tmp_path, one_torch_thread):
    """The second zoo model (its real ternary parts, a seeded random embedding: no network here)."""
    from zoo_parts import smollm2_random_embedding

    model, tok = bitnetlm.load(str(smollm2_random_embedding(tmp_path)))
    for prompt in (GROUNDED, REPETITIVE):
        base = generate(model, tok, prompt, max_tokens=32, temperature=0, ignore_eos=True)
        r = generate(
            model, tok, prompt, max_tokens=32, temperature=0, ignore_eos=True,
            speculative=SpeculativeConfig(num_tokens=5, lookup=4, adaptive=False),
        )  # fmt: skip
        assert r.tokens == base.tokens and r.draft_tokens > 0


def test_lookup_greedy_penalties_stops_and_batches(tiny):
    model, tok = tiny
    spec = SpeculativeConfig(num_tokens=5, lookup=4, adaptive=False)
    kw = dict(max_tokens=40, temperature=0, ignore_eos=True)
    pen = dict(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2)
    base = generate(model, tok, REPETITIVE, **kw, **pen)
    r = generate(model, tok, REPETITIVE, **kw, **pen, speculative=spec)
    assert r.tokens == base.tokens and r.draft_tokens > 0
    # a stop token inside an accepted draft ends the output there
    plain = generate(model, tok, REPETITIVE, **kw)
    stop = plain.tokens[9]
    cut = plain.tokens.index(stop) + 1
    r = generate(model, tok, REPETITIVE, **kw, stop_token_ids=[stop], speculative=spec)
    assert r.tokens == plain.tokens[:cut] and r.finish_reason == "stop"
    # a budget that ends mid-draft
    r = generate(model, tok, REPETITIVE, max_tokens=7, temperature=0, ignore_eos=True, speculative=spec)
    assert r.tokens == plain.tokens[:7] and r.finish_reason == "length"
    # rows that speculate beside rows that do not (no match) and rows of other lengths
    prompts = [REPETITIVE, "Emma Woodhouse, handsome, clever, and rich,", GROUNDED]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (30, 17, 41)]
    alone = batch_generate(model, tok, prompts, params)
    both = batch_generate(model, tok, prompts, params, speculative=spec)
    assert [b.tokens for b in both] == [a.tokens for a in alone]
    # more rows decoding than max_rows: no drafts (one decode step serves them all)
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)] * 3
    few = batch_generate(model, tok, prompts, params, speculative=spec.replace(max_rows=2))
    assert [r.draft_tokens for r in few] == [0, 0, 0]
    with pytest.raises(ValueError, match="max_rows 0"):
        spec.replace(max_rows=0)


def test_draft_model_greedy_unchanged(tiny):
    model, tok = tiny
    base = generate(model, tok, GROUNDED, max_tokens=40, temperature=0, ignore_eos=True)
    # the target as its own draft: every draft token is accepted
    same = generate(
        model, tok, GROUNDED, max_tokens=40, temperature=0, ignore_eos=True,
        speculative=SpeculativeConfig(num_tokens=4, draft=model),
    )  # fmt: skip
    assert same.tokens == base.tokens
    assert same.accepted_tokens == same.draft_tokens > 20
    # a random draft: nearly everything rejected, the output still the target's
    bad = SpeculativeConfig(num_tokens=3, draft=random_draft(model.config.vocab_size))
    r = generate(model, tok, GROUNDED, max_tokens=40, temperature=0, ignore_eos=True, speculative=bad)
    assert r.tokens == base.tokens and r.draft_tokens > 0
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (25, 9, 33)]
    prompts = [REPETITIVE, "Emma Woodhouse,", GROUNDED]
    alone = batch_generate(model, tok, prompts, params)
    both = batch_generate(
        model, tok, prompts, params, speculative=SpeculativeConfig(num_tokens=3, draft=model)
    )
    assert [b.tokens for b in both] == [a.tokens for a in alone]


def test_lookup_and_draft_model_together_greedy_unchanged(tiny):
    """Lookup drafts where the text repeats, a (random) draft model elsewhere; its rows catch up in between."""
    model, tok = tiny
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (40, 9, 33)]
    prompts = [REPETITIVE, "Emma Woodhouse,", GROUNDED]
    alone = batch_generate(model, tok, prompts, params)
    spec = SpeculativeConfig(
        num_tokens=3, lookup=3, lookup_min=2, draft=random_draft(model.config.vocab_size)
    )
    both = batch_generate(model, tok, prompts, params, speculative=spec)
    assert [b.tokens for b in both] == [a.tokens for a in alone]
    r = both[0]  # the repeating prompt: lookup's drafts are accepted (the random model's alone: none are)
    assert r.accepted_tokens >= 5 and r.draft_tokens - r.accepted_tokens >= 5


def test_draft_model_vocabulary_must_match(tiny):
    model, tok = tiny
    spec = SpeculativeConfig(draft=random_draft(512))
    with pytest.raises(ValueError, match="draft model: its vocabulary has 512 tokens, the target's"):
        generate(model, tok, "Hi", max_tokens=4, speculative=spec)


def test_rollback_leaves_the_cache_as_decoding_does(tiny):
    """After speculation with rejections, the row's cache holds what plain decoding wrote (nothing stale)."""
    from bitnetlm.engine.core import EngineCore
    from bitnetlm.engine.sequence import GenerationRequest
    from bitnetlm.runtime import make_runner
    from bitnetlm.runtime.config import RuntimeConfig

    model, tok = tiny
    ids = tok.encode(REPETITIVE)
    p = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    caches = []
    for spec in (None, SpeculativeConfig(num_tokens=6, lookup=2, adaptive=False)):
        runner = make_runner(model, RuntimeConfig(), 1, 128)
        core = EngineCore(runner, tok, speculative=spec)
        core.add(GenerationRequest(ids, p), lambda ev: None)
        while core.has_work():
            core.step()
        caches.append(runner)
    (a, b), n = caches, len(ids) + 29  # the last token is never fed back
    assert b.lengths[0] == a.lengths[0] == n
    assert core.speculator.drafted > core.speculator.accepted > 0  # something was rolled back
    assert torch.equal(a.cache.valid[0], b.cache.valid[0])
    for x, y in zip(a.cache.k + a.cache.v, b.cache.k + b.cache.v, strict=True):
        torch.testing.assert_close(x[0, :, :n], y[0, :, :n], atol=2e-2, rtol=2e-2)


def _exact(model, ids: list[int], depth: int, temperature: float, top_k: int) -> dict[tuple, float]:
    """The exact distribution of the first `depth` sampled tokens: temperature, then the top-k renormalised."""
    out: dict[tuple, float] = {}

    def walk(prefix, prob):
        if len(prefix) == depth:
            out[prefix] = prob
            return
        with torch.no_grad():
            logits = model(torch.tensor([ids + list(prefix)]))[0, -1].double() / temperature
        v, i = logits.topk(top_k)
        for t, q in zip(i.tolist(), torch.softmax(v, 0).tolist(), strict=True):
            walk((*prefix, t), prob * q)

    walk((), 1.0)
    return out


def _chi_square_p(counts: Counter, probs: dict[tuple, float], n: int) -> float:
    """p-value of Pearson's chi-square; outcomes expected fewer than 5 times are pooled."""
    assert set(counts) <= set(probs), set(counts) - set(probs)
    cells, pool_e, pool_o = [], 0.0, 0
    for k, pr in probs.items():
        if pr * n < 5:
            pool_e, pool_o = pool_e + pr * n, pool_o + counts.get(k, 0)
        else:
            cells.append((counts.get(k, 0), pr * n))
    if pool_e > 0:
        cells.append((pool_o, pool_e))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2.0)))


def _choices(model, tok, ids, params, n, spec):
    """The n choices (sequences) of one request run to the end."""
    from bitnetlm.engine.core import EngineCore
    from bitnetlm.engine.sequence import GenerationRequest
    from bitnetlm.runtime import make_runner
    from bitnetlm.runtime.config import RuntimeConfig

    core = EngineCore(make_runner(model, RuntimeConfig(), n, len(ids) + 8), tok, speculative=spec)
    g = core.add(GenerationRequest(ids, params, n=n), lambda ev: None)
    while core.has_work():
        core.step()
    return g.seqs


@pytest.mark.parametrize("kind", ["lookup", "bad-draft", "self-draft", "lookup+bad-draft"])
def test_sampled_distribution_unchanged(tiny, kind):
    model, tok = tiny
    base = tok.encode(REPETITIVE)
    cont = generate(model, tok, base, max_tokens=6, temperature=0, ignore_eos=True).tokens
    ids = base + cont + base[1:]  # the prompt's end occurred before: prompt lookup drafts `cont`
    depth, temp, top_k, n = 4, 1.0, 3, 1536
    spec = {
        "lookup": SpeculativeConfig(num_tokens=3, lookup=3, adaptive=False, max_rows=256),
        "bad-draft": SpeculativeConfig(
            num_tokens=2, draft=random_draft(model.config.vocab_size), adaptive=False, max_rows=256
        ),
        "self-draft": SpeculativeConfig(num_tokens=2, draft=model, adaptive=False, max_rows=256),
        "lookup+bad-draft": SpeculativeConfig(
            num_tokens=3,
            lookup=3,
            lookup_min=2,
            draft=random_draft(model.config.vocab_size),
            adaptive=False,
            max_rows=256,
        ),
    }[kind]
    probs = _exact(model, ids, depth, temp, top_k)
    counts, drafted, accepted = Counter(), 0, 0
    for b in range(n // 256):  # 256 choices of one request: their prompt is prefilled once
        p = SamplingParams(max_tokens=depth, temperature=temp, top_k=top_k, seed=10_000 * b, ignore_eos=True)
        for s in _choices(model, tok, ids, p, 256, spec):
            counts[tuple(s.generated)] += 1
            drafted, accepted = drafted + s.drafted, accepted + s.accepted
    assert drafted > n // 2  # the later tokens went through speculation
    if kind == "self-draft":
        assert accepted > 0.97 * drafted
    else:
        assert accepted < drafted  # and through rejections
    assert _chi_square_p(counts, probs, n) > 1e-3, (counts.most_common(8), sorted(probs.items())[:8])


def test_server_speculating_serves_the_same_tokens(tiny):
    """A server with prompt lookup answers concurrent greedy requests with the offline tokens, and counts its
    drafts in /metrics."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from bitnetlm.engine.metrics import parse_metrics
    from bitnetlm.serve import start

    model, tok = tiny
    prompts = [REPETITIVE, GROUNDED, "Emma Woodhouse, handsome, clever, and rich,"]
    want = [str(generate(model, tok, p, max_tokens=24, temperature=0, ignore_eos=True)) for p in prompts]
    with start(model, tok, port=0, max_batch=4, lookup=3, draft_max=5, log_level="warning") as h:

        def ask(p):
            body = {"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            return httpx.post(h.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]

        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(ask, prompts * 2))
        m = parse_metrics(httpx.get(h.url + "/metrics").text)
    assert got == want * 2
    lab = '{model_name="bitnet"}'
    drafted = m[f"vllm:spec_decode_num_draft_tokens_total{lab}"]
    assert drafted > m[f"vllm:spec_decode_num_accepted_tokens_total{lab}"] > 0
    assert m[f"vllm:spec_decode_num_drafts_total{lab}"] > 0


def test_speculative_flags(capsys):
    from bitnetlm.cli import main

    for argv, want in (
        (["--lookup", "3", "--draft-max", "0"], "--draft-max 0: expected an integer >= 1"),
        (["--lookup", "2", "--lookup-min", "3"], "--lookup 2 / --lookup-min 3"),
        (["--draft-model", "smollm2-135m-1.58"], "--draft-model smollm2-135m-1.58: its tokenizer differs"),
    ):
        assert main(["generate", "-m", "bitnet-tiny", "Hi", "-n", "2", *argv]) == 2, argv
        assert want in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32"])
def test_cuda_speculative_greedy_unchanged(dtype):
    """The CUDA-graph engine's verify pass and rollback: greedy tokens with prompt lookup and with a draft model
    equal its own without, alone and batched. (float32 only: in bfloat16 the verify pass's GEMMs round otherwise
    than the decode step's GEMVs, and on an H100 a near-tie in bitnet-tiny's repetitive prompt went the other way.)"""
    from bitnetlm.runtime import kept_runner

    model, tok = bitnetlm.load("bitnet-tiny", device="cuda", dtype=dtype)
    prompts = [REPETITIVE, GROUNDED, "Emma Woodhouse, handsome, clever, and rich,"]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (40, 33, 47)]
    base = batch_generate(model, tok, prompts, params)
    assert getattr(kept_runner(model), "eng", None) is not None
    for spec in (SpeculativeConfig(num_tokens=5, lookup=3, adaptive=False), SpeculativeConfig(draft=model)):
        got = batch_generate(model, tok, prompts, params, speculative=spec)
        assert [g.tokens for g in got] == [b.tokens for b in base]
        assert sum(g.accepted_tokens for g in got) > 0
        one = generate(model, tok, prompts[0], params[0], speculative=spec)
        assert one.tokens == base[0].tokens


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_cuda_captured_verify_equals_the_eager_chunk(kv):
    """CudaRunner.verify replays a captured graph (tokens padded to a power of two over a power-of-two span of
    the cache, positions read on the device): its logits and the cache it leaves equal the eager chunk forward's,
    in two rows, across a span boundary, and when a rejected draft is verified over again."""
    from bitnetlm.runtime import make_runner
    from bitnetlm.runtime.config import RuntimeConfig
    from bitnetlm.runtime.cuda.runner import CudaRunner

    model, _ = bitnetlm.load("bitnet-tiny", device="cuda", dtype="float32")
    cfg = RuntimeConfig(device="cuda", kv_cache_dtype=kv)
    graph, eager = make_runner(model, cfg, 2, 256), make_runner(model, cfg, 2, 256)
    assert isinstance(graph, CudaRunner)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (140,), generator=g).tolist()
    tol = 1e-4 if kv == "auto" else 0.1  # (float8: e4m3 steps where the two attentions round apart)
    for row, n0 in ((0, 20), (1, 61)):
        for r in (graph, eager):
            r.prefill(row, ids[:n0])
        for start, n in ((n0, 5), (n0 + 2, 7), (n0 + 2, 3), (n0 + 4, 1)):  # (n0 + 2: after a rejection)
            toks = ids[start : start + n]
            got = graph.verify(row, toks, start)
            tok = torch.tensor([toks], device="cuda")
            pos = torch.full((1,), start, dtype=torch.int32, device="cuda")
            want = eager.eng.forward(tok, pos, row0=row, start=start, last_only=False)
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
            for a, b in zip(graph.eng.k_cache + graph.eng.v_cache, eager.eng.k_cache + eager.eng.v_cache):
                if kv != "auto":
                    break
                a, b = a[row, :, : start + n].float(), b[row, :, : start + n].float()
                torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    assert sum(1 for k in graph.eng._graphs if k[0] == "verify") >= 4  # captured, not eager
