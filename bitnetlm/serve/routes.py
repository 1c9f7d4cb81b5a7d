"""The HTTP routes: OpenAI's completions, chat completions and models, tokenize / detokenize, health, metrics and
the web chat page. Each turns a request into token ids + SamplingParams for the engine (app.state.bitnet)."""

from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse

from bitnetlm.deps import MissingDependency
from bitnetlm.engine.metrics import render_many
from bitnetlm.sampling import SamplingParams
from bitnetlm.serve import protocol as P
from bitnetlm.serve.body import read_body
from bitnetlm.serve.embeddings import require_generator
from bitnetlm.serve.engine import Engine
from bitnetlm.serve.models import Served, hold
from bitnetlm.serve.relay import Run
from bitnetlm.serve.responses import respond
from bitnetlm.serve.tools import Tools

router = APIRouter()


# ---- helpers ------------------------------------------------------------------------------------------
def _state(request: Request):
    return request.app.state.bitnet


def _engine(request: Request) -> Engine:
    st = _state(request)
    if st.engine is None:
        msg = f"model failed to load: {st.error}" if st.error else "model is loading"
        raise P.APIError(503, msg, type="server_error", code="model_loading", headers={"Retry-After": "5"})
    if not st.engine.accepting:
        raise P.APIError(503, "server is shutting down", type="server_error", code="shutting_down")
    return st.engine


def _check_model(request: Request, name: str | None) -> Served:
    """The model `name` names (None: the default), held until the request ends; 404 for an unknown one."""
    return hold(request, name)


async def _read_json(request: Request) -> Any:
    st = _state(request)
    return await st.offload.json(await read_body(request, st.cfg.max_body_bytes))


async def _structured(request: Request, e: Engine, req: P._Sampling, tools: Tools | None = None):
    """The request's structured output (asked for, or a forced tool call's schema), compiled once here (on the
    pool) so that what cannot be enforced is a 400 naming it, before the request is queued."""
    so, param = req.structured()
    if tools is not None and tools.forced:
        if so is not None:
            raise P.APIError(
                400, f"tool_choice {tools.choice!r} and {param!r} cannot be combined", param=param
            )
        so, param = tools.structured(), "tools"
    if so is not None:
        try:
            await _state(request).offload.run(e.core.compile, so)
        except MissingDependency as ex:
            raise P.APIError(501, str(ex), type="server_error", param=param, code="not_implemented") from None
        except ValueError as ex:
            raise P.APIError(400, str(ex), param=param) from None
    return so


def _params(
    req: P._Sampling, max_tokens: int, logprobs: bool, top_logprobs: int, structured=None
) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_k=max(req.top_k, 0),
        top_p=req.top_p,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        seed=req.seed,
        logit_bias=req.logit_bias,
        stop=list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        structured=structured,
    )


async def _generate(request: Request, m: Served, ids, params: SamplingParams, req, chat: bool, tools=None):
    run = Run(m.engine)
    _state(request).runs.add(run)
    run.submit(ids, params, req.n, param="messages" if chat else "prompt")
    n_prompt = sum(len(x) for x in ids)
    return await respond(request, run, m.name, req, n_prompt, params.logprobs, chat, tools)


# ---- routes -------------------------------------------------------------------------------------------
@router.get("/health")
async def health(request: Request):
    st = _state(request)
    if st.engine is None:
        status = "error" if st.error else "loading"
        return JSONResponse({"status": status, "error": st.error}, status_code=503)
    if not st.engine.accepting:
        return JSONResponse({"status": "draining"}, status_code=503)
    return {"status": "ok"}


@router.get("/", response_class=HTMLResponse)
@router.get("/index.html", response_class=HTMLResponse)
async def index():
    page = resources.files("bitnetlm.serve").joinpath("static/index.html").read_text(encoding="utf-8")
    return HTMLResponse(page, headers={"Cache-Control": "no-store"})


@router.get("/metrics")
async def metrics(request: Request):
    st = _state(request)
    if st.engine is None:
        return PlainTextResponse("", status_code=503)
    # the served models, each under its model_name (a swapped-out one finishing its requests shares its name)
    text = render_many([s.engine.metrics for s in st.models.models.values()])
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


@router.get("/v1/models")
async def models(request: Request):
    _engine(request)
    return {"object": "list", "data": [s.card() for s in _state(request).models.models.values()]}


@router.post("/tokenize")
async def tokenize(request: Request):
    _engine(request)
    st = _state(request)
    req = P.parse_simple(P.TokenizeRequest, await _read_json(request))
    m = _check_model(request, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise P.APIError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
    if req.prompt is not None:
        [ids] = await st.offload.encode(m.tokenizer, [req.prompt], req.add_special_tokens)
    else:
        ids = await st.offload.chat(m.tokenizer, req.messages, req.add_generation_prompt)
    return {"tokens": ids, "count": len(ids), "max_model_len": m.engine.max_model_len}


@router.post("/detokenize")
async def detokenize(request: Request):
    _engine(request)
    req = P.parse_simple(P.DetokenizeRequest, await _read_json(request))
    m = _check_model(request, req.model)
    bad = [t for t in req.tokens if not 0 <= t < m.engine.vocab_size]
    if bad:
        raise P.APIError(400, f"token ids outside [0, {m.engine.vocab_size}): {bad[:8]}", param="tokens")
    return {"prompt": await _state(request).offload.decode(m.tokenizer, req.tokens)}


@router.post("/v1/completions")
async def completions(request: Request):
    _engine(request)
    st = _state(request)
    req = P.parse_request(P.CompletionRequest, await _read_json(request))
    m = require_generator(_check_model(request, req.model))
    e = m.engine
    prompts = req.prompts()
    if len(prompts) > st.cfg.max_prompts:
        raise P.APIError(400, f"at most {st.cfg.max_prompts} prompts per request", param="prompt")
    encoded = iter(await st.offload.encode(m.tokenizer, [p for p in prompts if isinstance(p, str)]))
    ids = [next(encoded) if isinstance(p, str) else list(p) for p in prompts]
    max_tokens = req.max_tokens
    if max_tokens is None:  # null: the rest of the context, as for chat (and in vLLM)
        max_tokens = max(1, e.max_model_len - max(map(len, ids)))
    k = req.logprobs
    params = _params(req, max_tokens, k is not None, k or 0, await _structured(request, m.engine, req))
    return await _generate(request, m, ids, params, req, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    _engine(request)
    st = _state(request)
    req = P.parse_request(P.ChatCompletionRequest, await _read_json(request))
    m = require_generator(_check_model(request, req.model))
    if req.top_logprobs and not req.logprobs:
        raise P.APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    tools = req.tool_setup()
    ids = await st.offload.chat(m.tokenizer, req.messages, req.add_generation_prompt, tools)
    max_tokens = req.effective_max_tokens()
    if max_tokens is None:
        max_tokens = max(1, m.engine.max_model_len - len(ids))
    so = await _structured(request, m.engine, req, tools)
    params = _params(req, max_tokens, req.logprobs, req.top_logprobs or 0, so)
    return await _generate(request, m, [ids], params, req, chat=True, tools=tools)
