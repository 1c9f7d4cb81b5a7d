"""The HTTP layer (FastAPI on uvicorn): OpenAI routes, auth, limits, SSE streaming; talks to the engine only.

It turns requests into token ids + SamplingParams, submits them to the `Engine` and relays the engine's plain
Python events as JSON or server-sent events. A watcher on the ASGI receive channel notices a client that
disconnects (streaming or not, queued or running) and cancels its request, which frees the KV row at the
engine's next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from bitnetlm.runtime.config import RuntimeConfig
from bitnetlm.sampling import SamplingParams
from bitnetlm.serve import protocol as P
from bitnetlm.serve.engine import Chunk, Engine, EngineConfig, Failed, Finished
from bitnetlm.serve.relay import Run, sse, sse_json

log = logging.getLogger("bitnetlm.serve")
OPEN_PATHS = ("/health", "/", "/index.html")  # no data behind them: the chat page asks for the key itself


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str = "bitnet"
    cors_origins: list[str] = field(default_factory=list)
    max_body_bytes: int = 1 << 20  # request bodies beyond this get 413
    max_prompts: int = 64  # prompts in one /v1/completions batch
    engine: EngineConfig = field(default_factory=EngineConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    graceful_timeout_s: float = 30.0  # on shutdown: how long running requests may take to finish
    log_level: str = "info"


class _State:
    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.engine: Engine | None = None
        self.tokenizer = None
        self.error: str | None = None
        self.started = int(time.time())


# ---- helpers ------------------------------------------------------------------------------------------
def _error(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _read_json(request: Request, limit: int) -> Any:
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise P.APIError(413, f"request body is {cl} bytes; the limit is {limit}", code="request_too_large")
    buf = bytearray()
    async for part in request.stream():
        buf += part
        if len(buf) > limit:
            raise P.APIError(
                413, f"request body exceeds the limit of {limit} bytes", code="request_too_large"
            )
    try:
        return json.loads(buf)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise P.APIError(400, f"request body is not valid JSON: {e}") from None


def _params(req: P._Sampling, max_tokens: int, logprobs: bool, top_logprobs: int) -> SamplingParams:
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
    )


# ---- the app ------------------------------------------------------------------------------------------
def create_app(
    cfg: ServerConfig,
    model=None,
    tokenizer=None,
    loader: Callable[[], tuple[Any, Any]] | None = None,
) -> FastAPI:
    """The ASGI app. Give (model, tokenizer) or a `loader` run in a thread at startup (/health is 503 until then)."""
    st = _State(cfg)

    def start_engine(m, tok):
        if tok is None:
            raise ValueError("serving needs a tokenizer (tokenizer.json next to the model)")
        st.tokenizer = tok
        st.engine = Engine(m, tok, cfg.engine, model_name=cfg.model_name, runtime=cfg.runtime)

    def load_in_background():
        try:
            start_engine(*loader())
            log.info("model %s loaded; serving", cfg.model_name)
        except Exception as e:
            log.exception("loading the model failed")
            st.error = f"{type(e).__name__}: {e}"

    async def lifespan(app):
        if loader is not None:
            threading.Thread(target=load_in_background, name="bitnet-load", daemon=True).start()
        else:
            start_engine(model, tokenizer)
        yield
        if st.engine is not None:  # uvicorn has already waited for open requests; drain whatever is left
            await asyncio.to_thread(st.engine.shutdown, True, cfg.graceful_timeout_s)

    app = FastAPI(title="bitnet-lm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.bitnet = st

    @app.exception_handler(P.APIError)
    async def _api_error(request, e: P.APIError):
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(P.APIError(e.status_code, str(e.detail), type=kind))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        return _error(P.APIError(500, f"internal error: {type(e).__name__}", type="server_error"))

    def engine() -> Engine:
        if st.engine is None:
            msg = f"model failed to load: {st.error}" if st.error else "model is loading"
            raise P.APIError(
                503, msg, type="server_error", code="model_loading", headers={"Retry-After": "5"}
            )
        if not st.engine.accepting:
            raise P.APIError(503, "server is shutting down", type="server_error", code="shutting_down")
        return st.engine

    def check_model(name: str | None) -> None:
        if name not in (None, "", cfg.model_name):
            raise P.APIError(
                404, f"The model {name!r} does not exist; this server serves {cfg.model_name!r}.",
                type="not_found_error", param="model", code="model_not_found",
            )  # fmt: skip

    # ---- routes ------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if st.engine is None:
            status = "error" if st.error else "loading"
            return JSONResponse({"status": status, "error": st.error}, status_code=503)
        if not st.engine.accepting:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/", response_class=HTMLResponse)
    @app.get("/index.html", response_class=HTMLResponse)
    async def index():
        page = resources.files("bitnetlm.serve").joinpath("static/index.html").read_text(encoding="utf-8")
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    @app.get("/metrics")
    async def metrics():
        if st.engine is None:
            return PlainTextResponse("", status_code=503)
        return PlainTextResponse(st.engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        e = engine()
        card = {
            "id": cfg.model_name,
            "object": "model",
            "created": st.started,
            "owned_by": "bitnet-lm",
            "max_model_len": e.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        e = engine()
        req = P.parse_simple(P.TokenizeRequest, await _read_json(request, cfg.max_body_bytes))
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise P.APIError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
        if req.prompt is not None:
            ids = st.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            ids = _chat_ids(req.messages, req.add_generation_prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": e.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        e = engine()
        req = P.parse_simple(P.DetokenizeRequest, await _read_json(request, cfg.max_body_bytes))
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < e.vocab_size]
        if bad:
            raise P.APIError(400, f"token ids outside [0, {e.vocab_size}): {bad[:8]}", param="tokens")
        return {"prompt": st.tokenizer.decode(req.tokens)}

    def _chat_ids(messages: list[P.ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        msgs = [
            {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in messages
        ]
        try:
            return st.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=add_generation_prompt, tokenize=True
            )
        except Exception as ex:  # template errors (raise_exception) are the caller's fault
            raise P.APIError(400, f"chat template: {ex}", param="messages") from None

    @app.post("/v1/completions")
    async def completions(request: Request):
        e = engine()
        req = P.parse_request(P.CompletionRequest, await _read_json(request, cfg.max_body_bytes))
        check_model(req.model)
        prompts = req.prompts()
        if len(prompts) > cfg.max_prompts:
            raise P.APIError(400, f"at most {cfg.max_prompts} prompts per request", param="prompt")
        ids = [st.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        k = req.logprobs
        params = _params(req, req.max_tokens, k is not None, k or 0)
        return await _generate(request, e, ids, params, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        e = engine()
        req = P.parse_request(P.ChatCompletionRequest, await _read_json(request, cfg.max_body_bytes))
        check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise P.APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        ids = _chat_ids(req.messages, req.add_generation_prompt)
        max_tokens = req.effective_max_tokens()
        if max_tokens is None:
            max_tokens = max(1, e.max_model_len - len(ids))
        params = _params(req, max_tokens, req.logprobs, req.top_logprobs or 0)
        return await _generate(request, e, [ids], params, req, chat=True)

    async def _generate(request, e: Engine, ids, params, req, chat: bool):
        run = Run(e)
        run.submit(ids, params, req.n, param="messages" if chat else "prompt")
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        n_prompt = sum(len(x) for x in ids)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            gen = _stream(request, run, rid, req.n, n_prompt, chat, include_usage)
            return StreamingResponse(
                gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        texts: dict[int, str] = {}
        lps: dict[int, list] = {}
        finish: dict[int, str] = {}
        completion = 0
        async for batch in run.batches(request):
            for i, ev in batch:
                if isinstance(ev, Chunk):
                    idx = i * req.n + ev.index
                    texts[idx] = texts.get(idx, "") + ev.text
                    lps.setdefault(idx, []).extend(ev.logprobs or [])
                    if ev.finish_reason:
                        finish[idx] = ev.finish_reason
                elif isinstance(ev, Finished):
                    completion += ev.completion_tokens
                elif isinstance(ev, Failed):
                    run.cancel()
                    raise P.APIError(ev.status, ev.message, type="server_error")
        if run.open:  # the client went away; nobody reads this
            return Response(status_code=499)
        want_lp = params.logprobs
        choices = []
        for idx in sorted(texts):
            if chat:
                c = {
                    "index": idx,
                    "message": {"role": "assistant", "content": texts[idx]},
                    "logprobs": P.chat_logprobs(lps[idx]) if want_lp else None,
                    "finish_reason": finish.get(idx),
                }
            else:
                c = {
                    "index": idx,
                    "text": texts[idx],
                    "logprobs": P.completion_logprobs(lps[idx]) if want_lp else None,
                    "finish_reason": finish.get(idx),
                }
            choices.append(c)
        build = P.chat_response if chat else P.completion_response
        return build(rid, cfg.model_name, choices, P.usage(n_prompt, completion))

    async def _stream(request, run: Run, rid, n, n_prompt, chat, include_usage):
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        completion = 0
        offsets: dict[int, int] = {}
        # every frame's JSON up to its choices, encoded once (the same text json.dumps gives the whole dict)
        head = json.dumps(
            {"id": rid, "object": obj, "created": created, "model": cfg.model_name}, ensure_ascii=False
        )
        head = head[:-1] + ', "choices": '

        def frame(choices, usage=None):
            tail = f', "usage": {json.dumps(usage)}}}' if include_usage else "}"
            return sse_json(head + json.dumps(choices, ensure_ascii=False) + tail)

        if chat:
            yield frame(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for i in range(len(run.gids) * n)
                ]
            )
        async for batch in run.batches(request):
            out = []  # the batch's frames, sent in one write
            for i, ev in batch:
                if isinstance(ev, Chunk):
                    idx = i * n + ev.index
                    if not ev.text and not ev.finish_reason and not ev.logprobs:
                        continue  # nothing visible yet (held back: incomplete character or possible stop string)
                    if chat:
                        c = {
                            "index": idx,
                            "delta": {"content": ev.text} if ev.text or not ev.finish_reason else {},
                            "logprobs": P.chat_logprobs(ev.logprobs) if ev.logprobs else None,
                            "finish_reason": ev.finish_reason,
                        }
                    else:
                        off = offsets.get(idx, 0)
                        c = {
                            "index": idx,
                            "text": ev.text,
                            "logprobs": P.completion_logprobs(ev.logprobs, off) if ev.logprobs else None,
                            "finish_reason": ev.finish_reason,
                        }
                        offsets[idx] = off + len(ev.text)
                    out.append(frame([c]))
                elif isinstance(ev, Finished):
                    completion += ev.completion_tokens
                elif isinstance(ev, Failed):
                    err = {"message": ev.message, "type": "server_error", "param": None, "code": None}
                    yield "".join(out) + sse({"error": err})
                    return
            if out:
                yield "".join(out)
        if run.open:
            return  # client disconnected
        if include_usage:
            yield frame([], P.usage(n_prompt, completion))
        yield "data: [DONE]\n\n"

    # ---- middleware: request limits, API key, CORS (outermost last) ---------------------------------------
    app.add_middleware(_AuthMiddleware, api_key=cfg.api_key)
    if cfg.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=cfg.cors_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type", "X-API-Key"],
        )
    return app


class _AuthMiddleware:
    """Every route except OPEN_PATHS needs `Authorization: Bearer KEY` (or `X-API-Key: KEY`) when a key is set."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if self.key is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if scope["method"] == "OPTIONS":  # CORS preflight carries no credentials
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"x-api-key", b"")
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        if not hmac.compare_digest(given, self.key):
            resp = _error(
                P.APIError(401, "Invalid or missing API key (send 'Authorization: Bearer KEY').",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
            )  # fmt: skip
            return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


# ---- running -------------------------------------------------------------------------------------------
class ServerHandle:
    """A server running on a background thread (tests, notebooks): .url, .stop()."""

    def __init__(self, server, thread, sock):
        self.server, self.thread = server, thread
        host, port = sock.getsockname()[:2]
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}"

    @property
    def engine(self) -> Engine | None:
        return self.server.config.app.state.bitnet.engine

    def stop(self, timeout: float = 60) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _uvicorn_server(app, cfg: ServerConfig):
    import uvicorn

    ucfg = uvicorn.Config(
        app,
        log_level=cfg.log_level,
        timeout_graceful_shutdown=cfg.graceful_timeout_s,
        limit_concurrency=None,
        h11_max_incomplete_event_size=64 * 1024,  # header size limit
        access_log=cfg.log_level == "debug",
    )
    return uvicorn.Server(ucfg)


def _bind(host: str, port: int):
    import socket

    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(fam, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def start_server(
    cfg: ServerConfig, model=None, tokenizer=None, loader=None, wait: bool = True
) -> ServerHandle:
    """Start a server on a background thread (port 0 = any free port); returns once it accepts connections."""
    app = create_app(cfg, model, tokenizer, loader)
    server = _uvicorn_server(app, cfg)
    sock = _bind(cfg.host, cfg.port)
    server.install_signal_handlers = lambda: None  # not on the main thread
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="bitnet-http", daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while wait and not server.started and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    return ServerHandle(server, t, sock)


def run_server(cfg: ServerConfig, model=None, tokenizer=None, loader=None) -> None:
    """Serve in the foreground until SIGINT/SIGTERM, then drain running requests and exit."""
    app = create_app(cfg, model, tokenizer, loader)
    server = _uvicorn_server(app, cfg)
    sock = _bind(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    print(
        f"bitnet serve: listening on http://{host}:{port} (model {cfg.model_name})",
        file=sys.stderr,
        flush=True,
    )
    if cfg.api_key is None and cfg.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"bitnet serve: WARNING: bound to {host} without --api-key: anyone who can reach it can use it",
            file=sys.stderr,
            flush=True,
        )
    server.run(sockets=[sock])
