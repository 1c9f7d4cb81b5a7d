"""bitnet serve -m MODEL [--host --port --api-key --max-batch --max-queue ...]: OpenAI-compatible HTTP server.

Every flag can also come from an environment variable BITNET_<FLAG> (e.g. BITNET_PORT=9000,
BITNET_API_KEY=...); a flag on the command line wins over the variable. Library form: bitnetlm.serve.serve().
"""

from __future__ import annotations

import argparse
import sys

from bitnetlm.generate.args import SPECULATIVE_FLAGS
from bitnetlm.runtime.args import (
    RUNTIME_FLAGS,
    add_runtime_arguments,
    env_default,
    parse_bool,
    runtime_from_args,
)
from bitnetlm.runtime.args import env_name as _env_name

# (flags, dest, type, default, help) of the server's own flags; the runtime group comes from runtime/args.py
SERVER_FLAGS = [
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
    (
        ("--max-queue",),
        "max_queue",
        int,
        64,
        "sequences that may wait for a row; more get 429 + Retry-After (a request that needs more than "
        "--max-batch + --max-queue sequences gets 400)",
    ),
    (("--prefill-chunk",), "prefill_chunk", int, 512, "prompt tokens prefilled per engine step"),
    (
        ("--cors-origins",),
        "cors_origins",
        str,
        None,
        "comma-separated origins allowed by CORS (default: CORS off)",
    ),
    (("--max-body-bytes",), "max_body_bytes", int, 1 << 20, "largest request body accepted (413 beyond)"),
    (
        ("--graceful-timeout",),
        "graceful_timeout_s",
        float,
        30.0,
        "seconds running requests get on shutdown; then they end with an error (a stream: an error event and "
        "[DONE])",
    ),
    (("--log-level",), "log_level", str, "info", "uvicorn log level: debug, info, warning, error"),
    (
        ("--tp",),
        "tp",
        int,
        1,
        "tensor parallelism over N processes started by `torchrun --nproc-per-node N -m bitnetlm.cli serve ...` "
        "(rank 0 serves HTTP; gloo on the CPU, NCCL on GPUs)",
    ),
    *SPECULATIVE_FLAGS,
]
# every flag of the command: (flags, dest) pairs, for the environment variables' names
FLAGS = [(f, d, t, dflt, h) for f, d, t, dflt, h in SERVER_FLAGS] + [
    (f, d, t, None, h) for f, d, t, h in RUNTIME_FLAGS
]
_BY_DEST = {d: f for f, d, *_ in FLAGS}
_bool = parse_bool


def env_name(dest: str) -> str:
    return _env_name(_BY_DEST[dest])


def add_arguments(p: argparse.ArgumentParser) -> None:
    for flags, dest, typ, default, text in SERVER_FLAGS:
        shown = {"model": "the zoo's default model", "model_name": "the model's directory name"}.get(
            dest, "off" if default is None else default
        )
        p.add_argument(
            *flags,
            dest=dest,
            type=typ,
            default=argparse.SUPPRESS,
            help=f"{text} (env {env_name(dest)}; default: {shown})".replace("%", "%%"),
        )
    add_runtime_arguments(p, env=True)


def resolve(args: argparse.Namespace) -> dict:
    """Flag > environment variable > default, for every flag (the runtime ones as a RuntimeConfig's fields)."""
    out = {}
    for flags, dest, typ, default, _ in SERVER_FLAGS:
        out[dest] = getattr(args, dest) if hasattr(args, dest) else env_default(flags, typ, default)
    out.update(vars(runtime_from_args(args)))
    return out


def run(args) -> int:
    """Every option is checked before the port is bound (ValueError: exit status 2); a model that cannot be
    loaded stops the server with one line and exit status 1."""
    from bitnetlm.parallel import tensor_parallel
    from bitnetlm.runtime.config import RuntimeConfig
    from bitnetlm.serve.server import ModelLoadError, serve

    o = resolve(args)
    cors = [s.strip() for s in (o.pop("cors_origins") or "").split(",") if s.strip()]
    runtime = RuntimeConfig(**{f: o.pop(f) for f in list(o) if f in RuntimeConfig.__dataclass_fields__})
    with tensor_parallel(o.pop("tp"), runtime.torch_device) as tp:
        if tp is not None:
            runtime = runtime.replace(device=str(tp.device))
            if not tp.lead:
                return _follow(o["model"], runtime, tp)
        try:
            serve(o.pop("model"), runtime=runtime, cors_origins=cors, tp=tp, **o)
        except ModelLoadError as e:
            print(f"bitnet serve: error: {e}", file=sys.stderr, flush=True)
            return 1
    return 0


def _follow(model_name, runtime, tp) -> int:
    """A rank other than 0: its shard of the model, making rank 0's runner calls until the server ends."""
    from bitnetlm import progress
    from bitnetlm.commands.generate import load_for_generation_sharded
    from bitnetlm.runtime.tp import follow

    with progress.disabled():
        model, _ = load_for_generation_sharded(model_name, runtime, tp)
    follow(model, runtime)
    return 0
