"""The continuous-batching engine without HTTP: prompt sharing for n > 1, cancellation events, draining shutdown."""

from __future__ import annotations

import threading

import pytest
from serve_parts import tiny_model_and_tokenizer

from bitnetlm.generate import SamplingParams, generate
from bitnetlm.runtime.config import RuntimeConfig
from bitnetlm.serve.engine import (
    Chunk,
    ContextTooLong,
    Engine,
    EngineClosed,
    EngineConfig,
    Failed,
    Finished,
    GenerationRequest,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def mt():
    return tiny_model_and_tokenizer(max_len=128)


class Collector:
    def __init__(self):
        self.events = []
        self.done = threading.Event()

    def __call__(self, ev):
        self.events.append(ev)
        if isinstance(ev, (Finished, Failed)):
            self.done.set()

    def tokens(self, index=0):
        return [t for e in self.events if isinstance(e, Chunk) and e.index == index for t in e.token_ids]


def test_n_choices_share_one_prefill(mt):
    model, tok = mt
    ids = tok.encode("a single man in possession of a good fortune")
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ref = generate(model, tok, ids, p).tokens
    eng = Engine(model, tok, runtime=RuntimeConfig(max_batch=4))
    try:
        c = Collector()
        eng.submit(GenerationRequest(ids, p, n=4), c)
        assert c.done.wait(120)
        assert [c.tokens(i) for i in range(4)] == [ref] * 4
        assert c.events[-1] == Finished(len(ids), 32)
        # the prompt was computed once and copied to the other three rows
        assert eng.metrics.counters["prompt_tokens_total"] == len(ids)
    finally:
        eng.shutdown()


def test_cancel_ends_with_failed_event_and_frees_rows(mt):
    model, tok = mt
    eng = Engine(model, tok, EngineConfig(max_queue=2), runtime=RuntimeConfig(max_batch=2))
    try:
        long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        running, queued = Collector(), Collector()
        g1 = eng.submit(GenerationRequest(tok.encode("fox"), long, n=2), running)  # takes both rows
        g2 = eng.submit(GenerationRequest(tok.encode("dog"), long), queued)
        while not any(isinstance(e, Chunk) for e in running.events):
            threading.Event().wait(0.01)
        assert eng.stats()["rows_in_use"] == 2 and eng.stats()["waiting"] == 1
        eng.cancel(g2)
        eng.cancel(g1)
        assert running.done.wait(60) and queued.done.wait(60)
        assert isinstance(running.events[-1], Failed) and running.events[-1].status == 499
        assert queued.events == [Failed("request cancelled", 499)]  # never started
        st = eng.stats()
        assert st["rows_in_use"] == 0 and st["running"] == 0 and st["waiting"] == 0
        assert st["max_cancel_lag_steps"] <= 1
    finally:
        eng.shutdown()


def test_limits_and_draining_shutdown(mt):
    model, tok = mt
    eng = Engine(model, tok, EngineConfig(max_queue=4), runtime=RuntimeConfig(max_batch=1))
    with pytest.raises(ContextTooLong, match="maximum context length is 128"):
        eng.submit(GenerationRequest(list(range(5, 100)), SamplingParams(max_tokens=40)), Collector())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.submit(GenerationRequest([10**6], SamplingParams(max_tokens=4)), Collector())
    cs = [Collector() for _ in range(3)]
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for i, c in enumerate(cs):
        eng.submit(GenerationRequest(tok.encode(f"fox {i}"), p), c)
    eng.shutdown(drain=True)  # one row, three requests: all of them still finish
    assert all(isinstance(c.events[-1], Finished) and len(c.tokens()) == 6 for c in cs)
    with pytest.raises(EngineClosed):
        eng.submit(GenerationRequest(tok.encode("late"), p), Collector())


def test_a_request_the_core_cannot_take_fails_alone(mt, monkeypatch):
    """A request whose start raises inside the engine thread (here: its seeded generator) ends with a Failed event;
    the engine goes on serving the others."""
    model, tok = mt
    eng = Engine(model, tok, runtime=RuntimeConfig(max_batch=2))
    try:
        real = eng.core.add

        def add(req, sink, max_tokens=None):
            if req.params.seed == 13:
                raise RuntimeError("seed out of range")
            return real(req, sink, max_tokens)

        monkeypatch.setattr(eng.core, "add", add)
        p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        bad, good = Collector(), Collector()
        eng.submit(GenerationRequest(tok.encode("fox"), SamplingParams(max_tokens=4, seed=13)), bad)
        eng.submit(GenerationRequest(tok.encode("dog"), p), good)
        assert bad.done.wait(60) and good.done.wait(60)
        assert isinstance(bad.events[-1], Failed) and "seed out of range" in bad.events[-1].message
        assert good.tokens() == generate(model, tok, tok.encode("dog"), p).tokens
    finally:
        eng.shutdown()
