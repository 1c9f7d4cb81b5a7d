"""The worker: executes the scheduler's plans on a runner and turns sampled tokens into text.

One step: reset the rows admitted, prefill the planned prompt chunks (whole prompts that arrived together in one
forward where the runner batches), copy a prefilled prompt into the rows of its request's other choices, sample
the first token of every prompt that completed, shift the rows that reached the end of the context window, then
decode every sequence that has a next token and sample.

Pipelined (a runner that samples on the device, no row with penalties): the sampled tokens stay on the device as
the next step's input and reach the host later (`collect`), so the host's work on one step's tokens overlaps the
device's next step. A sequence that those tokens end has decoded one token too many, which nobody reads.
Otherwise every step's tokens are read before the next is planned.

Over a paged KV cache a forward may find no free block (the runner raises OutOfBlocks and changes nothing): the
newest running sequences are preempted (`Scheduler.preempt`) until it fits, and it runs without those that were.
"""

from __future__ import annotations

import time

import torch

from bitnetlm.engine import grammar
from bitnetlm.engine.metrics import Metrics
from bitnetlm.engine.scheduler import Chunk, Plan, Scheduler
from bitnetlm.engine.sequence import Finished, Sequence, Token
from bitnetlm.runtime.base import Pending, SampleSpec
from bitnetlm.runtime.blocks import OutOfBlocks

Queued = tuple[Pending, list[Sequence]]


def spec(s: Sequence, allowed: torch.Tensor | None = None) -> SampleSpec:
    """What the runner needs to sample `s`'s next token (among those `allowed`, a grammar's bitmask)."""
    p = s.params
    pen = p.needs_penalties
    return SampleSpec(
        s.row,
        p,
        s.random,
        s.group.max_tokens - len(s.generated),
        owner=s,
        prompt=s.tokens[: s.n_prompt] if pen else (),
        output=s.generated if pen else (),
        allowed=allowed,
    )


def _decoding(plan: Plan) -> list[Sequence]:
    """The plan's sequences that still decode: not ended, with tokens to sample, and not preempted."""
    return [s for s in plan.decode if not s.done and s.budget > 0 and s.row is not None]


def _masks(seqs: list[Sequence]) -> dict[int, torch.Tensor]:
    """id(sequence) -> the bitmask of the tokens its grammar allows next, for the constrained ones."""
    cs = [s for s in seqs if s.constraint is not None]
    return (
        dict(zip((id(s) for s in cs), grammar.masks([s.constraint for s in cs]), strict=True)) if cs else {}
    )


class Worker:
    def __init__(self, runner, scheduler: Scheduler, metrics: Metrics | None = None, speculator=None):
        self.runner, self.scheduler, self.metrics = runner, scheduler, metrics
        self.speculator = speculator  # (engine/speculative.py) drafts and verifies, when speculating
        self.batched_prefills = 0  # forwards that prefilled several prompts at once
        self._mask_thread = None  # computes grammars' masks while a decode forward runs

    def execute(self, plan: Plan, pipelined: bool) -> tuple[Queued | None, Queued | None]:
        """Run `plan`. Pipelined, returns the sampling of the prompts' first tokens and the decode step's, each
        (pending, its sequences) still on its way to the host; otherwise both are read already (None, None)."""
        r = self.runner
        self._release()
        for s in plan.admitted:
            self._start_row(s, plan)
        ready = [(s, lg) for s, lg in self._prefill(plan) if s.row is not None]  # (not preempted since)
        first = step = None
        if ready:
            seqs = [s for s, _ in ready]
            m = _masks(seqs)  # (a prompt's first mask: once per request, not worth a thread)
            specs = [spec(s, m.get(id(s))) for s in seqs]
            pend = r.sample(specs, torch.stack([lg for _, lg in ready]), carry=pipelined)
            first = self._queued(pend, seqs, pipelined)
        for sh in plan.shifts:  # (before the decode that feeds the token past the window)
            if sh.seq.row is not None:
                self._fit([sh.seq], lambda ss, sh=sh: r.shift(sh.seq.row, sh.keep, sh.drop))
        dec = _decoding(plan)
        if dec and self.speculator is not None and not pipelined:
            # a constrained sequence does not draft: its drafts would need the grammar's mask at every position
            drafts = self.speculator.propose([s for s in dec if s.constraint is None])
            for s, d in drafts.items():  # (after the others' decode would be as good: different rows)
                if s.row is None:  # preempted by an earlier verify
                    continue
                got = self._fit([s], lambda ss, s=s, d=d: self.speculator.verify(s, d))
                if got is not None:
                    self._emit_verified(s, *got)
            dec = [s for s in _decoding(plan) if s not in drafts]
        if dec:
            step = self._fit(dec, lambda ss: self._decode(ss, pipelined))
        return first, step

    def _fit(self, seqs: list[Sequence], run):
        """run(seqs); where a paged KV cache has no free block for it, the newest running sequences are
        preempted until it fits, and it runs for those of `seqs` still running (None when none is). The pool
        holds any one request alone (`EngineCore.check_blocks`), so the last running sequence never lacks room:
        running out then is an error (as vLLM, which refuses a cache that cannot hold one request)."""
        while True:
            try:
                return run(seqs)
            except OutOfBlocks:
                sch = self.scheduler
                if len(sch.running) <= 1:
                    raise
                victim = sch.newest()
                self._preempt(victim)
                seqs = [s for s in seqs if s is not victim]
                if not seqs:
                    return None

    def _start_row(self, s: Sequence, plan: Plan) -> None:
        """A newly admitted sequence's row: emptied, or starting with a reused prompt prefix (kept or copied)."""
        r, m = self.runner, self.metrics
        src, n = plan.reused.get(id(s), (None, 0))
        if src == s.row:
            r.reset(s.row, keep=n)
        else:
            r.reset(s.row)
            if src is not None:
                r.copy_prefix(src, s.row, n)
            elif n and r.adopt(s.row, s.row_tokens(0, n)) != n:  # (nothing is evicted since the plan)
                raise RuntimeError(
                    f"row {s.row}: the KV block cache no longer holds the {n} planned positions"
                )
        if m is not None:
            m.inc("prefix_cache_queries_total", s.n_fill)
            m.inc("prefix_cache_hits_total", n)

    def _decode(self, dec: list[Sequence], pipelined: bool) -> Queued | None:
        r = self.runner
        tokens = [None if s.pending else s.tokens[-1] for s in dec]
        positions = [s.n_cached - 1 for s in dec]
        rows = [s.row for s in dec]
        if all(s.constraint is None for s in dec):
            pend = r.decode_sample(rows, tokens, positions, [spec(s) for s in dec], carry=pipelined)
            return self._queued(pend, dec, pipelined)
        # the grammars' masks are computed on another thread while the forward runs (llguidance releases the GIL)
        if self._mask_thread is None:
            from concurrent.futures import ThreadPoolExecutor

            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="bitnet-grammar")
        masks = self._mask_thread.submit(_masks, dec)
        r.decode(rows, tokens, positions)
        m = masks.result()
        pend = r.sample([spec(s, m.get(id(s))) for s in dec], carry=False)
        return self._queued(pend, dec, False)

    def _prefill(self, plan: Plan) -> list[tuple[Sequence, torch.Tensor]]:
        """The plan's prompt chunks and copies -> (sequence, its prompt's last logits [V]) of completed prompts."""
        r, ready = self.runner, []
        for group in plan.prefills:
            group = [c for c in group if c.seq.row is not None]  # (not preempted by an earlier forward)
            ready += self._prefill_group(group) if group else []
            if self.metrics is not None:
                done = sum(c.end - c.start for c in group if c.seq.row is not None)
                self.metrics.inc("prompt_tokens_total", done)
        last = {id(s): lg for s, lg in ready}
        for src, dst in plan.copies:
            if dst.row is None:
                continue
            if src.row is None or id(src) not in last:  # the prompt to copy was preempted: the sibling waits
                self._preempt(dst)
                continue
            r.copy_prefix(src.row, dst.row, src.n_prompt)
            ready.append((dst, last[id(src)]))
        return ready

    def _prefill_group(self, group: list[Chunk]) -> list[tuple[Sequence, torch.Tensor]]:
        """One forward of `group`'s chunks (several whole prompts, or one chunk) -> its completed prompts'
        (sequence, last logits), without those preempted to make room for it."""
        r = self.runner
        if len(group) == 1:
            c = group[0]
            lg = self._fit(
                [c.seq], lambda ss: r.prefill(c.seq.row, c.seq.row_tokens(c.start, c.end), c.start)
            )
            return [(c.seq, lg)] if lg is not None and c.end == c.seq.n_fill else []
        end = {id(c.seq): c.end for c in group}

        def many(ss: list[Sequence]) -> torch.Tensor:
            return r.prefill_many([s.row for s in ss], [s.row_tokens(0, end[id(s)]) for s in ss])

        logits = self._fit([c.seq for c in group], many)
        if logits is None:
            return []
        self.batched_prefills += 1
        ran = [c.seq for c in group if c.seq.row is not None]
        return [(s, logits[i]) for i, s in enumerate(ran)]

    def _preempt(self, s: Sequence) -> None:
        self.runner.reset(self.scheduler.preempt(s))
        if self.metrics is not None:
            self.metrics.inc("num_preemptions_total")

    def _queued(self, pending: Pending, seqs: list[Sequence], pipelined: bool) -> Queued | None:
        for s in seqs:
            s.pending += 1
        if pipelined:
            return pending, seqs
        self.collect((pending, seqs))
        return None

    def collect(self, queued: Queued) -> None:
        """A sampling step's tokens into their sequences (but for those that have ended since it was queued)."""
        pending, seqs = queued
        got = self.runner.collect(pending)
        now = time.perf_counter()
        for i, s in enumerate(seqs):
            s.pending -= 1
            if s.done:
                continue
            top = None
            if got.top_ids is not None and s.params.top_logprobs:
                k = s.params.top_logprobs
                top = list(zip(got.top_ids[i][:k], got.top_logprobs[i][:k], strict=True))
            self._advance(s, got.tokens[i], got.logprobs[i], top, now)

    def _emit_verified(self, s: Sequence, tokens: list[int], logprobs: list[float], tops: list) -> None:
        """A verified draft's tokens out, one by one, until the sequence ends."""
        now = time.perf_counter()
        for t, lp, top in zip(tokens, logprobs, tops, strict=True):
            if s.done:
                break
            if top is not None:
                top = top[: s.params.top_logprobs]
            self._advance(s, t, lp, top, now)

    def forget(self, s: Sequence) -> None:
        """s ended (finished or aborted): per-sequence state elsewhere goes."""
        if self.speculator is not None:
            self.speculator.release(s)
        self._release()

    def _release(self) -> None:
        """A paged runner frees the blocks of the rows that ended (their prompt blocks stay cached)."""
        rows, self.scheduler.released = self.scheduler.released, []
        for row in rows:
            self.runner.reset(row)

    def _advance(self, s: Sequence, token: int, logprob: float, top, now: float) -> None:
        g, m = s.group, self.metrics
        text = s.push(token)
        g.completion_tokens += 1
        if m is not None:
            m.inc("generation_tokens_total")
            if g.first_token_at is None:
                m.observe("time_to_first_token_seconds", now - g.arrival)
            if s.last_token_at is not None:
                m.observe("inter_token_latency_seconds", now - s.last_token_at)
        if g.first_token_at is None:
            g.first_token_at = now
        s.last_token_at = now
        emit(g, Token(s, len(s.generated), token, text, logprob, top, s.finish_reason, now))
        if s.finish_reason is not None:
            self.scheduler.finish(s)
            self.forget(s)
            g.remaining -= 1
            if g.remaining == 0 and not g.cancelled:
                if m is not None:
                    m.observe("e2e_request_latency_seconds", now - g.arrival)
                    m.finished(g.seqs[0].finish_reason or "stop")
                emit(g, Finished(len(g.req.prompt_ids), g.completion_tokens))


def emit(g, ev) -> None:
    """An event to its request's sink; a sink that raises does not stop the engine."""
    try:
        g.sink(ev)
    except Exception:  # noqa: BLE001 - a broken client callback must not kill the engine
        import logging

        logging.getLogger("bitnetlm.engine").exception("event sink failed for request %d", g.id)
