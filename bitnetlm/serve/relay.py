"""The engine's events relayed to the HTTP layer's event loop, in batches.

The engine thread calls a request's sink once per event: a token's Chunk for every running sequence at every
step. Handing each one over with its own `call_soon_threadsafe` wakes the loop (a self-pipe write) per token,
and relaying each one as its own SSE write sends it through every ASGI middleware's `send` and a socket write.
With tens of streams both hold the GIL that the engine thread needs for its next step. So:
- a `Mailbox` per loop queues the events of every request and wakes the loop once for all that arrive before
  it runs;
- `Run.batches` yields every event a request has waiting, and the streaming route writes them as one chunk of
  SSE frames (each frame unchanged, so clients see the same events).
(On an H200 with 1-32 clients this measured a tie with one wake-up and one write per event, and costs no
more at 32 streams: docs/PERF_LOG.md.)
A client that disconnects is noticed by a watcher on the ASGI receive channel, which puts `GONE` in the queue.
At shutdown, a run still going when the graceful timeout expires is `cut`: it ends with a Failed event (a stream
with an error event and [DONE]) instead of a connection dropped mid-body.
"""

from __future__ import annotations

import asyncio
import json
import threading
import weakref
from collections.abc import AsyncIterator
from typing import Any

from bitnetlm.serve import protocol as P
from bitnetlm.serve.engine import Engine
from bitnetlm.serve.requests import (
    ContextTooLong,
    EngineClosed,
    Failed,
    Finished,
    GenerationRequest,
    NeverFits,
    QueueFull,
)

GONE = object()  # queued by the disconnect watcher
CUT = object()  # queued by `Run.cut`, with the Failed event that ends the run

# Characters that str.splitlines (and so httpx's aiter_lines) breaks a line at, which JSON leaves raw outside ASCII:
# escaped, so that a data line holding one (a sampled token's text can) stays one line for every SSE client.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: Any) -> str:
    """One server-sent event: `data: <JSON>` and a blank line."""
    return sse_json(json.dumps(obj, ensure_ascii=False))


def sse_json(text: str) -> str:
    """The event of an already encoded JSON text."""
    return f"data: {text.translate(_LINE_BREAKS)}\n\n"


class Mailbox:
    """Cross-thread delivery into one event loop's asyncio queues, one wake-up for a burst of events."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: list[tuple[asyncio.Queue, Any]] = []
        self.lock = threading.Lock()
        self.scheduled = False

    def put(self, queue: asyncio.Queue, item: Any) -> None:
        """Called from any thread: `item` into `queue` on the loop."""
        with self.lock:
            self.items.append((queue, item))
            if self.scheduled:
                return
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop closed (shutdown): nobody reads these
            pass

    def _flush(self) -> None:
        with self.lock:
            items, self.items, self.scheduled = self.items, [], False
        for q, item in items:
            q.put_nowait(item)


_mailboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def mailbox(loop: asyncio.AbstractEventLoop) -> Mailbox:
    if loop not in _mailboxes:
        _mailboxes[loop] = Mailbox(loop)
    return _mailboxes[loop]


async def _wait_disconnect(request, queue: asyncio.Queue) -> None:
    # after the body is read, the server's receive() returns only when the client goes away
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            queue.put_nowait((None, GONE))
            return


class Run:
    """Submitted engine groups for one HTTP request, with events delivered to an asyncio queue."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.box = mailbox(asyncio.get_running_loop())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.gids: list[int] = []
        self.open = 0  # groups not yet Finished/Failed

    def submit(self, prompts: list[list[int]], params, n: int, param: str = "prompt") -> None:
        try:
            what = f" ({len(prompts)} prompts x n={n})" if len(prompts) > 1 else f" (n={n})"
            self.engine.check_fits(len(prompts) * n, what)
            for i, ids in enumerate(prompts):

                def sink(ev, i=i):
                    self.box.put(self.queue, (i, ev))

                self.gids.append(self.engine.submit(GenerationRequest(ids, params, n), sink))
                self.open += 1
        except QueueFull as e:
            self.cancel()
            raise P.APIError(
                429,
                "The server is busy: the request queue is full. Retry later.",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(e.retry_after)},
            ) from None
        except NeverFits as e:
            self.cancel()
            raise P.APIError(400, str(e), param="n") from None
        except ContextTooLong as e:
            self.cancel()
            raise P.APIError(400, str(e), param=param, code="context_length_exceeded") from None
        except EngineClosed as e:
            self.cancel()
            raise P.APIError(503, str(e), type="server_error", code="shutting_down") from None
        except ValueError as e:
            self.cancel()
            raise P.APIError(400, str(e)) from None

    def cancel(self) -> None:
        for g in self.gids:
            self.engine.cancel(g)

    def cut(self, message: str) -> None:
        """End the run now with a Failed(503) event (on the run's event loop): the engine work is cancelled."""
        if self.open:
            self.queue.put_nowait((CUT, Failed(message, status=503)))

    async def batches(self, request) -> AsyncIterator[list[tuple[int, Any]]]:
        """Lists of (prompt index, event), each what had arrived, until every group finished; cancels
        everything if the client disconnects."""
        watcher = asyncio.ensure_future(_wait_disconnect(request, self.queue))
        try:
            while self.open:
                got = [await self.queue.get()]
                while not self.queue.empty():
                    got.append(self.queue.get_nowait())
                batch = []
                for i, ev in got:
                    if ev is GONE:
                        return  # client gone: the finally clause cancels the engine work
                    if i is CUT:
                        yield [*batch, (0, ev)]
                        return  # the finally clause cancels the engine work
                    if isinstance(ev, (Finished, Failed)):
                        self.open -= 1
                    batch.append((i, ev))
                yield batch
        finally:
            watcher.cancel()
            if self.open:
                self.cancel()
