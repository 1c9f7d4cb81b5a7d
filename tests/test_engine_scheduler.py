"""The scheduler alone (no model, no tensors): admission, chunked prefill, batched prompts, prompt sharing between
the choices of a request, decode selection with and without pipelined (pending) tokens, and freed rows."""

from __future__ import annotations

from bitnetlm.engine.scheduler import Scheduler, SchedulerConfig
from bitnetlm.engine.sequence import GenerationRequest, Group, Sequence
from bitnetlm.sampling import SamplingParams


class _Detok:  # the scheduler never reads text: a sequence needs a detokenizer object only
    pass


def _request(n_prompt: int, max_tokens: int = 8, n: int = 1) -> list[Sequence]:
    g = Group(
        GenerationRequest(list(range(3, 3 + n_prompt)), SamplingParams(max_tokens=max_tokens), n), print
    )
    g.seqs = [Sequence(g, i, _Detok(), set(), None) for i in range(n)]
    return g.seqs


def _run(plan, pending: bool = False) -> None:
    """What the worker does to the sequences: first tokens of completed prompts, one token per decode (on the
    host, or on its way there: pending)."""
    done = {id(s) for s in plan.decode}
    for group in plan.prefills:
        for c in group:
            if c.end == c.seq.n_prompt and id(c.seq) not in done:
                _sample(c.seq, pending)
    for _, t in plan.copies:
        if id(t) not in done:
            _sample(t, pending)
    for s in plan.decode:
        if s.n_cached == s.n_prompt + 1:  # its first token, sampled this step before its decode
            _sample(s, pending)
        _sample(s, pending)


def _sample(s: Sequence, pending: bool) -> None:
    if pending:
        s.pending += 1
    else:
        s.tokens.append(7)


def _collect(seqs) -> None:
    for s in seqs:
        if s.pending:
            s.pending -= 1
            s.tokens.append(7)


def test_admission_lowest_rows_first_and_queueing():
    sch = Scheduler(SchedulerConfig(rows=2, prefill_chunk=64))
    a, b, c = _request(4)[0], _request(5)[0], _request(6)[0]
    for s in (a, b, c):
        sch.add(s)
    plan = sch.schedule()
    assert [s.row for s in plan.admitted] == [0, 1] and list(sch.waiting) == [c]
    assert [[ch.seq for ch in g] for g in plan.prefills] == [[a, b]]  # two whole prompts, one forward
    assert plan.decode == [a, b]  # their first tokens decode in the same step
    sch.finish(a)
    assert sch.free_rows == [0] and a.row is None and a.done
    plan = sch.schedule()
    assert plan.admitted == [c] and c.row == 0  # the freed row, lowest first
    sch.finish(c)
    sch.finish(b)
    assert sch.free_rows == [0, 1] and not sch.has_work()


def test_chunked_prefill_budget_and_fifo():
    sch = Scheduler(SchedulerConfig(rows=3, prefill_chunk=10, batched_prefill=False))
    long, short = _request(25)[0], _request(4)[0]
    sch.add(long)
    sch.add(short)
    chunks = []
    for _ in range(4):
        plan = sch.schedule()
        chunks.append([(g[0].seq is long, g[0].start, g[0].end) for g in plan.prefills])
        _run(plan)
    # 10 prompt tokens a step, the first arrival first; a prompt completes and decodes in the same step
    assert chunks[0] == [(True, 0, 10)]
    assert chunks[1] == [(True, 10, 20)]
    assert chunks[2] == [(True, 20, 25), (False, 0, 4)]
    assert chunks[3] == []
    assert long.n_cached == 25 + 2 and short.n_cached == 4 + 2  # prompt + two decode steps each


def test_split_first_only_keeps_prefill_shapes_few():
    sch = Scheduler(SchedulerConfig(rows=3, prefill_chunk=10, batched_prefill=False, split_first_only=True))
    a, b = _request(6)[0], _request(8)[0]
    sch.add(a)
    sch.add(b)
    plan = sch.schedule()
    # b would need a split to fit the 4 tokens left: it waits for the next step instead
    assert [(g[0].seq, g[0].start, g[0].end) for g in plan.prefills] == [(a, 0, 6)]


def test_choices_share_their_prompt():
    sch = Scheduler(SchedulerConfig(rows=4, prefill_chunk=64))
    seqs = _request(6, n=3)
    for s in seqs:
        sch.add(s)
    plan = sch.schedule()
    assert [[c.seq for c in g] for g in plan.prefills] == [[seqs[0]]]  # one prefill ...
    assert plan.copies == [(seqs[0], seqs[1]), (seqs[0], seqs[2])]  # ... copied to the siblings' rows
    assert plan.decode == seqs and all(s.n_cached == 7 for s in seqs)


def test_decode_budget_and_pipelined_pending_tokens():
    sch = Scheduler(SchedulerConfig(rows=2, prefill_chunk=64))
    s = _request(3, max_tokens=3)[0]
    sch.add(s)
    steps = []
    for _ in range(4):
        plan = sch.schedule()
        steps.append(s in plan.decode)
        _run(plan, pending=True)  # tokens still on their way to the host ...
        if len(steps) > 1:
            _collect([s])  # ... the previous step's arrive one step later
    # step 1: its first token and its second (decoded before the first was read); step 2: the third; then
    # nothing: 3 tokens sampled (1 still pending counts against the budget)
    assert steps == [True, True, False, False]
    assert s.budget == 0 and s.n_cached == 3 + 2


def test_nothing_to_decode_without_a_next_token():
    sch = Scheduler(SchedulerConfig(rows=1, prefill_chunk=64))
    s = _request(2, max_tokens=5)[0]
    sch.add(s)
    _run(sch.schedule())
    s.tokens.pop()  # as if the step's token had not come back: no next token, no decode
    assert sch.schedule().decode == []


def test_context_shift_plans_a_shift_at_the_window():
    """A sequence whose next token would be fed at position `context` shifts first: its kept positions stay,
    half of the rest goes, and it decodes at the lowered position, with tokens on their way to the host as well;
    one without a keep never shifts (its budget ends it at the window)."""
    for pending in (False, True):
        sched = Scheduler(SchedulerConfig(rows=2, prefill_chunk=16, context=8))
        (s,) = _request(4, max_tokens=40)
        s.shift_keep = 1
        sched.add(s)
        shifts = []
        for _ in range(12):
            plan = sched.schedule()
            shifts += [(sh.keep, sh.drop, sh.seq.n_cached) for sh in plan.shifts]
            assert s.n_cached <= 8
            _run(plan, pending)
            _collect([s]) if pending else None
        # positions 0..7 held, the next token at 8: drop (8 - 1) // 2 = 3, decode at 5 (n_cached 6 after it)
        assert shifts[0] == (1, 3, 6) and len(shifts) >= 2
        # (its row holds every token but the last sampled one, less those dropped)
        assert s.shifted == 3 * len(shifts) and len(s.tokens) + s.pending - s.shifted == s.n_cached + 1
