"""WebSocket chat (/v1/ws) against a real server with the `websockets` client.

Oracle: the HTTP route through the official openai client (and offline `generate`) on the same model; the engine's
own counters for cancellation.
"""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest
from serve_parts import tiny_model_and_tokenizer

from bitnetlm.generate import SamplingParams, generate
from bitnetlm.serve import start

websockets = pytest.importorskip("websockets")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
KEY = "sk-ws-test"
MSGS = [{"role": "user", "content": "Tell me about the fox."}]


@pytest.fixture(scope="module")
def mt():
    return tiny_model_and_tokenizer(max_len=512)


@pytest.fixture(scope="module")
def server(mt):
    model, tok = mt
    h = start(model, tok, port=0, max_batch=4, api_key=KEY, log_level="warning")
    yield h
    h.stop()


def _ws_url(server, query=""):
    return server.url.replace("http://", "ws://") + "/v1/ws" + query


async def _collect(ws) -> list[dict]:
    """Messages up to and including a request's final one (usage chunk or error)."""
    out = []
    while True:
        m = json.loads(await ws.recv())
        out.append(m)
        if "error" in m or m.get("choices") == []:
            return out


def _text(msgs: list[dict]) -> str:
    return "".join(c["delta"].get("content") or "" for m in msgs for c in m.get("choices", []))


def _wait(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_ws_chat_equals_http_and_several_requests_in_turn(mt, server):
    model, tok = mt
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    http = client.chat.completions.create(model="bitnet", messages=MSGS, max_tokens=16, temperature=0)
    ref = generate(model, tok, MSGS, SamplingParams(max_tokens=16, temperature=0))
    assert http.choices[0].message.content == str(ref)

    async def go():
        hdr = {"Authorization": f"Bearer {KEY}"}
        async with websockets.connect(_ws_url(server), additional_headers=hdr) as ws:
            body = json.dumps({"model": "bitnet", "messages": MSGS, "max_tokens": 16, "temperature": 0})
            await ws.send(body)
            results = [await _collect(ws)]
            await ws.send(body)  # two more at once: the second waits for the first
            await ws.send(body.replace('"max_tokens": 16', '"max_tokens": 3'))
            results += [await _collect(ws), await _collect(ws)]
            await ws.send(json.dumps({"messages": MSGS, "max_tokens": 0}))  # invalid: an error, socket stays
            results.append(await _collect(ws))
            return results

    a, b, c, bad = asyncio.run(go())
    assert c[-1]["usage"]["completion_tokens"] == 3
    for msgs in (a, b):
        assert msgs[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(m["object"] == "chat.completion.chunk" for m in msgs)
        assert _text(msgs) == http.choices[0].message.content
        finish = [c["finish_reason"] for m in msgs for c in m["choices"] if c["finish_reason"]]
        assert finish == [http.choices[0].finish_reason]
        assert msgs[-1]["usage"] == http.usage.model_dump(exclude_none=True)
    assert bad[-1]["error"]["param"] == "max_tokens" and len(bad) == 1


def test_ws_cancel_by_message_and_by_close_stops_the_engine(server):
    eng = server.engine
    long = {"messages": MSGS, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    before = eng.metrics.counters["request_cancelled_total"]

    async def cancel_by_message():
        async with websockets.connect(_ws_url(server, f"?api_key={KEY}")) as ws:
            await ws.send(json.dumps(long))
            for _ in range(3):  # role chunk and two deltas: it is generating
                await ws.recv()
            await ws.send(json.dumps({"type": "cancel"}))
            msgs = await _collect(ws)
            await ws.send(json.dumps({**long, "max_tokens": 4}))  # the socket serves the next request
            return msgs, await _collect(ws)

    msgs, after = asyncio.run(cancel_by_message())
    assert msgs[-1]["error"]["code"] == "request_cancelled"
    n_tokens = sum(1 for m in msgs for c in m.get("choices", []) if c["delta"].get("content") is not None)
    assert n_tokens < 400
    assert after[-1]["usage"]["completion_tokens"] == 4
    assert eng.metrics.counters["request_cancelled_total"] == before + 1

    async def close_mid_stream():
        async with websockets.connect(_ws_url(server, f"?api_key={KEY}")) as ws:
            await ws.send(json.dumps(long))
            for _ in range(3):
                await ws.recv()
            assert eng.stats()["running"] == 1

    asyncio.run(close_mid_stream())
    assert _wait(lambda: eng.metrics.counters["request_cancelled_total"] == before + 2)
    assert _wait(lambda: eng.stats()["running"] == 0 and eng.stats()["rows_in_use"] == 0)


def test_ws_needs_the_api_key(server):
    async def attempt(url, headers=None):
        try:
            async with websockets.connect(url, additional_headers=headers) as ws:
                await ws.send(json.dumps({"messages": MSGS, "max_tokens": 2}))
                return (await _collect(ws))[-1]
        except websockets.InvalidStatus as e:
            return e.response.status_code

    assert asyncio.run(attempt(_ws_url(server))) == 401
    assert asyncio.run(attempt(_ws_url(server, "?api_key=wrong"))) == 401
    assert asyncio.run(attempt(_ws_url(server), {"Authorization": "Bearer wrong"})) == 401
    assert asyncio.run(attempt(_ws_url(server), {"X-API-Key": KEY}))["usage"]["completion_tokens"] >= 1
