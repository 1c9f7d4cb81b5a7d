"""`serve()`: the library form of `bitnet serve` (load a model, build the engine, run the HTTP server)."""

from __future__ import annotations

import os

from bitnetlm.serve.app import ServerConfig, ServerHandle, run_server, start_server
from bitnetlm.serve.engine import EngineConfig


def _config(
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_batch: int = 8,
    max_queue: int = 64,
    max_model_len: int | None = None,
    prefill_chunk: int = 512,
    enforce_eager: bool = False,
    cors_origins: list[str] | None = None,
    max_body_bytes: int = 1 << 20,
    graceful_timeout_s: float = 30.0,
    log_level: str = "info",
) -> ServerConfig:
    return ServerConfig(
        host=host,
        port=port,
        api_key=api_key if api_key is not None else (os.environ.get("BITNET_API_KEY") or None),
        model_name=model_name,
        cors_origins=list(cors_origins or []),
        max_body_bytes=max_body_bytes,
        graceful_timeout_s=graceful_timeout_s,
        log_level=log_level,
        engine=EngineConfig(
            max_batch=max_batch,
            max_queue=max_queue,
            max_model_len=max_model_len,
            prefill_chunk=prefill_chunk,
            enforce_eager=enforce_eager,
        ),
    )


def _loader(model, device, dtype, backend, threads=None, head_dtype=None, kv_cache_dtype=None):
    def load():
        from bitnetlm.commands.generate import load_model_and_tokenizer

        return load_model_and_tokenizer(
            model,
            device=device,
            backend=backend,
            dtype=dtype,
            threads=threads,
            head_dtype=head_dtype,
            kv_cache_dtype=kv_cache_dtype,
        )

    return load


def serve(
    model: str | os.PathLike | None = None,
    *,
    model_name: str | None = None,
    device: str = "auto",
    dtype: str | None = None,
    backend: str | None = None,
    threads: int | None = None,
    head_dtype: str | None = None,
    kv_cache_dtype: str | None = None,
    **server_kw,
) -> None:
    """Serve `model` (a path or zoo name; None = the zoo default) until SIGINT/SIGTERM, then drain and return.

    Keywords: host, port, api_key, max_batch, max_queue, max_model_len, prefill_chunk, enforce_eager,
    kv_cache_dtype ('auto', 'bf16' or 'fp8'),
    cors_origins, max_body_bytes, graceful_timeout_s, log_level (see `bitnet serve --help`). The port opens at once;
    /health answers 503 until the model has loaded.
    """
    name = model_name or (os.path.basename(os.path.normpath(os.fspath(model))) if model else "bitnet")
    cfg = _config(name, **server_kw)
    run_server(cfg, loader=_loader(model, device, dtype, backend, threads, head_dtype, kv_cache_dtype))


def start(
    model=None,
    tokenizer=None,
    *,
    path: str | os.PathLike | None = None,
    model_name: str = "bitnet",
    device: str = "auto",
    dtype: str | None = None,
    backend: str | None = None,
    **server_kw,
) -> ServerHandle:
    """Start a server on a background thread: from an in-memory (model, tokenizer) or a `path` to load.

    Returns a handle with .url and .stop(); port=0 picks a free port.
    """
    cfg = _config(model_name, **server_kw)
    if path is not None:
        return start_server(cfg, loader=_loader(path, device, dtype, backend))
    return start_server(cfg, model, tokenizer)
