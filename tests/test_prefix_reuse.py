"""Prefix reuse: a prompt skips the tokens whose keys and values a KV row already holds.

The scheduler alone (which row, how many tokens, kept or copied), then the oracle: the same requests with reuse
off, whose tokens and log-probabilities must be identical, offline and through the server under concurrency.
"""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import openai
import pytest
from serve_parts import tiny_model_and_tokenizer

from bitnetlm.engine.metrics import parse_metrics
from bitnetlm.engine.scheduler import REUSE_MIN, Scheduler, SchedulerConfig
from bitnetlm.engine.sequence import GenerationRequest, Group, Sequence
from bitnetlm.sampling import SamplingParams
from bitnetlm.serve import start

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Detok:
    pass


def _seq(prompt: list[int], max_tokens: int = 4) -> Sequence:
    g = Group(GenerationRequest(list(prompt), SamplingParams(max_tokens=max_tokens), 1), print)
    g.seqs = [Sequence(g, 0, _Detok(), set(), None)]
    return g.seqs[0]


def _prefill_all(sch: Scheduler) -> None:
    """Plan until every running prompt is prefilled (the worker's part is not needed for the bookkeeping)."""
    sch.schedule()
    while any(s.n_cached < s.n_prompt for s in sch.running.values()):
        sch.schedule()


SYSTEM = list(range(100, 140))  # a 40-token shared prefix


def test_running_row_prefix_is_copied_ended_row_is_taken_as_it_is():
    sch = Scheduler(SchedulerConfig(rows=3, prefill_chunk=512))
    a = _seq(SYSTEM + [1, 2, 3])
    sch.add(a)
    plan = sch.schedule()
    assert plan.reused == {} and a.row == 0
    b = _seq(SYSTEM + [4, 5])
    sch.add(b)
    plan = sch.schedule()
    # a (running) holds the 40 shared tokens: b gets a copy of them in an empty row and prefills the rest
    assert b.row == 1 and plan.reused[id(b)] == (0, 40)
    assert [(c.start, c.end) for g in plan.prefills for c in g if c.seq is b] == [(40, 42)]
    sch.finish(a)
    c = _seq(SYSTEM + [1, 2, 9, 9])
    sch.add(c)
    plan = sch.schedule()
    # row 0 ended holding a's prompt: c takes it as it is, keeping the 42 tokens it shares
    assert c.row == 0 and plan.reused[id(c)] == (0, 42)


def test_reuse_limits_and_eviction_order():
    sch = Scheduler(SchedulerConfig(rows=2, prefill_chunk=512))
    a, b = _seq(SYSTEM), _seq(list(range(500, 560)))
    sch.add(a), sch.add(b)
    _prefill_all(sch)
    sch.finish(b)
    sch.finish(a)  # row 1 ended first, then row 0
    # a prompt equal to a held one reuses all but its last token (whose logits the first sample needs)
    same = _seq(SYSTEM)
    sch.add(same)
    assert sch.schedule().reused[id(same)] == (0, len(SYSTEM) - 1)
    # below REUSE_MIN shared tokens nothing is reused; no empty row left: the row that ended first is evicted
    short = _seq(list(range(500, 500 + REUSE_MIN - 1)) + [7, 7])
    other = _seq([9] * 30)
    sch.add(short)
    plan = sch.schedule()
    assert plan.reused == {} and short.row == 1
    sch.finish(same)
    sch.add(other)
    assert sch.schedule().reused == {} and other.row == 0


def test_a_shifted_row_offers_only_its_kept_positions():
    """After a context shift a row holds tokens[:keep] + later tokens: only the kept prefix may be reused."""
    sch = Scheduler(SchedulerConfig(rows=2, prefill_chunk=512))
    a = _seq(SYSTEM + [1, 2])
    a.shift_keep = 20
    sch.add(a)
    _prefill_all(sch)
    a.n_cached, a.shifted = 30, 12  # as _maybe_shift leaves it
    b = _seq(SYSTEM + [3])
    sch.add(b)
    assert sch.schedule().reused[id(b)] == (0, 20)
    sch.finish(a)
    assert sch.held[0] == tuple(SYSTEM[:20])


def test_off_reuses_nothing():
    sch = Scheduler(SchedulerConfig(rows=2, prefill_chunk=512, prefix_reuse=False))
    a = _seq(SYSTEM + [1])
    sch.add(a)
    _prefill_all(sch)
    b = _seq(SYSTEM + [2])
    sch.add(b)
    assert sch.schedule().reused == {} and sch.held == {}


# ---- the oracle: reuse off ------------------------------------------------------------------------------------
def _chats(tok, n: int) -> list[list[dict]]:
    words = "truth universally acknowledged single man possession good fortune want wife".split()
    system = " ".join(words[i % len(words)] for i in range(980))  # 1,000+ tokens with the template
    return [
        [
            {"role": "system", "content": system},
            {"role": "user", "content": f"{words[i % 10]} {i} {words[i % 7]}"},
        ]
        for i in range(n)
    ]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_server_outputs_equal_no_reuse_under_concurrency(backend):
    """32 concurrent chats sharing a ~1,000-token system prompt: the same tokens as the same chats with reuse off,
    and their log-probabilities; the prefix cache counts its hits. (Log-probabilities agree to float rounding: how
    a prompt is cut into prefill chunks depends on the other requests' timing, with reuse or without.)"""
    model, tok = tiny_model_and_tokenizer(max_len=1280, backend=backend)
    chats = _chats(tok, 32)
    assert len(tok.apply_chat_template(chats[0], tokenize=True)) >= 1000

    def run(reuse: bool):
        h = start(model, tok, port=0, max_batch=8, max_queue=64, prefix_caching=reuse, log_level="warning")
        try:
            c = openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=300)

            def one(msgs):
                r = c.chat.completions.create(
                    model="bitnet", messages=msgs, max_tokens=8, temperature=0, logprobs=True
                )
                return [(t.token, t.logprob) for t in r.choices[0].logprobs.content]

            with cf.ThreadPoolExecutor(32) as ex:
                outs = list(ex.map(one, chats))
            return outs, parse_metrics(httpx.get(h.url + "/metrics").text)
        finally:
            h.stop()

    on, m_on = run(True)
    off, m_off = run(False)
    assert [[t for t, _ in o] for o in on] == [[t for t, _ in o] for o in off]
    for a, b in zip(on, off, strict=True):
        assert [lp for _, lp in a] == pytest.approx([lp for _, lp in b], abs=1e-5)
    hits = m_on['vllm:prefix_cache_hits_total{model_name="bitnet"}']
    queries = m_on['vllm:prefix_cache_queries_total{model_name="bitnet"}']
    assert hits >= 24 * 1000 and queries >= 32 * 1000  # all but the first few chats reuse the system prompt
    assert m_off['vllm:prefix_cache_hits_total{model_name="bitnet"}'] == 0
    assert (
        m_on['vllm:prompt_tokens_total{model_name="bitnet"}'] + hits
        == m_off['vllm:prompt_tokens_total{model_name="bitnet"}']
    )
