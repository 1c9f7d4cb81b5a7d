"""bitnet tune: tune the CUDA decode step's kernel tiles for a model shape on this GPU (bitnetlm.runtime.cuda.step_tune).

Each tuning key's tile is chosen by timing the whole captured decode step, not the projection alone; the choices
go into this GPU model's table ($BITNET_CACHE/step_tune/<GPU>.json, by default under ~/.cache/bitnetlm), which
every later engine on this GPU model takes ahead of its own tuning. Random weights of the model's shape: the
tiles depend on shapes only.
"""

from __future__ import annotations

import argparse
import json
import sys


def _ints(s: str) -> list[int]:
    from bitnetlm.runtime.args import int_list as _int_list

    out = _int_list(s)
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected batch sizes >= 1, found {s!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bitnetlm.models.shapes import SHAPES

    p.add_argument("-m", "--model", help="model directory (its config.json gives the shape; or use --shape)")
    p.add_argument("--shape", choices=sorted(SHAPES), help="a known model shape instead of -m")
    p.add_argument("-b", "--batches", type=_ints, default=[1, 8, 64], help="batch sizes (default: 1,8,64)")
    p.add_argument("--context", type=int, default=512, help="keys in the cache while timing (default: 512)")
    p.add_argument("--head-dtype", choices=["bf16", "int8"], default="bf16", help="embedding / LM head")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16) or fp8")
    p.add_argument("--reps", type=int, default=50, help="replays a timing (default: 50)")
    p.add_argument("--min-gain", type=float, default=0.005, help="a new tile must be this much faster")
    p.add_argument("--out", help="table to write (default: this GPU model's table in the user's cache)")
    p.add_argument("-v", "--verbose", action="store_true", help="print every candidate's ms/step")
    p.add_argument("--json", action="store_true", help="print results as JSON")


def run(args: argparse.Namespace) -> int:
    if bool(args.model) == bool(args.shape):
        print("bitnet tune: give exactly one of -m/--model or --shape", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print(
            "bitnet tune: needs a CUDA GPU (it times the GPU decode step); none is visible", file=sys.stderr
        )
        return 2
    from bitnetlm.models import ModelConfig
    from bitnetlm.models.shapes import SHAPES
    from bitnetlm.runtime.config import kv_cache_dtype as parse_kv_cache_dtype
    from bitnetlm.runtime.cuda.step_tune import tune_shape

    if args.shape:
        cfg = ModelConfig(**SHAPES[args.shape])
    else:
        from bitnetlm.formats.hf import read_config

        cfg = read_config(args.model)
    head = "int8" if args.head_dtype == "int8" else "fp"
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.verbose else None
    rows = tune_shape(
        cfg,
        args.batches,
        args.context,
        head,
        parse_kv_cache_dtype(args.kv_cache_dtype),
        args.reps,
        args.min_gain,
        out=args.out,
        log=log,
    )
    if args.json:
        print(json.dumps(dict(gpu=torch.cuda.get_device_name(), results=rows), indent=2))
        return 0
    print(f"GPU: {torch.cuda.get_device_name()}; table: {rows[0]['table']}\n")
    print(
        "| batch | tuning keys | changed | ms/step before | ms/step after |\n| ---: | ---: | ---: | ---: | ---: |"
    )
    for r in rows:
        print(
            f"| {r['batch']} | {r['keys']} | {len(r['changed'])} | {min(r['before_ms']):.3f} | "
            f"{min(r['after_ms']):.3f} |"
        )
    return 0
