"""Tool calling on /v1/chat/completions: the tools into the prompt, the model's answer back into `tool_calls`.

Prompt: the messages (assistant `tool_calls` with their arguments as objects, `tool` results) and the tools go
to the model's chat template as transformers passes them (`tools=`). A template that never mentions tools gets
them in a system message instead, with the instruction to answer a call as a JSON object (llama.cpp's generic
fallback): `{"name": ..., "parameters": {...}}`, several as a JSON array.

Answer: a reply that is such JSON (LLaMA-3.1 style; "arguments" is taken for "parameters"; several objects may
follow each other, separated by ";" or whitespace, or sit in an array) naming offered tools becomes
`tool_calls`, with finish_reason "tool_calls"; anything else stays content. With tool_choice "required" or a named
function the reply is constrained to that JSON by a schema built from the tools' parameter schemas, so it
always parses.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from bitnetlm.sampling.structured import StructuredOutput

FALLBACK = (
    "You have access to the following functions. To call a function, respond with only a JSON object in the "
    'format {"name": function name, "parameters": object of argument names and their values}'
)
FALLBACK_PARALLEL = "; to call several functions at once, respond with a JSON array of such objects"


@dataclass
class Tools:
    """The tools a request offers (OpenAI `function` objects), its tool_choice ("auto", "required" or a
    function's name) and whether several calls may come at once."""

    functions: list[dict[str, Any]]
    choice: str = "auto"
    parallel: bool = True

    @property
    def named(self) -> str | None:
        return None if self.choice in ("auto", "required") else self.choice

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def structured(self) -> StructuredOutput | None:
        """The JSON schema a forced call must match (None for "auto")."""
        if not self.forced:
            return None
        calls = [_call_schema(f) for f in self.functions if self.named in (None, f["name"])]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if self.parallel and self.named is None:
            return StructuredOutput(json={"type": "array", "items": one, "minItems": 1})
        return StructuredOutput(json=one)

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        """The OpenAI `tool_calls` in a reply, or None when it is not a call of offered tools."""
        calls = parse_calls(text)
        names = {f["name"] for f in self.functions}
        if not calls or any(name not in names for name, _ in calls):
            return None
        if not self.parallel:
            calls = calls[:1]
        return [
            {
                "id": "call_" + uuid.uuid4().hex[:24],
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
            }
            for name, args in calls
        ]


def _call_schema(f: dict) -> dict:
    params = f.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": f["name"]}, "parameters": params},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def parse_calls(text: str) -> list[tuple[str, dict]] | None:
    """[(name, arguments)] of the JSON calls `text` consists of (an object, several separated by ";" or
    whitespace, or an array of them), or None when it is anything else."""
    dec, s, i, out = json.JSONDecoder(), text.strip().removeprefix("<|python_tag|>"), 0, []
    while i < len(s):
        try:
            obj, i = dec.raw_decode(s, i)
        except ValueError:
            return None
        for o in obj if isinstance(obj, list) else [obj]:
            call = _one_call(o)
            if call is None:
                return None
            out.append(call)
        while i < len(s) and (s[i].isspace() or s[i] in ";,"):
            i += 1
    return out or None


def _one_call(o: Any) -> tuple[str, dict] | None:
    if not isinstance(o, dict) or not isinstance(o.get("name"), str):
        return None
    args = o.get("parameters", o.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string, as the API returns them
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (o["name"], args) if isinstance(args, dict) else None


def supports_tools(template: str | None) -> bool:
    """The chat template renders tools itself (as transformers' and vLLM's templates with tool support do)."""
    return bool(template) and "tools" in template


def template_messages(messages: list, tools: Tools | None, native: bool) -> list[dict[str, Any]]:
    """The request's messages as chat templates take them: assistant tool calls with their arguments as
    objects; without a template that renders tools (`native` False), the tools in a system message and earlier
    calls as the JSON the model was asked to write."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = [
                {"name": c.function.name, "arguments": _args(c.function.arguments)} for c in m.tool_calls
            ]
            if native:
                d["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": call}
                    for c, call in zip(m.tool_calls, calls, strict=True)
                ]
            else:
                shown = [{"name": c["name"], "parameters": c["arguments"]} for c in calls]
                d["content"] = json.dumps(shown[0] if len(shown) == 1 else shown, ensure_ascii=False)
        out.append(d)
    if tools is not None and not native:
        text = FALLBACK + (FALLBACK_PARALLEL if tools.parallel else "") + ".\n\n"
        text += "\n".join(json.dumps(f, ensure_ascii=False) for f in tools.functions)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _args(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # (a template shows it as it came)


def stream_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The streamed `tool_calls` deltas of `calls` (OpenAI's shape): for each call, its id, type and name with
    empty arguments, then its arguments."""
    out = []
    for i, c in enumerate(calls):
        head = {
            "index": i,
            "id": c["id"],
            "type": "function",
            "function": {"name": c["function"]["name"], "arguments": ""},
        }
        out.append({"tool_calls": [head]})
        out.append({"tool_calls": [{"index": i, "function": {"arguments": c["function"]["arguments"]}}]})
    return out


class ToolStream:
    """One streamed choice's deltas when tools are offered: text streams as content until the reply shows it is
    a call (it opens with JSON, or a call is forced); a call is held to the end, then sent as `tool_calls` deltas
    (content, when it does not parse after all)."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.held: str | None = ""  # None: streaming as content
        self.logprobs: list = []

    def feed(self, text: str, logprobs: list, finish: str | None) -> list[tuple[dict, list, str | None]]:
        """(delta, logprobs, finish_reason) to send for one chunk of the choice's text."""
        if self.held is None:
            return (
                [({"content": text} if text or not finish else {}, logprobs, finish)]
                if text or finish or logprobs
                else []
            )
        self.held += text
        self.logprobs += logprobs
        head = self.held.lstrip()
        if not finish and (not head or self.tools.forced or head[0] in "{["):
            return []  # still undecided, or a call
        calls = self.tools.parse(self.held) if finish else None
        if calls:
            out = [(d, [], None) for d in stream_deltas(calls)]
            return [*out, ({}, [], "tool_calls" if finish == "stop" else finish)]
        text, lps, self.held, self.logprobs = self.held, self.logprobs, None, []
        return [({"content": text} if text or not finish else {}, lps, finish)]
