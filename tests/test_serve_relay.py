"""serve/relay.py: the engine thread's events reach the event loop in batches, one wake-up a burst, in order;
a disconnect ends a request's batches and cancels its engine groups. (The routes over it: test_serve.py.)"""

from __future__ import annotations

import asyncio
import threading

from bitnetlm.serve import relay
from bitnetlm.serve.requests import Chunk, Finished


class _Engine:
    """Records `cancel` (the one Engine method `Run.batches` calls)."""

    def __init__(self):
        self.cancelled = []

    def cancel(self, gid):
        self.cancelled.append(gid)


class _Request:
    """An ASGI request whose receive channel reports a disconnect once `gone` is set."""

    def __init__(self):
        self.gone = asyncio.Event()

    async def receive(self):
        await self.gone.wait()
        return {"type": "http.disconnect"}


def test_a_burst_from_another_thread_wakes_the_loop_once_and_keeps_its_order():
    loop = asyncio.new_event_loop()
    wakeups = []
    real = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a: (wakeups.append(a), real(*a))[1]
    try:
        box = relay.Mailbox(loop)
        q1, q2 = asyncio.Queue(), asyncio.Queue()
        t = threading.Thread(target=lambda: [box.put(q1 if i % 3 else q2, i) for i in range(100)])
        t.start()
        t.join()  # the loop has not run: all 100 wait for one flush
        assert len(wakeups) == 1
        loop.run_until_complete(asyncio.sleep(0))
        got1 = [q1.get_nowait() for _ in range(q1.qsize())]
        got2 = [q2.get_nowait() for _ in range(q2.qsize())]
        assert got1 == [i for i in range(100) if i % 3] and got2 == [i for i in range(100) if i % 3 == 0]
        box.put(q1, "later")  # after the flush: a new wake-up
        assert len(wakeups) == 2
        loop.run_until_complete(asyncio.sleep(0))
        assert q1.get_nowait() == "later"
    finally:
        loop.close()


def test_batches_hold_what_arrived_and_end_at_the_last_finish():
    async def go():
        run = relay.Run(_Engine())
        run.gids, run.open = [7, 8], 2
        evs = [
            (0, Chunk(0, "a", [1])),
            (1, Chunk(0, "b", [2])),
            (0, Chunk(0, "c", [3], finish_reason="length")),
            (0, Finished(3, 2)),
        ]
        for e in evs:  # before the consumer runs: one batch
            run.box.put(run.queue, e)
        req = _Request()
        it = run.batches(req)
        first = await it.__anext__()
        run.box.put(run.queue, (1, Finished(3, 1)))
        second = await it.__anext__()
        rest = [b async for b in it]
        return first, second, rest, run

    first, second, rest, run = asyncio.run(go())
    assert [i for i, _ in first] == [0, 1, 0, 0] and first[1][1].text == "b"
    assert len(second) == 1 and isinstance(second[0][1], Finished)
    assert rest == [] and run.open == 0 and run.engine.cancelled == []


def test_a_disconnect_ends_the_batches_and_cancels_the_groups():
    async def go():
        run = relay.Run(_Engine())
        run.gids, run.open = [3], 1
        req = _Request()
        it = run.batches(req)
        run.box.put(run.queue, (0, Chunk(0, "x", [4])))
        assert [e.text for _, e in await it.__anext__()] == ["x"]
        req.gone.set()
        return [b async for b in it], run

    rest, run = asyncio.run(go())
    assert rest == [] and run.engine.cancelled == [3]
