"""What the serving engine (engine.py) takes and gives: a request, the events its sink receives, the errors
`submit` raises, and the engine's own record of a request (_Group) and of each of its choices (_Seq)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bitnetlm.generate.sampling import RowRandom, SamplingParams


@dataclass
class GenerationRequest:
    """Token ids in, `n` independent choices out; `params.max_tokens` must fit the context (see submit)."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1


@dataclass
class Chunk:
    """New output of choice `index`: text delta, the token ids behind it, logprob entries, finish reason."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict] | None = None
    finish_reason: str | None = None


@dataclass
class Finished:
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Failed:
    message: str
    status: int = 500


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__("server busy: the request queue is full")
        self.retry_after = retry_after


class ContextTooLong(ValueError):
    pass


class EngineClosed(Exception):
    pass


class _Group:
    def __init__(self, gid: int, req: GenerationRequest, sink: Callable[[Any], None], max_tokens: int):
        self.id, self.req, self.sink, self.max_tokens = gid, req, sink, max_tokens
        self.seqs: list[_Seq] = []
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None
        self.remaining = req.n
        self.completion_tokens = 0
        self.cancelled = False


class _Seq:
    def __init__(self, group: _Group, index: int, detok, stop_ids: set[int]):
        self.group, self.index = group, index
        self.tokens = list(group.req.prompt_ids)  # prompt + generated
        self.n_prompt = len(self.tokens)
        self.n_cached = 0  # tokens whose k/v are in the cache row
        self.row: int | None = None
        self.detok = detok
        self.stop_ids = stop_ids
        self.text = ""  # generated text up to (not including) a stop string
        self.sent = 0  # characters of self.text already emitted
        self.last_token_at: float | None = None
        self.done = False
        self.finish_reason: str | None = None
        # its uniforms (sampling.RowRandom over a seeded generator, or torch's global RNG), set by submit: the host
        # sampler takes one a step, the CUDA-graph rows' sampler the rest of its budget once it decodes
        self.generator: RowRandom | None = None

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.n_prompt :]

    def push(self, t: int) -> tuple[str, str | None]:
        """Token t (already appended to tokens) into the text: (the text to send now, finish reason or None).

        A stop string ends the text before it; text that could begin a stop string is held back until the
        next token decides."""
        finish = None
        if t in self.stop_ids:
            finish = "stop"
            piece = self.detok.finalize()
        else:
            piece = self.detok.add(t)
            if len(self.generated) >= self.group.max_tokens:
                finish = "length"
                piece += self.detok.finalize()
        self.text += piece
        stops = self.group.req.params.stop
        if stops and piece:
            start = max(0, len(self.text) - len(piece) - max(len(x) for x in stops) + 1)
            hits = [i for i in (self.text.find(x, start) for x in stops) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                finish = "stop"
        if finish is None:
            hold = max((len(x) for x in stops), default=1) - 1  # the tail could begin a stop string
            upto = max(self.sent, len(self.text) - hold)
        else:
            upto = len(self.text)
        delta = self.text[self.sent : upto]
        self.sent = upto
        return delta, finish
