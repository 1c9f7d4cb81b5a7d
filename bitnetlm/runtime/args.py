"""The runtime options as command-line flags: one group shared by generate, chat, serve, bench, tune and eval.

Each flag fills one RuntimeConfig field (`runtime_from_args`), so every command parses the options the same
way and validates them once. `bitnet serve` also reads each flag from an environment variable (BITNET_<FLAG>).
"""

from __future__ import annotations

import argparse
import os

from bitnetlm.runtime.config import (
    BACKENDS,
    DTYPES,
    HEAD_DTYPES,
    KV_CACHE_DTYPES,
    WEIGHTS_LAYOUTS,
    RuntimeConfig,
)


def parse_bool(raw) -> bool:
    v = str(raw).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), found {raw!r}")


parse_bool.__name__ = "bool"

# (flags, RuntimeConfig field, type, help); defaults come from RuntimeConfig
RUNTIME_FLAGS = [
    (("--device",), "device", str, "cpu, cuda, cuda:N or auto (a GPU when there is one)"),
    (
        ("--dtype",),
        "dtype",
        str,
        f"activation dtype: {', '.join(DTYPES)} (default: float32 on CPU, bfloat16 on CUDA)",
    ),
    (("--backend",), "backend", str, f"ternary kernels: {', '.join(BACKENDS)} (default: the best available)"),
    (
        ("--kv-cache-dtype",),
        "kv_cache_dtype",
        str,
        f"KV-cache elements: {', '.join(KV_CACHE_DTYPES)} (auto: the activation dtype; bf16 halves a float32 "
        "cache on the CPU; fp8: e4m3, unscaled, CUDA)",
    ),
    (
        ("--head-dtype",),
        "head_dtype",
        str,
        f"embedding + LM head storage: {', '.join(HEAD_DTYPES)} (CPU: faster decode; CUDA: int8 = the graph "
        "engine's int8 head)",
    ),
    (("-t", "--threads"), "threads", int, "CPU threads for the kernels (default: physical cores)"),
    (
        ("--weights-layout",),
        "weights_layout",
        str,
        f"CPU ternary weights: {', '.join(WEIGHTS_LAYOUTS)} (2 or 1.6 bits a weight: base3 reads 20% fewer "
        "bytes a token and unpacks them with more work; auto times both at load and keeps the faster)",
    ),
    (
        ("--enforce-eager",),
        "enforce_eager",
        parse_bool,
        "CUDA: run the model's own forward per token instead of captured CUDA graphs",
    ),
    (("-c", "--ctx-size"), "max_seq_len", int, "context length in tokens (default: the model's)"),
    (("-np", "--max-batch", "--parallel"), "max_batch", int, "sequences decoded together (KV-cache rows)"),
    (
        ("--kv-tokens",),
        "kv_tokens",
        int,
        "a paged KV cache of this many positions shared by all rows, taken in blocks as tokens arrive, prompt "
        "prefixes shared (CPU, and the CUDA engine); 0: a static cache of --ctx-size positions per row (default: "
        "serve on a CPU pages --max-batch x --ctx-size positions; otherwise static)",
    ),
    (("--kv-block-size",), "kv_block_size", int, "positions per block of the paged KV cache (--kv-tokens)"),
]
ALL = tuple(f[1] for f in RUNTIME_FLAGS)
OFFLINE = tuple(d for d in ALL if d != "max_batch")  # generate / chat: one row per prompt


def int_list(s: str) -> list[int]:
    """A comma-separated list of integers (an argparse type)."""
    try:
        return [int(v) for v in s.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, found {s!r}") from None


def env_name(flags: tuple[str, ...]) -> str:
    """BITNET_<the first long flag>, e.g. --ctx-size -> BITNET_CTX_SIZE."""
    long = next(f for f in flags if f.startswith("--"))
    return "BITNET_" + long[2:].replace("-", "_").upper()


def add_runtime_arguments(p: argparse.ArgumentParser, fields=ALL, env: bool = False) -> None:
    """The runtime flags for `fields` (RuntimeConfig field names). env=True: each flag's default comes from its
    BITNET_<FLAG> environment variable (read by `runtime_from_args`), and its help names it."""
    defaults = RuntimeConfig()
    g = p.add_argument_group("runtime")
    for flags, dest, typ, text in RUNTIME_FLAGS:
        if dest not in fields:
            continue
        default = getattr(defaults, dest)
        shown = "off" if default in (None, False) else default
        extra = dict(nargs="?", const=True) if typ is parse_bool else {}  # `--enforce-eager` alone means true
        where = f"env {env_name(flags)}; " if env else ""
        g.add_argument(
            *flags,
            dest=dest,
            type=typ,
            default=argparse.SUPPRESS if env else default,
            help=f"{text} ({where}default: {shown})".replace("%", "%%"),
            **extra,
        )


def env_default(flags: tuple[str, ...], typ, default):
    """A flag's value from its environment variable, else `default`; a bad value names the variable."""
    name = env_name(flags)
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return typ(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r}: expected {typ.__name__}") from None


def runtime_values(args: argparse.Namespace, fields=ALL) -> dict:
    """The RuntimeConfig fields among `args` (a flag given wins over its environment variable)."""
    defaults = RuntimeConfig()
    out = {}
    for flags, dest, typ, _ in RUNTIME_FLAGS:
        if dest in fields:
            out[dest] = (
                getattr(args, dest)
                if hasattr(args, dest)
                else env_default(flags, typ, getattr(defaults, dest))
            )
    return out


def runtime_from_args(args: argparse.Namespace, fields=ALL) -> RuntimeConfig:
    return RuntimeConfig(**runtime_values(args, fields))
