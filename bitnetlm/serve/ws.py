"""WebSocket chat, `/v1/ws`: bidirectional streaming on the same engine as the HTTP routes.

The client sends a chat request (a /v1/chat/completions body, text frame of JSON; `stream` is implied) and gets
its events back as JSON text frames in OpenAI's `chat.completion.chunk` shape: a role chunk, a chunk per text
delta (the last one with `finish_reason`), then a final chunk with `choices: []` and `usage`. A request that
fails (bad body, busy server, cancelled) ends with `{"error": {...}}` instead, in the OpenAI error shape. One
request runs at a time per socket: one sent while another runs starts after it ends. `{"type": "cancel"}` stops
the running request (its final message is then the error with code `request_cancelled`); closing the socket stops
it too. Auth: the HTTP rule (`Authorization: Bearer KEY` or `X-API-Key`), or `?api_key=KEY` in the URL for
clients that cannot set headers (browsers); a refused handshake gets 401.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque

from fastapi import APIRouter, WebSocket

from bitnetlm.serve import protocol as P
from bitnetlm.serve.body import parse_json
from bitnetlm.serve.embeddings import require_generator
from bitnetlm.serve.models import pick
from bitnetlm.serve.relay import CUT, Run
from bitnetlm.serve.requests import Chunk, Failed, Finished
from bitnetlm.serve.responses import _delta
from bitnetlm.serve.routes import _params

ws_router = APIRouter()
_MSG = object()  # a queue item from the socket reader: (_MSG, message or None when the socket closed)


class _Run(Run):
    """A Run whose engine events go to the connection's queue, which the socket reader also feeds."""

    def __init__(self, engine, queue: asyncio.Queue):
        super().__init__(engine)
        self.queue = queue


async def _reader(ws: WebSocket, queue: asyncio.Queue, max_bytes: int) -> None:
    """Every client frame into `queue` as (_MSG, parsed JSON or an APIError); (_MSG, None) once closed."""
    while True:
        msg = await ws.receive()
        if msg["type"] == "websocket.disconnect":
            queue.put_nowait((_MSG, None))
            return
        raw = msg.get("bytes") or (msg.get("text") or "").encode("utf-8", "surrogatepass")
        try:
            if len(raw) > max_bytes:
                raise P.APIError(413, f"message is {len(raw)} bytes; the limit is {max_bytes}")
            queue.put_nowait((_MSG, parse_json(raw)))
        except P.APIError as e:
            queue.put_nowait((_MSG, e))


def _is_cancel(obj) -> bool:
    return isinstance(obj, dict) and obj.get("type") == "cancel"


async def _send(ws: WebSocket, obj) -> None:
    await ws.send_text(json.dumps(obj, ensure_ascii=False))


async def _start(ws: WebSocket, queue: asyncio.Queue, body) -> tuple[_Run, dict, int, int]:
    """Validate and submit a chat request: (run, chunk head, n, prompt tokens); APIError if it cannot start."""
    st = ws.app.state.bitnet
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    req = P.parse_request(P.ChatCompletionRequest, body)
    if req.top_logprobs and not req.logprobs:
        raise P.APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    m = pick(st, req.model)
    try:
        return await _submit(st, queue, req, m)
    finally:
        st.models.release(m)  # (the engine keeps a submitted request's groups until they end)


async def _submit(st, queue: asyncio.Queue, req, m) -> tuple[_Run, dict, int, int]:
    e, name = require_generator(m).engine, m.name
    ids = await st.offload.chat(m.tokenizer, req.messages, req.add_generation_prompt)
    max_tokens = req.effective_max_tokens()
    if max_tokens is None:
        max_tokens = max(1, e.max_model_len - len(ids))
    params = _params(req, max_tokens, req.logprobs, req.top_logprobs or 0)
    run = _Run(e, queue)
    st.runs.add(run)
    run.submit([ids], params, req.n, param="messages")
    head = {
        "id": P.new_id("chatcmpl"),
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": name,
    }
    return run, head, req.n, len(ids)


async def _relay(
    ws: WebSocket, queue: asyncio.Queue, pending: deque, run: _Run, head: dict, n: int, n_prompt: int
) -> bool:
    """Send the run's events until it ends; False when the socket closed meanwhile (the run is cancelled).
    Requests that arrive meanwhile wait in `pending`."""
    role = {"role": "assistant", "content": ""}
    await _send(ws, {**head, "choices": [{"index": i, "delta": role, "logprobs": None, "finish_reason": None}
                                         for i in range(n)]})  # fmt: skip
    completion, offsets, failed = 0, {}, None
    while run.open:
        i, ev = await queue.get()
        if i is _MSG:
            if ev is None:
                run.cancel()
                return False
            if _is_cancel(ev):
                run.cancel()  # the engine answers with Failed(499) for each group
            else:
                pending.append(ev)
            continue
        if i is CUT:
            run.cancel()
            failed = failed or ev
            break
        if isinstance(ev, Chunk):
            c = _delta(ev, ev.index, True, offsets)
            if c is not None:
                await _send(ws, {**head, "choices": [c]})
        elif isinstance(ev, Finished):
            run.open -= 1
            completion += ev.completion_tokens
        elif isinstance(ev, Failed):
            run.open -= 1
            failed = failed or ev
    if failed is None:
        await _send(ws, {**head, "choices": [], "usage": P.usage(n_prompt, completion)})
    else:
        code = "request_cancelled" if failed.status == 499 else None
        kind = "cancelled" if failed.status == 499 else "server_error"
        await _send(ws, P.APIError(failed.status, failed.message, type=kind, code=code).body())
    return True


@ws_router.websocket("/v1/ws")
async def chat_socket(ws: WebSocket):
    await ws.accept()
    st = ws.app.state.bitnet
    queue: asyncio.Queue = asyncio.Queue()
    pending: deque = deque()  # requests sent while another ran, in order
    reader = asyncio.ensure_future(_reader(ws, queue, st.cfg.max_body_bytes))
    try:
        while True:
            tag, body = (_MSG, pending.popleft()) if pending else await queue.get()
            if tag is not _MSG:
                continue  # (a late event of a request already ended)
            if body is None:
                return
            if _is_cancel(body):
                continue  # nothing is running
            try:
                if isinstance(body, P.APIError):
                    raise body
                run, head, n, n_prompt = await _start(ws, queue, body)
            except P.APIError as e:
                await _send(ws, e.body())
                continue
            try:
                if not await _relay(ws, queue, pending, run, head, n, n_prompt):
                    return
            finally:
                if run.open:  # the socket broke mid-send: stop the engine work
                    run.cancel()
    finally:
        reader.cancel()
