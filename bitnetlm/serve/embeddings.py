"""POST /v1/embeddings (OpenAI's shape, vLLM's extensions) for every served model, and served encoders.

A decoder's embedding runs on its engine's thread between two generation steps (`Engine.call`): the eager
forward without a KV cache touches no runner state, but the runner's kernels (CUDA streams, split-K scratch)
belong to that thread. Inputs go in batches of at most `prefill_chunk` padded tokens, one batch per call, and
while sequences generate the calls take at most half the engine's time, so generation goes on beside a stream
of embedding requests (about half its speed at worst). An encoder (BERT family) is served by
an `EmbeddingEngine` instead: the same surface for the registry, its forwards one at a time on a thread of its
own; the generation routes refuse it with a 400. Tokenizing, pooling's last steps and the JSON or base64 body
run on the offload pool, never on the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import json
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field, field_validator

from bitnetlm import embedding
from bitnetlm.engine.metrics import Metrics
from bitnetlm.serve import protocol as P
from bitnetlm.serve.body import read_body
from bitnetlm.serve.engine import EngineClosed, EngineConfig
from bitnetlm.serve.models import Served, hold

embeddings_router = APIRouter()
MAX_INPUTS = 2048  # inputs in one request, as OpenAI allows
MAX_ROWS = 64  # texts in one forward


class EmbeddingRequest(P._Strict):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None  # accepted for compatibility; unused
    # vLLM extension: cut each input to its first N tokens (special tokens kept); -1: to the model's context
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v):
        def ids(x):
            return isinstance(x, list) and all(type(t) is int for t in x)

        lists = isinstance(v, list) and (all(isinstance(x, str) for x in v) or all(ids(x) for x in v))
        if not (isinstance(v, str) or ids(v) or lists):
            raise ValueError(
                "expected a string, a list of strings, a list of token ids or a list of token-id lists"
            )
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v):
        if v == 0:
            raise ValueError("expected -1 (the model's context) or a positive number of tokens, found 0")
        return v

    def inputs(self) -> list[str | list[int]]:
        """The input(s) as a list of strings or token-id lists; 400 for an empty one."""
        x = self.input
        items = [x] if isinstance(x, str) else [list(x)] if x and isinstance(x[0], int) else list(x)
        if not items:
            raise P.APIError(400, "'input' must not be an empty list", param="input")
        for i, item in enumerate(items):
            if len(item) == 0:
                where = "'input'" if isinstance(x, str) or len(items) == 1 else f"'input[{i}]'"
                raise P.APIError(400, f"{where} must not be empty", param="input")
        if len(items) > MAX_INPUTS:
            raise P.APIError(
                400, f"at most {MAX_INPUTS} inputs per request, found {len(items)}", param="input"
            )
        return items


class EmbeddingEngine:
    """An encoder served for /v1/embeddings only: the part of `Engine`'s surface that the registry, the routes,
    /metrics and the admin listing use. Its forwards run one at a time on a thread of its own (`call`)."""

    def __init__(self, model, tokenizer, config: EngineConfig, model_name: str, max_seq_len: int | None):
        self.model, self.tokenizer, self.config, self.name = model, tokenizer, config, model_name
        limit = embedding.max_tokens(model)
        self.max_model_len = min(limit, max_seq_len) if max_seq_len else limit
        self.vocab_size = model.config.vocab_size
        self.metrics = Metrics(model_name)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bitnet-embed")
        self._accepting = True

    @property
    def accepting(self) -> bool:
        return self._accepting

    def call(self, fn, *args) -> Future:
        """`fn(*args)` on the engine's thread, as `Engine.call`."""
        try:
            if self._accepting:
                return self._pool.submit(fn, *args)
        except RuntimeError:  # (the pool shut down since the check)
            pass
        raise EngineClosed("server is shutting down")

    def check_fits(self, sequences: int, what: str = "") -> None:
        raise ValueError(not_generative(self.name))  # (WebSocket and gRPC requests end here)

    def submit(self, req, sink) -> int:
        raise ValueError(not_generative(self.name))

    def cancel(self, gid: int) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {"running": 0, "waiting": 0, "rows_in_use": 0, "steps": 0, "max_cancel_lag_steps": 0}

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        self._accepting = False
        self._pool.shutdown(wait=drain, cancel_futures=not drain)


def not_generative(name: str) -> str:
    return f"model {name!r} is an embedding model: it answers POST /v1/embeddings, not text generation"


def require_generator(m: Served) -> Served:
    """`m` if it generates text; 400 for an embedding model."""
    if isinstance(m.engine, EmbeddingEngine):
        raise P.APIError(400, not_generative(m.name), param="model", code="model_not_supported")
    return m


# ---- the route --------------------------------------------------------------------------------------
@embeddings_router.post("/v1/embeddings")
async def embeddings(request: Request):
    st = request.app.state.bitnet
    body = await st.offload.json(await read_body(request, st.cfg.max_body_bytes))
    req = P.parse_simple(EmbeddingRequest, body)
    inputs = req.inputs()
    m = hold(request, req.model)
    e = m.engine
    spec = _spec(m, req.dimensions)
    ids = await st.offload.run(_token_ids, m, inputs, req.truncate_prompt_tokens)
    vectors = []
    try:
        for rows in embedding.batches([len(x) for x in ids], MAX_ROWS, e.config.prefill_chunk):
            fut = e.call(embedding.pooled, e.model, [ids[i] for i in rows], spec.pooling)
            vectors.append((rows, await asyncio.wrap_future(fut)))
    except EngineClosed as ex:
        raise P.APIError(503, str(ex), type="server_error", code="shutting_down") from None
    n_tokens = sum(map(len, ids))
    e.metrics.inc("prompt_tokens_total", n_tokens)
    e.metrics.inc("request_success_total")
    use = {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
    body = await st.offload.run(
        _body, m.name, use, vectors, len(ids), (spec.normalize, req.dimensions, req.encoding_format)
    )
    return Response(body, media_type="application/json")


def _spec(m: Served, dimensions: int | None) -> embedding.EmbedSpec:
    """The model's EmbedSpec, with `dimensions` checked as vLLM checks it (Matryoshka models only; the full
    size is always allowed)."""
    try:
        spec = embedding.spec_for(m.engine.model).check()
    except ValueError as ex:
        raise P.APIError(400, f"model {m.name!r} cannot embed: {ex}", param="model") from None
    full = m.engine.model.config.hidden_size * len(spec.pooling)
    if dimensions is None or dimensions == full:
        return spec
    if spec.matryoshka is False:
        raise P.APIError(
            400, f"Model {m.name!r} does not support matryoshka representation, changing output dimensions "
            f"will lead to poor results (its vectors have {full} dimensions).", param="dimensions",
        )  # fmt: skip
    if dimensions > full:
        raise P.APIError(
            400, f"'dimensions' {dimensions} exceeds the model's {full} dimensions", param="dimensions"
        )
    if spec.matryoshka is not True and dimensions not in spec.matryoshka:
        sizes = ", ".join(map(str, (*spec.matryoshka, full)))
        raise P.APIError(
            400, f"Model {m.name!r} supports the matryoshka dimensions {sizes}; found {dimensions}",
            param="dimensions",
        )  # fmt: skip
    return spec


def _token_ids(m: Served, inputs: list[str | list[int]], truncate: int | None) -> list[list[int]]:
    """Each input's token ids (texts with the tokenizer's special tokens), checked against the model's limit
    and vocabulary (on the offload pool)."""
    limit = m.engine.max_model_len
    cut = None if truncate is None else limit if truncate == -1 else min(truncate, limit)
    texts = [x for x in inputs if isinstance(x, str)]
    if cut is None:
        encoded = iter(m.tokenizer.encode_batch(texts, True) if texts else [])
    else:
        encoded = iter(embedding.tokenize(m.tokenizer, texts, cut))
    ids = [next(encoded) if isinstance(x, str) else (x if cut is None else x[:cut]) for x in inputs]
    vocab = m.engine.vocab_size
    for i, x in enumerate(ids):
        where = f"'input[{i}]'" if len(ids) > 1 else "'input'"
        if not x:
            raise P.APIError(400, f"{where} has no tokens", param="input")
        if len(x) > limit:
            raise P.APIError(
                400, f"{where} has {len(x)} tokens; this model's maximum context length is {limit} tokens "
                "(shorten it, or give truncate_prompt_tokens to cut it)",
                param="input", code="context_length_exceeded",
            )  # fmt: skip
        bad = next((t for t in x if not 0 <= t < vocab), None)
        if bad is not None:
            raise P.APIError(
                400, f"{where}: token id {bad} is outside the vocabulary [0, {vocab})", param="input"
            )
    return ids


def _body(model: str, usage: dict, vectors, n: int, how: tuple[bool, int | None, str]) -> bytes:
    """The response as JSON bytes: one embedding object per input, in order, `how` = (normalize, dimensions,
    encoding): floats, or base64 of little-endian float32 as OpenAI's client decodes it. Thousands of vectors
    take a while to encode: here, on the offload pool, not on the event loop."""
    normalize, dimensions, encoding = how
    rows: list = [None] * n
    for idx, got in vectors:
        for i, v in zip(idx, embedding.finish(got, normalize, dimensions)):
            rows[i] = v
    data = []
    for i, v in enumerate(rows):
        value = (
            v.tolist()
            if encoding == "float"
            else base64.b64encode(v.numpy().astype("<f4").tobytes()).decode()
        )
        data.append({"object": "embedding", "index": i, "embedding": value})
    return json.dumps({"object": "list", "data": data, "model": model, "usage": usage}).encode()
