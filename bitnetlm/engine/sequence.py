"""What the engine schedules and runs: a request (one prompt, n choices) and its sequences (one per choice).

Plain data and text bookkeeping, no tensors: the scheduler plans from these fields, the worker advances them. A
sequence's text goes through a streaming detokenizer and the stop conditions here, once for every front
(offline generation and the server alike).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bitnetlm.sampling import RowRandom, SamplingParams
from bitnetlm.text.detok import StreamDetokenizer

_ids = itertools.count(1)


@dataclass
class GenerationRequest:
    """Token ids in, `n` independent choices out."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1


@dataclass
class Token:
    """A sampled token of choice `seq.index` (its `count`-th): the text it makes visible (may be ""), its
    log-probability, the top log-probabilities [(id, logprob)] when asked for, and the finish reason once the
    choice ends (with `seq.finish_detail` saying why where "length" is the context window's)."""

    seq: Sequence
    count: int
    token: int
    text: str
    logprob: float
    top: list[tuple[int, float]] | None
    finish_reason: str | None
    time: float


@dataclass
class Finished:
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Failed:
    message: str
    status: int = 500


class Group:
    """One request: its choices, where its events go (`sink`, called on the engine's thread), its timing."""

    def __init__(self, req: GenerationRequest, sink: Callable[[Any], None], max_tokens: int | None = None):
        self.id = next(_ids)
        self.req, self.sink = req, sink
        self.max_tokens = req.params.max_tokens if max_tokens is None else max_tokens
        self.seqs: list[Sequence] = []
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None
        self.remaining = req.n
        self.completion_tokens = 0
        self.cancelled = False
        self.length_detail: str | None = None  # why max_tokens is what it is, when the context window cut it

    @property
    def params(self) -> SamplingParams:
        return self.req.params


class Sequence:
    """One choice: its tokens, its place in the KV cache and its streamed text.

    n_cached counts the tokens whose keys and values are in its row or queued to be written there; `pending`
    counts sampled tokens on their way to the host (a pipelined step's)."""

    def __init__(
        self,
        group: Group,
        index: int,
        detok: StreamDetokenizer,
        stop_ids: set,
        random: RowRandom,
        shift_keep: int | None = None,
        constraint=None,
    ):
        self.group, self.index = group, index
        self.tokens = list(group.req.prompt_ids)  # prompt + generated
        self.n_prompt = len(self.tokens)
        # positions a prefill fills before the first decode: the prompt, or after a preemption every token its
        # row held (it is prefilled again, mostly from the prefix cache, and goes on)
        self.n_fill = self.n_prompt
        self.n_cached = 0
        # the most positions its row has had written (a verify writes its draft past n_cached)
        self.written = 0
        # context shift: the positions kept at the start of its row (None: it never shifts), and the tokens
        # dropped from the row so far (its row holds tokens[:keep] + tokens[keep + shifted:])
        self.shift_keep = shift_keep
        self.shifted = 0
        self.pending = 0
        self.row: int | None = None
        self.detok, self.stop_ids, self.random = detok, stop_ids, random
        self.text = ""  # visible output so far (stop strings cut)
        self.held = ""  # text held back: it may be the start of a stop string
        self.last_token_at: float | None = None
        self.done = False
        self.finish_reason: str | None = None
        self.finish_detail: str | None = None  # why it ended, where the reason alone does not say
        self.drafted = self.accepted = 0  # speculative decoding: draft tokens scored, and accepted
        self.preemptions = 0  # times a full paged KV cache sent it back to the queue (engine/scheduler.py)
        self.constraint = constraint  # structured output (engine/grammar.py): the tokens allowed next

    @property
    def params(self) -> SamplingParams:
        return self.group.req.params

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.n_prompt :]

    def row_tokens(self, start: int, end: int) -> list[int]:
        """The tokens at positions [start, end) of its row (a shifted row holds tokens[:keep] + tokens[keep +
        shifted:])."""
        if not self.shifted:
            return self.tokens[start:end]
        k = self.shift_keep
        return (self.tokens[:k] + self.tokens[k + self.shifted :])[start:end]

    @property
    def budget(self) -> int:
        """Tokens it may still sample (those on their way to the host counted)."""
        return self.group.max_tokens - len(self.generated) - self.pending

    def push(self, token: int) -> str:
        """Record a sampled token; return the text it makes visible and set finish_reason when the choice ends."""
        self.tokens.append(token)
        c = self.constraint
        if c is not None:
            c.consume(token)
        if token in self.stop_ids:  # never shown; flush an incomplete character held by the detokenizer
            self.finish_reason = "stop"
            return self._scan(self.detok.finalize(), final=True)
        text = self._scan(self.detok.add(token), final=False)
        if self.finish_reason is None and c is not None and c.stopped:  # the grammar allows nothing more
            self.finish_reason = "stop"
            text += self._scan(self.detok.finalize(), final=True)
        if self.finish_reason is None and len(self.generated) >= self.group.max_tokens:
            self.finish_reason = "length"
            self.finish_detail = self.group.length_detail
            text += self._scan(self.detok.finalize(), final=True)
        return text

    def _scan(self, delta: str, final: bool) -> str:
        """Add decoded text; return the part that is safe to show (a stop string is cut and ends the choice)."""
        buf, self.held = self.held + delta, ""
        stops = self.params.stop
        if stops:
            hits = [i for i in (buf.find(s) for s in stops) if i >= 0]
            if hits:
                self.finish_reason = "stop"
                buf = buf[: min(hits)]
            elif not final:  # hold back the longest tail that could still grow into a stop string
                keep = max(
                    (
                        n
                        for s in stops
                        for n in range(min(len(s) - 1, len(buf)), 0, -1)
                        if buf.endswith(s[:n])
                    ),
                    default=0,
                )
                buf, self.held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        self.text += buf
        return buf
