"""bitnet serve -m MODEL [--host --port --api-key --max-batch --max-queue ...]: OpenAI-compatible HTTP server.

Every flag can also come from an environment variable BITNET_<FLAG> (e.g. BITNET_PORT=9000,
BITNET_API_KEY=...); a flag on the command line wins over the variable. Library form: bitnetlm.serve.serve().
"""

from __future__ import annotations

import argparse
import os


def _bool(raw: str) -> bool:
    v = str(raw).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), found {raw!r}")


_bool.__name__ = "bool"

# (flags, dest, type, default, help); the env var is BITNET_<DEST upper-cased>
FLAGS = [
    (("-m", "--model"), "model", str, None, "model directory, .gguf file or zoo name"),
    (("--host",), "host", str, "127.0.0.1", "address to bind; 0.0.0.0 exposes the server to the network"),
    (("--port",), "port", int, 8000, "TCP port (0 = any free port)"),
    (("--api-key",), "api_key", str, None, "require 'Authorization: Bearer KEY' on every route but /health"),
    (
        ("--model-name", "--served-model-name"),
        "model_name",
        str,
        None,
        "model id the API reports and accepts",
    ),
    (("--max-batch", "-np", "--parallel"), "max_batch", int, 8, "sequences decoded together (KV-cache rows)"),
    (("--max-queue",), "max_queue", int, 64, "sequences that may wait for a row; more get 429 + Retry-After"),
    (("-c", "--ctx-size", "--max-model-len"), "max_model_len", int, None, "context length (prompt + output)"),
    (("--prefill-chunk",), "prefill_chunk", int, 512, "prompt tokens prefilled per engine step"),
    (
        ("--cors-origins",),
        "cors_origins",
        str,
        None,
        "comma-separated origins allowed by CORS (default: CORS off)",
    ),
    (("--max-body-bytes",), "max_body_bytes", int, 1 << 20, "largest request body accepted (413 beyond)"),
    (("--graceful-timeout",), "graceful_timeout_s", float, 30.0, "seconds running requests get on shutdown"),
    (("--device",), "device", str, "auto", "cpu, cuda, cuda:N or auto"),
    (
        ("--dtype",),
        "dtype",
        str,
        None,
        "activation dtype: float32, bfloat16, float16 (default: float32 on CPU, bfloat16 on CUDA)",
    ),
    (
        ("--backend",),
        "backend",
        str,
        None,
        "kernel backend: reference, cpu, triton (default: best available)",
    ),
    (("-t", "--threads"), "threads", int, None, "CPU threads for the kernels (default: physical cores)"),
    (
        ("--head-dtype",),
        "head_dtype",
        str,
        None,
        "embedding/LM head: bf16 or int8 storage on CPU; int8 = the CUDA-graph engine's int8 head on CUDA",
    ),
    (
        ("--enforce-eager",),
        "enforce_eager",
        _bool,
        False,
        "CUDA: decode with the model's eager forward instead of the CUDA-graph engine",
    ),
    (
        ("--kv-cache-dtype",),
        "kv_cache_dtype",
        str,
        "auto",
        "KV-cache elements: auto (the activation dtype), bf16 or fp8 (CUDA; e4m3, unscaled)",
    ),
    (("--log-level",), "log_level", str, "info", "uvicorn log level: debug, info, warning, error"),
]


def env_name(dest: str) -> str:
    return "BITNET_" + dest.upper().removesuffix("_S")


def _env_default(dest, typ, default):
    raw = os.environ.get(env_name(dest))
    if raw is None or raw == "":
        return default
    try:
        return typ(raw)
    except ValueError:
        raise ValueError(f"environment variable {env_name(dest)}={raw!r}: expected {typ.__name__}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    for flags, dest, typ, default, text in FLAGS:
        shown = {"model": "the zoo's default model", "model_name": "the model's directory name"}.get(
            dest, "off" if default is None else default
        )
        flag = dict(nargs="?", const=True) if typ is _bool else {}  # `--enforce-eager` alone means true
        p.add_argument(
            *flags,
            dest=dest,
            type=typ,
            default=argparse.SUPPRESS,
            help=f"{text} (env {env_name(dest)}; default: {shown})".replace("%", "%%"),
            **flag,
        )


def resolve(args: argparse.Namespace) -> dict:
    """Flag > environment variable > default, for every flag."""
    out = {}
    for _, dest, typ, default, _ in FLAGS:
        out[dest] = getattr(args, dest) if hasattr(args, dest) else _env_default(dest, typ, default)
    return out


def run(args) -> int:
    from bitnetlm.serve.server import serve

    o = resolve(args)
    if o["port"] is not None and not 0 <= o["port"] < 65536:
        raise ValueError(f"--port must be in [0, 65535], found {o['port']}")
    cors = [s.strip() for s in (o.pop("cors_origins") or "").split(",") if s.strip()]
    serve(o.pop("model"), cors_origins=cors, **o)
    return 0
