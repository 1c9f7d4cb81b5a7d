"""The HTTP app (FastAPI on uvicorn): OpenAI routes (routes.py), auth, limits; talks to the engine only.

Requests become token ids + SamplingParams submitted to the `Engine`; its plain Python events go back as JSON or
server-sent events (responses.py). A watcher on the ASGI receive channel notices a client that disconnects
(streaming or not, queued or running) and cancels its request, which frees its KV row at the engine's next step.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from bitnetlm.engine.scheduler import ContextShift
from bitnetlm.engine.speculative import SpeculativeConfig
from bitnetlm.models.bert import Encoder
from bitnetlm.runtime.config import RuntimeConfig
from bitnetlm.serve import protocol as P
from bitnetlm.serve.admin import admin_router
from bitnetlm.serve.embeddings import EmbeddingEngine, embeddings_router
from bitnetlm.serve.engine import Engine, EngineConfig
from bitnetlm.serve.models import Loader, Registry, ReleaseAtEnd, Served, reason
from bitnetlm.serve.offload import Offload
from bitnetlm.serve.relay import Run
from bitnetlm.serve.routes import router
from bitnetlm.serve.ws import ws_router

log = logging.getLogger("bitnetlm.serve")
OPEN_PATHS = ("/health", "/", "/index.html")  # no data behind them: the chat page asks for the key itself


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


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
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this long
    tokenizer_threads: int = 2  # threads parsing, tokenizing and detokenizing requests beside the event loop
    log_level: str = "info"
    grpc_port: int | None = None  # also serve gRPC (grpc_service.py) on this port of `host`; 0: any free port
    model_path: str | None = None  # where the default model was loaded from (None: given in memory)
    max_models: int = 1  # models served at once (each with its own engine); a swap of one name counts once
    allow_admin: bool = False  # the admin routes without an API key (with one, they need it like every route)

    def __post_init__(self):
        # checked here, before anything binds or loads: a zero prefill chunk would hang every request
        e = self.engine
        for flag, v, low, high in (
            ("--port", self.port, 0, 65535),
            ("--max-body-bytes", self.max_body_bytes, 1, None),
            ("--max-queue", e.max_queue, 0, None),
            ("--prefill-chunk", e.prefill_chunk, 1, None),
            ("max_prompts", self.max_prompts, 1, None),
            ("tokenizer_threads", self.tokenizer_threads, 1, None),
            ("--max-models", self.max_models, 1, None),
            ("retry_after_s", e.retry_after_s, 0, None),
            *([("--grpc-port", self.grpc_port, 0, 65535)] if self.grpc_port is not None else []),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
                want = f"in [{low}, {high}]" if high is not None else f">= {low}"
                raise ValueError(f"{flag} {v!r}: expected an integer {want}")
        SpeculativeConfig(e.draft_max, e.lookup, e.lookup_min, e.draft_model)  # (checks the numbers)
        ContextShift(e.n_keep)  # (checks --keep)
        for flag, v in (("--graceful-timeout", self.graceful_timeout_s), ("keep_alive_s", self.keep_alive_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"{flag} {v!r}: expected a number of seconds >= 0")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level {self.log_level!r}: expected one of {', '.join(LOG_LEVELS)}")


def check_context(model, runtime: RuntimeConfig) -> None:
    """A context beyond the model's own is refused: positions past it are untrained, and the KV cache it asks
    for could be far larger than the model (the runtime allocates all of it up front)."""
    n_ctx = model.config.max_position_embeddings
    if runtime.max_seq_len is not None and runtime.max_seq_len > n_ctx:
        raise ValueError(
            f"--ctx-size {runtime.max_seq_len}: the model's context is {n_ctx} tokens; give at most {n_ctx}"
        )


class _State:
    """What the routes reach through app.state.bitnet: the config, the engine once loaded, or why it is not; the
    thread pool for a request's CPU work; the running generations (to end them at shutdown)."""

    def __init__(self, cfg: ServerConfig, on_load_error: Callable[[], None] | None = None):
        self.cfg = cfg
        self.models = Registry(cfg.model_name, cfg.max_models, self.build)
        self.error: str | None = None
        self.started = int(time.time())
        self.offload = Offload(cfg.tokenizer_threads)
        self.runs: weakref.WeakSet[Run] = weakref.WeakSet()
        self.on_load_error = on_load_error
        self.grpc_port: int | None = None  # where gRPC listens, once it does

    @property
    def engine(self) -> Engine | None:
        """The default model's engine (None while it loads or when it failed to)."""
        s = self.models.get(None)
        return s.engine if s is not None else None

    @property
    def tokenizer(self):
        s = self.models.get(None)
        return s.tokenizer if s is not None else None

    def build(self, name: str, model, tokenizer) -> Engine | EmbeddingEngine:
        """An engine serving `model` as `name` (the server's engine and runtime options); an encoder gets one
        that only embeds."""
        if tokenizer is None:
            raise ValueError("serving needs a tokenizer (tokenizer.json next to the model)")
        c = self.cfg
        check_context(model, c.runtime)
        if isinstance(model, Encoder):
            return EmbeddingEngine(model, tokenizer, c.engine, name, c.runtime.max_seq_len)
        return Engine(model, tokenizer, c.engine, model_name=name, runtime=c.runtime)

    def start_engine(self, model, tokenizer, loader: Loader | None = None) -> None:
        name = self.cfg.model_name
        self.models.add(
            Served(name, self.build(name, model, tokenizer), tokenizer, loader, self.cfg.model_path)
        )

    def load(self, loader: Loader) -> None:
        """Load and start the engine (on a thread of its own); a failure is kept as one line and, where the
        server was given an `on_load_error`, stops it: a server that cannot serve should not look alive."""
        try:
            self.start_engine(*loader(), loader)
            log.info("model %s loaded; serving", self.cfg.model_name)
        except Exception as e:
            log.debug("loading the model failed", exc_info=True)
            self.error = reason(e)
            if self.on_load_error is not None:
                self.on_load_error()

    def cut(self, message: str) -> None:
        """End every running generation now with `message` (streams: an error event and [DONE])."""
        for run in list(self.runs):
            run.cut(message)


def _on_sighup(st: _State) -> None:
    """SIGHUP reloads the default model from its path (a swap: running requests finish on the old one). Only a
    server on the main thread (`bitnet serve`) can take signals."""
    if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
        return

    async def reload():
        try:
            await st.models.reload()
        except ValueError as e:
            log.error("SIGHUP: %s; still serving the model loaded before", e)

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(reload()))


async def _start_grpc(st: _State):
    """The gRPC server beside HTTP (its port is then st.grpc_port); a failure to listen stops the server with
    one line, as a model that cannot load does."""
    from bitnetlm.deps import require

    try:
        require("grpc", "bitnet serve --grpc-port")
        require("google.protobuf", "bitnet serve --grpc-port")
        from bitnetlm.serve.grpc_service import start_grpc

        server, st.grpc_port = await start_grpc(st, st.cfg.host, st.cfg.grpc_port)
        log.info("gRPC listening on %s:%d", st.cfg.host, st.grpc_port)
    except ValueError as e:
        st.error = str(e)
        if st.on_load_error is not None:
            st.on_load_error()
        return None
    return server


def _error(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(
    cfg: ServerConfig,
    model=None,
    tokenizer=None,
    loader: Callable[[], tuple[Any, Any]] | None = None,
    on_load_error: Callable[[], None] | None = None,
) -> FastAPI:
    """The ASGI app. Give (model, tokenizer) or a `loader` run in a thread at startup (/health is 503 until then;
    `on_load_error` is called if it fails)."""
    st = _State(cfg, on_load_error)

    async def lifespan(app):
        grpc_server = await _start_grpc(st) if cfg.grpc_port is not None else None
        if st.error is not None:  # gRPC could not listen: the server is stopping
            yield
            return
        if loader is not None:
            threading.Thread(target=st.load, args=(loader,), name="bitnet-load", daemon=True).start()
        else:
            st.start_engine(model, tokenizer)
        _on_sighup(st)
        yield
        if grpc_server is not None:  # running calls get the graceful timeout, as HTTP requests do
            await grpc_server.stop(cfg.graceful_timeout_s)
        # uvicorn has already waited for open requests; drain whatever is left
        await st.models.close(cfg.graceful_timeout_s)
        st.offload.close()

    # FastAPI's own schema and Swagger page; the auth middleware guards them as every other route
    app = FastAPI(
        title="bitnet-lm", lifespan=lifespan, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json"
    )
    app.state.bitnet = st
    app.add_exception_handler(P.APIError, lambda request, e: _error(e))
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
    app.include_router(router)
    app.include_router(embeddings_router)
    app.include_router(ws_router)
    app.include_router(admin_router)
    app.add_middleware(ReleaseAtEnd)
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


async def _http_error(request, e):
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    # the exception's headers go out with it: a 405 names the allowed methods in Allow
    return _error(P.APIError(e.status_code, str(e.detail), type=kind, headers=e.headers))


async def _internal(request, e: Exception):
    log.exception("internal error on %s", request.url.path)
    return _error(P.APIError(500, f"internal error: {type(e).__name__}", type="server_error"))


def _query_key(scope) -> bytes:
    from urllib.parse import parse_qs

    return parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key", [""])[0].encode()


class _AuthMiddleware:
    """Every route except OPEN_PATHS needs `Authorization: Bearer KEY` (or `X-API-Key: KEY`) when a key is set; a
    WebSocket may give it as `?api_key=KEY` instead (a refused handshake gets the 401 where the server can send
    one, else a close with code 1008)."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        if self.key is None or kind not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if kind == "http" and scope["method"] == "OPTIONS":  # CORS preflight carries no credentials
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"x-api-key", b"")
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        if kind == "websocket" and not given:  # browsers cannot set a WebSocket's headers
            given = _query_key(scope)
        if not hmac.compare_digest(given, self.key):
            if kind == "websocket" and "websocket.http.response" not in scope.get("extensions", {}):
                return await send({"type": "websocket.close", "code": 1008})  # (policy violation)
            resp = _error(
                P.APIError(401, "Invalid or missing API key (send 'Authorization: Bearer KEY').",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
            )  # fmt: skip
            return await resp(scope, receive, send)
        return await self.app(scope, receive, send)
