"""Running the HTTP server: `serve()` (the library form of `bitnet serve`) in the foreground, `start()` on a
background thread (tests, notebooks).

Start-up fails fast and in one line: options are checked before the port is bound, a port that cannot be bound
is named, and a model that cannot load stops the server (`serve` raises ModelLoadError; the port opens first so
that /health can say "loading" meanwhile). At shutdown, requests get the graceful timeout to finish; those still
running then end with an error (a stream: an error event and [DONE]) before uvicorn would cut their connections.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import os
import socket
import sys
import threading
import time

import uvicorn
import uvicorn.config

from bitnetlm.runtime import config_for
from bitnetlm.runtime.config import RuntimeConfig
from bitnetlm.serve.app import ServerConfig, check_context, create_app
from bitnetlm.serve.engine import Engine, EngineConfig

log = logging.getLogger("bitnetlm.serve")
_RUNTIME = {f.name for f in dataclasses.fields(RuntimeConfig)}
_ENGINE = {f.name for f in dataclasses.fields(EngineConfig)}
CUT_MARGIN_S = 5.0  # past the graceful timeout: how long cut requests get to send their last events


class ModelLoadError(RuntimeError):
    """The model could not be loaded (or its engine started); the server has stopped. The message is one line."""


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

    @property
    def models(self):
        """The served models (models.Registry): .models by name, .retiring."""
        return self.server.config.app.state.bitnet.models

    @property
    def grpc_port(self) -> int | None:
        """The port gRPC listens on (ServerConfig.grpc_port; the picked one for 0), or None."""
        return self.server.config.app.state.bitnet.grpc_port

    @property
    def error(self) -> str | None:
        """Why the model could not be loaded (the server then stops by itself), or None."""
        return self.server.config.app.state.bitnet.error

    def stop(self, timeout: float = 60) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class _Server(uvicorn.Server):
    """uvicorn's server, whose shutdown cuts the requests still running when the graceful timeout expires."""

    async def shutdown(self, sockets=None) -> None:
        st = self.config.app.state.bitnet
        grace = st.cfg.graceful_timeout_s
        why = f"the server is shutting down: the request did not finish within the graceful timeout ({grace:g} s)"
        timer = asyncio.get_running_loop().call_later(grace, st.cut, why)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def _log_config(level: str) -> dict:
    """uvicorn's logging, with the package's own loggers on the same handler at the same level."""
    out = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    out["loggers"]["bitnetlm"] = {
        "handlers": ["default"],
        "level": uvicorn.config.LOG_LEVELS[level],
        "propagate": False,
    }
    return out


def _make_server(cfg: ServerConfig, model=None, tokenizer=None, loader=None) -> _Server:
    def stop():  # the model cannot load: nothing to serve
        server.should_exit = True

    app = create_app(cfg, model, tokenizer, loader, on_load_error=stop)
    ucfg = uvicorn.Config(
        app,
        log_level=cfg.log_level,
        log_config=_log_config(cfg.log_level),
        # uvicorn cancels what still runs at its deadline; ours (the graceful timeout) ends it properly first
        timeout_graceful_shutdown=cfg.graceful_timeout_s + CUT_MARGIN_S,
        timeout_keep_alive=cfg.keep_alive_s,
        limit_concurrency=None,
        h11_max_incomplete_event_size=64 * 1024,  # header size limit
        access_log=cfg.log_level in ("debug", "trace"),
    )
    server = _Server(ucfg)
    return server


def _bind(host: str, port: int) -> socket.socket:
    """A socket listening on (host, port); ValueError naming the address when that fails (in use, no such host).
    Listening from here on, not from when uvicorn has started: a client that connects in between (after the
    "listening on" line) waits in the backlog instead of being refused."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(fam, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's backlog
    except OSError as e:
        sock.close()
        addr = f"[{host}]:{port}" if fam == socket.AF_INET6 else f"{host}:{port}"
        raise ValueError(f"cannot listen on {addr}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def start_server(
    cfg: ServerConfig, model=None, tokenizer=None, loader=None, wait: bool = True
) -> ServerHandle:
    """Start a server on a background thread (port 0 = any free port); returns once it accepts connections."""
    server = _make_server(cfg, model, tokenizer, loader)
    sock = _bind(cfg.host, cfg.port)
    server.install_signal_handlers = lambda: None  # not on the main thread
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="bitnet-http", daemon=True)
    handle = ServerHandle(server, t, sock)  # (its address read now: a server that stops at once closes sock)
    t.start()
    deadline = time.monotonic() + 60
    while wait and not server.started and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    return handle


def run_server(cfg: ServerConfig, model=None, tokenizer=None, loader=None) -> None:
    """Serve in the foreground until SIGINT/SIGTERM, then drain running requests and exit. ModelLoadError when
    the model cannot be loaded."""
    server = _make_server(cfg, model, tokenizer, loader)
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
    error = server.config.app.state.bitnet.error
    if error is not None:
        raise ModelLoadError(error)


def _split(kw: dict) -> tuple[dict, dict, dict]:
    """Keyword options -> (RuntimeConfig fields, EngineConfig fields, ServerConfig fields)."""
    kw = dict(kw)
    if "max_model_len" in kw:  # vLLM's name for the context length
        kw["max_seq_len"] = kw.pop("max_model_len")
    rt = {k: kw.pop(k) for k in list(kw) if k in _RUNTIME}
    eng = {k: kw.pop(k) for k in list(kw) if k in _ENGINE}
    return rt, eng, kw


def _config(model_name: str, runtime: RuntimeConfig, engine: dict, server: dict) -> ServerConfig:
    if server.get("api_key") is None:
        server["api_key"] = os.environ.get("BITNET_API_KEY") or None
    server["cors_origins"] = list(server.get("cors_origins") or [])
    return ServerConfig(model_name=model_name, engine=EngineConfig(**engine), runtime=runtime, **server)


def _loader(model, runtime: RuntimeConfig, tp=None):
    loads = []

    def load():
        from bitnetlm.loading import load_for_generation

        if tp is not None and loads:  # the other ranks hold shards of the first load and follow its runner
            raise ValueError(
                "a tensor-parallel server loads its model once; restart it to load the model again"
            )
        loads.append(1)
        loaded = load_for_generation(model, runtime)
        if tp is not None:
            from bitnetlm.parallel import shard_

            shard_(loaded[0], tp)
        return loaded

    return load


def serve(
    model: str | os.PathLike | None = None,
    *,
    model_name: str | None = None,
    runtime: RuntimeConfig | None = None,
    tp=None,
    **kw,
) -> None:
    """Serve `model` (a path or zoo name; None = the zoo default) until SIGINT/SIGTERM, then drain and return.
    `tp`: rank 0's `parallel.TPGroup` (the model is sharded over it; the other ranks `runtime.tp.follow`, and are
    released when the server ends).

    Keywords: the RuntimeConfig's (device, dtype, backend, threads, head_dtype, kv_cache_dtype, enforce_eager,
    max_batch, max_seq_len), the engine's (max_queue, prefill_chunk) and the server's (host, port, api_key,
    cors_origins, max_body_bytes, graceful_timeout_s, keep_alive_s, tokenizer_threads, log_level, grpc_port,
    max_models, allow_admin); see
    `bitnet serve --help`. The port opens at once; /health answers 503 until the model has loaded. ValueError for
    a bad option or a port that cannot be bound, ModelLoadError when the model cannot be loaded.
    """
    name = model_name or (os.path.basename(os.path.normpath(os.fspath(model))) if model else "bitnet")
    rt, eng, server = _split(kw)
    runtime = (runtime or RuntimeConfig()).replace(**rt)
    server["model_path"] = os.fspath(model) if model else None
    try:
        run_server(_config(name, runtime, eng, server), loader=_loader(model, runtime, tp))
    finally:
        if tp is not None:
            _release(tp)


def _release(tp) -> None:
    """Rank 0: let the other ranks stop following (those torchrun's signal has already ended need nothing)."""
    try:
        tp.send(["stop"])
    except RuntimeError as e:
        log.info("tensor parallelism: the other ranks are gone already (%s)", e)


def start(
    model=None,
    tokenizer=None,
    *,
    path: str | os.PathLike | None = None,
    model_name: str = "bitnet",
    runtime: RuntimeConfig | None = None,
    **kw,
) -> ServerHandle:
    """Start a server on a background thread: from an in-memory (model, tokenizer) or a `path` to load.

    Returns a handle with .url and .stop(); port=0 picks a free port. Runtime options given here override those
    the model was loaded with."""
    rt, eng, server = _split(kw)
    if path is not None:
        runtime = (runtime or RuntimeConfig()).replace(**rt)
        server["model_path"] = os.fspath(path)
        return start_server(_config(model_name, runtime, eng, server), loader=_loader(path, runtime))
    runtime = config_for(model, runtime).replace(**rt)
    cfg = _config(model_name, runtime, eng, server)
    check_context(model, runtime)
    return start_server(cfg, model, tokenizer)
