"""The HTTP app (FastAPI on uvicorn): OpenAI routes (routes.py), auth, limits; talks to the engine only.

Requests become token ids + SamplingParams submitted to the `Engine`; its plain Python events go back as JSON or
server-sent events (responses.py). A watcher on the ASGI receive channel notices a client that disconnects
(streaming or not, queued or running) and cancels its request, which frees its KV row at the engine's next step.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from bitnetlm.runtime.config import RuntimeConfig
from bitnetlm.serve import protocol as P
from bitnetlm.serve.engine import Engine, EngineConfig
from bitnetlm.serve.routes import router

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
    """What the routes reach through app.state.bitnet: the config, the engine once loaded, or why it is not."""

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.engine: Engine | None = None
        self.tokenizer = None
        self.error: str | None = None
        self.started = int(time.time())

    def start_engine(self, model, tokenizer) -> None:
        if tokenizer is None:
            raise ValueError("serving needs a tokenizer (tokenizer.json next to the model)")
        self.tokenizer = tokenizer
        c = self.cfg
        self.engine = Engine(model, tokenizer, c.engine, model_name=c.model_name, runtime=c.runtime)

    def load(self, loader: Callable[[], tuple[Any, Any]]) -> None:
        try:
            self.start_engine(*loader())
            log.info("model %s loaded; serving", self.cfg.model_name)
        except Exception as e:
            log.exception("loading the model failed")
            self.error = f"{type(e).__name__}: {e}"


def _error(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(
    cfg: ServerConfig,
    model=None,
    tokenizer=None,
    loader: Callable[[], tuple[Any, Any]] | None = None,
) -> FastAPI:
    """The ASGI app. Give (model, tokenizer) or a `loader` run in a thread at startup (/health is 503 until then)."""
    st = _State(cfg)

    async def lifespan(app):
        if loader is not None:
            threading.Thread(target=st.load, args=(loader,), name="bitnet-load", daemon=True).start()
        else:
            st.start_engine(model, tokenizer)
        yield
        if st.engine is not None:  # uvicorn has already waited for open requests; drain whatever is left
            await asyncio.to_thread(st.engine.shutdown, True, cfg.graceful_timeout_s)

    app = FastAPI(title="bitnet-lm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.bitnet = st
    app.add_exception_handler(P.APIError, lambda request, e: _error(e))
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
    app.include_router(router)
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
    return _error(P.APIError(e.status_code, str(e.detail), type=kind))


async def _internal(request, e: Exception):
    log.exception("internal error on %s", request.url.path)
    return _error(P.APIError(500, f"internal error: {type(e).__name__}", type="server_error"))


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
