"""`serve()`: the library form of `bitnet serve` (load a model, build the engine, run the HTTP server)."""

from __future__ import annotations

import dataclasses
import os

from bitnetlm.runtime import config_for
from bitnetlm.runtime.config import RuntimeConfig
from bitnetlm.serve.app import ServerConfig, ServerHandle, run_server, start_server
from bitnetlm.serve.engine import EngineConfig

_RUNTIME = {f.name for f in dataclasses.fields(RuntimeConfig)}
_ENGINE = {f.name for f in dataclasses.fields(EngineConfig)}


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


def _loader(model, runtime: RuntimeConfig):
    def load():
        from bitnetlm.loading import load_for_generation

        return load_for_generation(model, runtime)

    return load


def serve(
    model: str | os.PathLike | None = None,
    *,
    model_name: str | None = None,
    runtime: RuntimeConfig | None = None,
    **kw,
) -> None:
    """Serve `model` (a path or zoo name; None = the zoo default) until SIGINT/SIGTERM, then drain and return.

    Keywords: the RuntimeConfig's (device, dtype, backend, threads, head_dtype, kv_cache_dtype, enforce_eager,
    max_batch, max_seq_len), the engine's (max_queue, prefill_chunk) and the server's (host, port, api_key,
    cors_origins, max_body_bytes, graceful_timeout_s, log_level); see `bitnet serve --help`. The port opens at
    once; /health answers 503 until the model has loaded.
    """
    name = model_name or (os.path.basename(os.path.normpath(os.fspath(model))) if model else "bitnet")
    rt, eng, server = _split(kw)
    runtime = (runtime or RuntimeConfig()).replace(**rt)
    run_server(_config(name, runtime, eng, server), loader=_loader(model, runtime))


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
        return start_server(_config(model_name, runtime, eng, server), loader=_loader(path, runtime))
    runtime = config_for(model, runtime).replace(**rt)
    return start_server(_config(model_name, runtime, eng, server), model, tokenizer)
