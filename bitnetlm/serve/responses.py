"""A generation's events as the OpenAI API returns them: one JSON body, or a stream of server-sent events."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi.responses import Response, StreamingResponse

from bitnetlm.serve import protocol as P
from bitnetlm.serve.relay import Run, sse, sse_json
from bitnetlm.serve.requests import Chunk, Failed, Finished
from bitnetlm.serve.tools import Tools, ToolStream


async def respond(
    request,
    run: Run,
    model_name: str,
    req,
    n_prompt: int,
    want_lp: bool,
    chat: bool,
    tools: Tools | None = None,
):
    """The HTTP response for a submitted `run`: a stream of events, or the whole body once every choice ends.
    With `tools` offered, a reply that calls them comes back as `tool_calls` (serve/tools.py)."""
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        gen = stream(request, run, rid, model_name, req.n, n_prompt, chat, include_usage, tools)
        return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    texts: dict[int, str] = {}
    lps: dict[int, list] = {}
    finish: dict[int, str] = {}
    detail: dict[int, str] = {}
    completion = 0
    async for batch in run.batches(request):
        for i, ev in batch:
            if isinstance(ev, Chunk):
                idx = i * req.n + ev.index
                texts[idx] = texts.get(idx, "") + ev.text
                lps.setdefault(idx, []).extend(ev.logprobs or [])
                if ev.finish_reason:
                    finish[idx] = ev.finish_reason
                if ev.finish_detail:
                    detail[idx] = ev.finish_detail
            elif isinstance(ev, Finished):
                completion += ev.completion_tokens
            elif isinstance(ev, Failed):
                run.cancel()
                raise P.APIError(ev.status, ev.message, type="server_error")
    if run.open:  # the client went away; nobody reads this
        return Response(status_code=499)
    choices = [
        _detailed(
            _choice(idx, texts[idx], lps[idx] if want_lp else None, finish.get(idx), chat, tools),
            detail.get(idx),
        )
        for idx in sorted(texts)
    ]
    build = P.chat_response if chat else P.completion_response
    return build(rid, model_name, choices, P.usage(n_prompt, completion))


def _detailed(choice: dict, detail: str | None) -> dict:
    """A choice with `finish_detail` (why it finished, where the reason alone does not say: "length" at a full
    context window) when there is one; an extra field that OpenAI clients ignore."""
    if detail:
        choice["finish_detail"] = detail
    return choice


def _choice(idx: int, text: str, lps: list | None, finish: str | None, chat: bool, tools=None) -> dict:
    if chat:
        lp = P.chat_logprobs(lps) if lps is not None else None
        message = {"role": "assistant", "content": text}
        calls = tools.parse(text) if tools is not None else None
        if calls:
            message = {"role": "assistant", "content": None, "tool_calls": calls}
            finish = "tool_calls" if finish == "stop" else finish
        return {"index": idx, "message": message, "logprobs": lp, "finish_reason": finish}
    lp = P.completion_logprobs(lps) if lps is not None else None
    return {"index": idx, "text": text, "logprobs": lp, "finish_reason": finish}


async def stream(
    request, run: Run, rid, model_name, n, n_prompt, chat, include_usage, tools=None
) -> AsyncIterator[str]:
    """Server-sent events: a chunk per visible text delta (and finish), then usage if asked for, then [DONE]; a
    failed or cut generation ends with an error event and [DONE]."""
    created = int(time.time())
    calls: dict[int, ToolStream] = {}
    obj = "chat.completion.chunk" if chat else "text_completion"
    completion = 0
    offsets: dict[int, int] = {}
    # every frame's JSON up to its choices, encoded once (the same text json.dumps gives the whole dict)
    head = json.dumps({"id": rid, "object": obj, "created": created, "model": model_name}, ensure_ascii=False)
    head = head[:-1] + ', "choices": '

    def frame(choices, usage=None):
        tail = f', "usage": {json.dumps(usage)}}}' if include_usage else "}"
        return sse_json(head + json.dumps(choices, ensure_ascii=False) + tail)

    if chat:
        role = {"role": "assistant", "content": ""}
        yield frame(
            [
                {"index": i, "delta": role, "logprobs": None, "finish_reason": None}
                for i in range(len(run.gids) * n)
            ]
        )
    async for batch in run.batches(request):
        out = []  # the batch's frames, sent in one write
        for i, ev in batch:
            if isinstance(ev, Chunk) and tools is not None:
                ts = calls.setdefault(i * n + ev.index, ToolStream(tools))
                for delta, lps, fin in ts.feed(ev.text, ev.logprobs or [], ev.finish_reason):
                    lp = P.chat_logprobs(lps) if lps else None
                    c = {"index": i * n + ev.index, "delta": delta, "logprobs": lp, "finish_reason": fin}
                    out.append(frame([c]))
            elif isinstance(ev, Chunk):
                c = _delta(ev, i * n + ev.index, chat, offsets)
                if c is not None:
                    out.append(frame([c]))
            elif isinstance(ev, Finished):
                completion += ev.completion_tokens
            elif isinstance(ev, Failed):  # an error event, then the end every SSE client waits for
                err = {"message": ev.message, "type": "server_error", "param": None, "code": None}
                yield "".join(out) + sse({"error": err}) + "data: [DONE]\n\n"
                return
        if out:
            yield "".join(out)
    if run.open:
        return  # client disconnected
    if include_usage:
        yield frame([], P.usage(n_prompt, completion))
    yield "data: [DONE]\n\n"


def _delta(ev: Chunk, idx: int, chat: bool, offsets: dict[int, int]) -> dict | None:
    """One choice's streamed delta, or None while nothing is visible yet (an incomplete character or the start
    of a possible stop string is held back)."""
    if not ev.text and not ev.finish_reason and not ev.logprobs:
        return None
    if chat:
        c = {
            "index": idx,
            "delta": {"content": ev.text} if ev.text or not ev.finish_reason else {},
            "logprobs": P.chat_logprobs(ev.logprobs) if ev.logprobs else None,
            "finish_reason": ev.finish_reason,
        }
        return _detailed(c, ev.finish_detail)
    off = offsets.get(idx, 0)
    offsets[idx] = off + len(ev.text)
    c = {
        "index": idx,
        "text": ev.text,
        "logprobs": P.completion_logprobs(ev.logprobs, off) if ev.logprobs else None,
        "finish_reason": ev.finish_reason,
    }
    return _detailed(c, ev.finish_detail)
