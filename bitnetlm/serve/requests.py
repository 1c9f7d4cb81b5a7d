"""What the serving engine (engine.py) takes and gives: a request, the events its sink receives and the errors
`submit` raises. The request and the end events are the engine core's (`bitnetlm.engine.sequence`)."""

from __future__ import annotations

from dataclasses import dataclass

from bitnetlm.engine.sequence import Failed, Finished, GenerationRequest

__all__ = [
    "Chunk",
    "ContextTooLong",
    "EngineClosed",
    "Failed",
    "Finished",
    "GenerationRequest",
    "NeverFits",
    "QueueFull",
]


@dataclass
class Chunk:
    """New output of choice `index`: text delta, the token ids behind it, logprob entries, finish reason (and why,
    where the reason alone does not say: a full context window)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict] | None = None
    finish_reason: str | None = None
    finish_detail: str | None = None


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__("server busy: the request queue is full")
        self.retry_after = retry_after


class ContextTooLong(ValueError):
    pass


class NeverFits(ValueError):
    """More sequences than the engine ever holds at once (every row running and the queue full): waiting would
    not help, so this is the request's fault, not a busy server's."""


class EngineClosed(Exception):
    pass
