"""Preemption over the paged KV cache: a pool that holds about two rows' worth of positions serves 8 requests at
once; when a step finds no free block the newest running sequence gives its blocks back and is prefilled again
later (vLLM's recompute mode). Greedy, seeded sampled, speculative and grammar-constrained outputs equal those of
a run without memory pressure (the static cache); /metrics counts the preemptions. The server's CPU default is
the paged cache, sized as the static one would be."""

from __future__ import annotations

import json

import pytest
import torch
from serve_parts import tiny_model_and_tokenizer

from bitnetlm.engine.core import EngineCore
from bitnetlm.engine.metrics import Metrics
from bitnetlm.engine.sequence import GenerationRequest, Token
from bitnetlm.runtime import make_runner
from bitnetlm.runtime.config import RuntimeConfig
from bitnetlm.runtime.cpu import CpuRunner
from bitnetlm.runtime.paged import PagedCpuRunner
from bitnetlm.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CTX, ROWS, BS = 64, 8, 8
TIGHT = 2 * CTX  # the positions of two static rows: 16 blocks for 8 rows


@pytest.fixture(scope="module")
def mt():
    return tiny_model_and_tokenizer(max_len=256, backend="cpu")


def _prompts(model, n=ROWS, first=8):
    v = model.config.vocab_size
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, v, (first + i,), generator=g).tolist() for i in range(n)]


def _static(model):
    return CpuRunner(model, RuntimeConfig(device="cpu"), ROWS, CTX)


def _paged(model, tokens=TIGHT):
    r = make_runner(model, RuntimeConfig(device="cpu", kv_tokens=tokens, kv_block_size=BS), ROWS, CTX)
    assert isinstance(r, PagedCpuRunner)
    return r


def _run(mt, runner, reqs, **options):
    """reqs: [(prompt, SamplingParams, n)] all added at once -> ({(request, choice): tokens}, counters, the most
    sequences running at once, {(request, choice): times preempted})."""
    metrics = Metrics("m")
    core = EngineCore(runner, mt[1], prefill_chunk=64, metrics=metrics, **options)
    got: dict[tuple[int, int], list[int]] = {}

    def sink(i):
        return lambda ev: (
            got.setdefault((i, ev.seq.index), []).append(ev.token) if isinstance(ev, Token) else None
        )

    groups = [core.add(GenerationRequest(p, sp, n), sink(i)) for i, (p, sp, n) in enumerate(reqs)]
    most = 0
    while core.has_work():
        core.step()
        most = max(most, len(core.running()))
    pre = {(i, s.index): s.preemptions for i, g in enumerate(groups) for s in g.seqs}
    return got, metrics.counters, most, pre


@pytest.mark.parametrize("reuse", [True, False])
def test_greedy_under_memory_pressure_equals_the_static_cache(mt, reuse):
    """8 greedy requests of 48 tokens in a pool of 2 rows' positions: more than 2 run at once (a reservation of
    prompt + max_tokens admitted 2), sequences are preempted and resumed, and every output equals the static
    cache's; every block comes back."""
    model = mt[0]
    reqs = [(p, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True), 1) for p in _prompts(model)]
    want, _, _, _ = _run(mt, _static(model), reqs, prefix_reuse=reuse)
    paged = _paged(model)
    got, counters, most, _ = _run(mt, paged, reqs, prefix_reuse=reuse)
    assert got == want
    assert most > 2 and counters["num_preemptions_total"] > 0
    assert paged.pool.in_use() == 0


def test_seeded_sampling_continues_its_stream_across_preemption(mt):
    """Sampled requests with seeds (one with n = 2 choices sharing its prompt) draw the same tokens with and
    without memory pressure: a preempted sequence keeps its random stream."""
    model = mt[0]
    reqs = [
        (
            p,
            SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=10 + i, ignore_eos=True),
            1 + (i == 5),
        )
        for i, p in enumerate(_prompts(model))
    ]
    want, _, _, _ = _run(mt, _static(model), reqs)
    got, counters, _, pre = _run(mt, _paged(model), reqs)
    assert got == want and len({tuple(v) for v in got.values()}) == len(got)
    assert counters["num_preemptions_total"] > 0 and any(pre.values())


@pytest.mark.parametrize("drafter", ["lookup", "model"])
def test_a_preempted_speculative_row_equals_plain_greedy(mt, drafter):
    """Prompt lookup drafts, or a draft model's (its own static rows, set up again on the row a resumed sequence
    gets), over a pool of 2 rows' positions: the rows that were preempted and resumed (their verify finding no
    block among them) give the greedy tokens of the static cache without speculation."""
    from bitnetlm.engine.speculative import SpeculativeConfig

    model = mt[0]
    loop = _prompts(model, 1, 6)[0]
    reqs = [
        (loop * 3 + p[:3], SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True), 1)
        for p in _prompts(model, 6)
    ]
    want, _, _, _ = _run(mt, _static(model), reqs)
    if drafter == "lookup":
        spec = SpeculativeConfig(4, lookup=3, max_rows=8)
    else:  # the model drafts for itself: a draft row that holds its sequence's tokens drafts what is accepted
        spec = SpeculativeConfig(3, draft=model, max_rows=8, adaptive=False)
    got, counters, _, pre = _run(mt, _paged(model), reqs, speculative=spec)
    assert got == want
    assert counters["spec_decode_num_drafts_total"] > 0 and counters["num_preemptions_total"] > 0
    assert any(pre.values())
    if drafter == "model":  # (a resumed row's draft row set up again, not another sequence's left over)
        drafted = counters["spec_decode_num_draft_tokens_total"]
        assert counters["spec_decode_num_accepted_tokens_total"] == drafted


def test_a_preempted_json_schema_row_still_parses(mt):
    """Grammar-constrained requests, added last (the newest: preempted first) behind long plain ones: preempted,
    they keep their grammar state and write what they write without pressure, JSON that validates."""
    import jsonschema

    pytest.importorskip("llguidance")
    model = mt[0]
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}},
        "required": ["ok", "tag"],
        "additionalProperties": False,
    }
    plain = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    guided = SamplingParams(max_tokens=50, temperature=0.8, seed=3, structured={"json": schema})
    prompts = _prompts(model)
    reqs = [(p, plain, 1) for p in prompts[:5]] + [(p, guided, 1) for p in prompts[5:]]
    want, _, _, _ = _run(mt, _static(model), reqs)
    got, counters, _, pre = _run(mt, _paged(model), reqs)
    assert got == want and counters["num_preemptions_total"] > 0
    assert any(pre[(i, 0)] for i in range(5, 8))  # a constrained row was preempted
    for i in range(5, 8):
        jsonschema.validate(json.loads(mt[1].decode(got[(i, 0)])), schema)


def test_server_paged_by_default_preempts_and_equals_static(mt):
    """Through the server and the openai client: without --kv-tokens the CPU server pages max_batch x context
    positions; with a pool of 2 rows' positions 8 concurrent greedy chats all finish with the static cache's
    (--kv-tokens 0) text, and /metrics and the engine's stats count the preemptions."""
    import concurrent.futures as cf

    import httpx
    import openai

    from bitnetlm.engine.metrics import parse_metrics
    from bitnetlm.serve import start

    model, tok = mt
    prompts = [f"{i}: " + "ab " * (1 + i % 3) for i in range(8)]

    def run(**options):
        h = start(
            model, tok, port=0, max_batch=8, max_seq_len=CTX, max_queue=64, log_level="warning", **options
        )
        try:
            c = openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=120)

            def one(p):
                # (max_tokens null: the rest of the context, which a reservation would have held whole)
                r = c.completions.create(model="bitnet", prompt=p, max_tokens=None, temperature=0)
                return r.choices[0].text

            with cf.ThreadPoolExecutor(8) as ex:
                outs = list(ex.map(one, prompts))
            m = parse_metrics(httpx.get(h.url + "/metrics").text)
            runner = h.engine.runner
            return outs, m['vllm:num_preemptions_total{model_name="bitnet"}'], h.engine.stats(), runner
        finally:
            h.stop()

    _, _, _, default = run()
    assert (
        isinstance(default, PagedCpuRunner) and default.pool.num_blocks * default.pool.block_size == 8 * CTX
    )
    want, none, _, static = run(kv_tokens=0)
    assert not isinstance(static, PagedCpuRunner) and none == 0
    got, preemptions, stats, _ = run(kv_tokens=TIGHT, kv_block_size=BS)
    assert got == want and preemptions > 0 and stats["preemptions"] == preemptions


def test_context_shift_rows_preempted_run_past_the_window(mt):
    """Rows that shift past a 32-position window are preempted and prefilled again from the tokens they held: each
    request still gets all of its tokens, and every block comes back."""
    from bitnetlm.engine.scheduler import ContextShift

    model = mt[0]
    reqs = [(p, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True), 1) for p in _prompts(model)]
    paged = _paged(model, tokens=CTX)
    got, counters, _, pre = _run(mt, paged, reqs, context=32, context_shift=ContextShift(2))
    assert sorted(len(v) for v in got.values()) == [60] * ROWS
    assert counters["num_preemptions_total"] > 0 and paged.pool.in_use() == 0


def test_scheduler_admits_on_prompt_blocks_and_requeues_a_preempted_sequence_first():
    """Pure bookkeeping: with 10 free blocks of 8, prompts of 20 tokens (3 blocks each, their first decode
    included) are admitted while they fit beside the watermark (1 block), whatever max_tokens says; a preempted
    sequence goes back to the front of the queue and is prefilled again with the token it generated."""
    from test_prefix_reuse import _seq

    from bitnetlm.engine.scheduler import Scheduler, SchedulerConfig

    free = [10]
    sch = Scheduler(SchedulerConfig(rows=4, kv_blocks=10, block_size=8, free=lambda: free[0]))
    a, b, c, d = (_seq([i] * 20, max_tokens=200) for i in range(4))
    for s in (a, b, c, d):
        sch.add(s)
    plan = sch.schedule()
    assert plan.admitted == [a, b, c] and list(sch.waiting) == [d]  # 3 x 3 blocks + 1 of watermark
    assert sch.promised == 9 and sch.newest() is c
    free[0] = 1  # their prompts are in
    for s, t in ((a, 5), (b, 6), (c, 7)):  # each sampled its first token
        s.tokens.append(t)
    assert sch.preempt(c) == 2 and list(sch.waiting) == [c, d] and c.row is None
    assert (c.n_fill, c.n_cached, c.preemptions, sch.preemptions) == (21, 0, 1, 1)
    assert sch.schedule().admitted == []  # 3 blocks are not free
    free[0] = 4
    plan = sch.schedule()
    assert plan.admitted == [c] and [(ch.start, ch.end) for g in plan.prefills for ch in g] == [(0, 21)]
    assert c in plan.decode  # its next token is sampled from the prefill's last logits, then fed
