"""OpenAI API request models (pydantic) and response builders, with honest rejection of what we do not support.

Request bodies are checked in two passes: first every top-level key must be a parameter we implement (anything
else -> 400 `unsupported_parameter` naming it), then pydantic validates types and ranges (-> 400
`invalid_request_error` naming the field). Types are strict, as JSON gives them: a boolean is not an integer
(`max_tokens: true`), a string is not a number, a number is not a boolean. Parameters OpenAI defines but we
cannot honour (echo, suffix, ...) are accepted only at their neutral value, otherwise rejected by name.

Structured output comes as OpenAI's `response_format` or as vLLM's extensions (`guided_json`, `guided_regex`,
`guided_grammar`, `guided_choice`, `structured_outputs`); `_Sampling.structured` turns whichever was given into
one `StructuredOutput`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from bitnetlm.sampling.structured import StructuredOutput
from bitnetlm.serve.tools import Tools

MAX_STOP = 16  # OpenAI allows 4; more is harmless and some agents send more
MAX_LOGPROBS = 20
MAX_N = 16
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed takes


class APIError(Exception):
    """An error with an OpenAI-style JSON body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    """A request object: unknown keys refused, values taken only as the JSON type they are declared as."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` object: one of its constraints."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(_Strict):
    """Parameters shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # 0 or -1: off (vLLM uses -1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted for compatibility; only ever logged
    ignore_eos: bool = False  # vLLM extension: keep generating past end-of-sequence tokens
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM extensions (structured output)
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None

    def structured(self) -> tuple[StructuredOutput | None, str | None]:
        """(the structured output asked for, the parameter that asked), or (None, None); 400 when several
        parameters ask, or one asks for nothing that can be enforced."""
        given = {
            k: v
            for k, v in (
                ("response_format", _from_response_format(self.response_format)),
                ("guided_json", None if self.guided_json is None else {"json": _schema(self.guided_json)}),
                ("guided_regex", None if self.guided_regex is None else {"regex": self.guided_regex}),
                ("guided_grammar", None if self.guided_grammar is None else {"grammar": self.guided_grammar}),
                ("guided_choice", None if self.guided_choice is None else {"choice": self.guided_choice}),
                ("structured_outputs", _from_vllm(self.structured_outputs)),
            )
            if v is not None
        }
        if len(given) > 1:
            names = ", ".join(repr(k) for k in given)
            raise APIError(
                400, f"give at most one structured output parameter, found {names}", param=list(given)[1]
            )
        if not given:
            return None, None
        [(param, spec)] = given.items()
        try:
            return StructuredOutput.of(spec), param
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return []
        v = [v] if isinstance(v, str) else v
        if len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, found {len(v)}")
        if any(s == "" for s in v):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v):
        if v is not None and not SEED_MIN <= v <= SEED_MAX:
            raise ValueError(f"a seed must be an integer in [{SEED_MIN}, {SEED_MAX}], found {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is None:
            return None
        out = {}
        for k, b in v.items():
            try:
                tid = int(k)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, found {k!r}") from None
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], found {b} for token {tid}")
            out[tid] = float(b)
        return out


def _schema(v: dict | str) -> dict:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise APIError(400, f"guided_json: not valid JSON ({e})", param="guided_json") from None
    if not isinstance(v, dict):
        raise APIError(
            400,
            f"guided_json: a JSON schema must be an object, found {type(v).__name__}",
            param="guided_json",
        )
    return v


def _from_response_format(rf: ResponseFormat | None) -> dict | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return {"json": True}
    if rf.json_schema is None:
        raise APIError(
            400, "response_format of type 'json_schema' needs a 'json_schema' object", param="response_format"
        )
    return {"json": rf.json_schema.schema_ if rf.json_schema.schema_ is not None else True}


def _from_vllm(so: StructuredOutputs | None) -> dict | None:
    if so is None:
        return None
    spec = {
        k: v
        for k, v in (("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar))
        if v is not None
    }
    if so.json_ is not None:
        spec["json"] = _schema(so.json_)
    if so.json_object:
        if spec:
            raise APIError(400, "structured_outputs: give exactly one constraint", param="structured_outputs")
        spec["json"] = True
    return spec


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # the OpenAI default for completions
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list of strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True  # vLLM extension

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def tool_setup(self) -> Tools | None:
        """The tools this request offers the model (None: no tools, or tool_choice "none"); 400 for a choice
        that names no offered tool."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice needs 'tools' to choose from", param="tool_choice")
            return None
        if choice == "none":
            return None
        names = [t.function.name for t in self.tools]
        if len(set(names)) != len(names):
            raise APIError(400, f"tools: function names must be unique, found {names}", param="tools")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise APIError(
                    400, f"tool_choice names function {choice.function.name!r}, which is not among the tools "
                    f"({', '.join(names)})", param="tool_choice",
                )  # fmt: skip
            choice = choice.function.name
        fns = [t.function.model_dump(exclude_none=True) for t in self.tools]
        return Tools(fns, choice or "auto", self.parallel_tool_calls is not False)


# Parameters OpenAI defines that we accept only at their neutral value: name -> (is_neutral(value), why).
_NEUTRAL = {
    "echo": (lambda v: not v, "echo is not supported"),
    "suffix": (lambda v: v is None, "suffix (insertion) is not supported"),
}


def parse_request(cls: type[_Sampling], body: Any) -> _Sampling:
    """Validate a JSON body into `cls`, raising APIError(400) that names the offending parameter(s)."""
    req = parse_simple(cls, body)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if req.seed is not None and req.seed + req.n - 1 > SEED_MAX:  # choice i samples with seed + i
        raise APIError(
            400, f"Invalid value for 'seed': with n={req.n} the seed must be at most {SEED_MAX - req.n + 1} "
            f"(choice i samples with seed + i, and a seed is at most {SEED_MAX}), found {req.seed}",
            param="seed",
        )  # fmt: skip
    bad = [k for k, (ok, _) in _NEUTRAL.items() if k in body and not ok(getattr(req, k))]
    if isinstance(req, CompletionRequest) and req.best_of not in (None, req.n):
        bad.append("best_of")
    if bad:
        why = "; ".join(_NEUTRAL[k][1] if k in _NEUTRAL else "best_of must equal n" for k in bad)
        names = ", ".join(repr(k) for k in bad)
        raise APIError(
            400, f"Unsupported parameter(s): {names}: {why}", param=bad[0], code="unsupported_parameter"
        )
    return req


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def parse_simple(cls: type[BaseModel], body: Any) -> BaseModel:
    """Validate a JSON body into `cls`: 400 naming unknown parameters or the first invalid value."""
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    unknown = sorted(k for k in body if k not in cls.model_fields)
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise APIError(
            400, f"Unsupported parameter(s): {names}", param=unknown[0], code="unsupported_parameter"
        )
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"Invalid value for {loc!r}: {msg}", param=loc) from None


# ---- responses ---------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(entries: list[dict], offset0: int = 0) -> dict[str, Any]:
    """Legacy completions logprobs object from engine entries {token, logprob, top: [(token, logprob)]}."""
    offsets, pos = [], offset0
    for e in entries:
        offsets.append(pos)
        pos += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [_top_dict(e["top"]) for e in entries] if entries and "top" in entries[0] else None,
        "text_offset": offsets,
    }


def _top_dict(top: list[tuple[str, float]]) -> dict[str, float]:
    # the legacy format is a dict: tokens that decode to the same string keep the most likely one
    d: dict[str, float] = {}
    for tok, lp in top:
        d.setdefault(tok, lp)
    return d


def chat_logprobs(entries: list[dict]) -> dict[str, Any]:
    def item(tok, lp):
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

    return {
        "content": [
            {**item(e["token"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e.get("top", [])]}
            for e in entries
        ],
        "refusal": None,
    }


def completion_response(rid: str, model: str, choices: list[dict], use: dict) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": use,
        "system_fingerprint": None,
    }


def chat_response(rid: str, model: str, choices: list[dict], use: dict) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": use,
        "system_fingerprint": None,
    }
