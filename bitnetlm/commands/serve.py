"""bitnet serve -m MODEL [--host --port --api-key --max-batch --max-queue ...]: OpenAI-compatible HTTP server.

Every flag can also come from an environment variable BITNET_<FLAG> (e.g. BITNET_PORT=9000,
BITNET_API_KEY=...); a flag on the command line wins over the variable. Library form: bitnetlm.serve.serve().
"""

from __future__ import annotations

import argparse
import sys

from bitnetlm.generate.args import CONTEXT_FLAGS, SPECULATIVE_FLAGS
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
        ("--prefix-caching",),
        "prefix_caching",
        parse_bool,
        True,
        "reuse the keys and values of a prompt prefix a KV row already holds (on/off)",
    ),
    (
        ("--cors-origins",),
        "cors_origins",
        str,
        None,
        "comma-separated origins allowed by CORS (default: CORS off)",
    ),
    (
        ("--grpc-port",),
        "grpc_port",
        int,
        None,
        "also serve gRPC on this port of --host: the KServe v2 inference protocol and a streaming Generate call "
        '(needs grpcio: pip install "bitnet-lm[grpc]"; 0 = any free port)',
    ),
    (
        ("--max-models",),
        "max_models",
        int,
        1,
        "models served at once by name, each with its own engine (POST /v1/admin/models loads more); a "
        "load beyond it is refused",
    ),
    (
        ("--allow-admin",),
        "allow_admin",
        parse_bool,
        False,
        "allow POST /v1/admin/models (load / unload / list models) on a server without --api-key",
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
    *CONTEXT_FLAGS,
]
# replicas on Ray Serve (bitnetlm.serve.ray): off unless --replicas is given
REPLICA_FLAGS = [
    (
        ("--replicas",),
        "replicas",
        int,
        None,
        "engine replicas behind Ray Serve's router (needs `ray[serve]`)",
    ),
    (
        ("--max-replicas",),
        "max_replicas",
        int,
        None,
        "autoscale between --replicas and this many replicas on the requests in flight per replica",
    ),
    (("--replica-cpus",), "cpus", float, 1.0, "CPU cores reserved for each replica"),
    (("--replica-gpus",), "gpus", float, 0.0, "GPUs for each replica (1 = one GPU each)"),
    (("--ray-address",), "ray_address", str, None, "join this Ray cluster instead of starting a local one"),
]
SERVER_FLAGS += REPLICA_FLAGS
# every flag of the command: (flags, dest) pairs, for the environment variables' names
FLAGS = [(f, d, t, dflt, h) for f, d, t, dflt, h in SERVER_FLAGS] + [
    (f, d, t, None, h) for f, d, t, h in RUNTIME_FLAGS
]
_BY_DEST = {d: f for f, d, *_ in FLAGS}


def env_name(dest: str) -> str:
    return _env_name(_BY_DEST[dest])


def add_arguments(p: argparse.ArgumentParser) -> None:
    for flags, dest, typ, default, text in SERVER_FLAGS:
        shown = {"model": "the zoo's default model", "model_name": "the model's directory name"}.get(
            dest, "off" if default is None else default
        )
        extra = dict(nargs="?", const=True) if typ is parse_bool else {}  # a boolean flag alone means true
        p.add_argument(
            *flags,
            dest=dest,
            type=typ,
            default=argparse.SUPPRESS,
            help=f"{text} (env {env_name(dest)}; default: {shown})".replace("%", "%%"),
            **extra,
        )
    add_runtime_arguments(p, env=True)


def resolve(args: argparse.Namespace) -> dict:
    """Flag > environment variable > default, for every flag (the runtime ones as a RuntimeConfig's fields)."""
    out = {}
    for flags, dest, typ, default, _ in SERVER_FLAGS:
        out[dest] = getattr(args, dest) if hasattr(args, dest) else env_default(flags, typ, default)
    out.update(vars(runtime_from_args(args)))
    return out


def _replicas(o: dict):
    """Pop the replica flags from the resolved options: (ReplicaConfig or None, Ray address)."""
    given = {d: (flags[0], o.pop(d), dflt) for flags, d, _, dflt, _ in REPLICA_FLAGS}
    address = given.pop("ray_address")[1]
    if given["replicas"][1] is None:
        for flag, v, dflt in [*given.values(), ("--ray-address", address, None)]:
            if v != dflt:
                raise ValueError(f"{flag} needs --replicas (serving on Ray Serve)")
        return None, None
    from bitnetlm.deps import require

    require("ray.serve", "bitnet serve --replicas")
    from bitnetlm.serve.ray import ReplicaConfig

    return ReplicaConfig(**{d: v for d, (_, v, _) in given.items()}), address


def run(args) -> int:
    """Every option is checked before the port is bound (ValueError: exit status 2); a model that cannot be
    loaded stops the server with one line and exit status 1."""
    from bitnetlm.parallel import tensor_parallel
    from bitnetlm.runtime.config import RuntimeConfig
    from bitnetlm.serve.server import ModelLoadError, serve

    o = resolve(args)
    cors = [s.strip() for s in (o.pop("cors_origins") or "").split(",") if s.strip()]
    runtime = RuntimeConfig(**{f: o.pop(f) for f in list(o) if f in RuntimeConfig.__dataclass_fields__})
    replicas, address = _replicas(o)
    n_tp = o.pop("tp")
    if replicas is not None and n_tp != 1:
        raise ValueError(f"--tp {n_tp} with --replicas: a replica is one process (use --replica-gpus)")
    with tensor_parallel(n_tp, runtime.torch_device) as tp:
        if tp is not None:
            runtime = runtime.replace(device=str(tp.device))
            if not tp.lead:
                return _follow(o["model"], runtime, tp)
        try:
            if replicas is not None:
                from bitnetlm.serve.ray import serve_replicas

                serve_replicas(
                    o.pop("model"),
                    replicas=replicas,
                    address=address,
                    runtime=runtime,
                    cors_origins=cors,
                    **o,
                )
            else:
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
