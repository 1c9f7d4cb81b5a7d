"""One projection's tiles, forced one at a time and timed in the whole captured decode step (GPU).

    python benchmarks/gpu_tile_step.py [--batches 4,8] [--proj gate_up|o|down] [--rounds 2]
        [--tile '{"SPLIT_T": 1, "PAIR": true}' ...] [--head int8] [--kv-cache-dtype fp8] [--max-keys 1024]

Random weights of the 2B4T shape, the shipped table's choices (the user's table ignored). For each batch the
projection's tuning key (its batch bucket) keeps every other key's choice while each --tile replaces its own:
a tile is the key's choice updated by the given fields, where SPLIT_T asks for that many K splits (CPS and
SPLIT then follow from BKB, as the tuner's `_splitk_cfg` derives them) and "PAIR": false drops a pairing. The
first line is the choice itself. `step_tune.step_ms` times each (settled, the better of two timings of 100
replays from context 512), --rounds times, interleaved. Unlike `gpu_step_tune.py` the tiles need not be the
tuner's candidates: this is how a tile missing from `tune._splitk_candidates` is found (docs/PERF_LOG.md, 2026-11-30:
gate|up's paired tile without a K split, `--proj gate_up --tile '{"SPLIT_T": 1, "PAIR": true}'`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROJ = {"gate_up": (6912, 2560), "o": (2560, 2560), "down": (2560, 6912)}  # key's (N, K), 2B4T


def tile(base: dict, fields: dict, kp: int) -> dict:
    """`base` updated by `fields`; SPLIT_T (K splits wanted) sets CPS and SPLIT from BKB and the K bytes kp."""
    d = dict(base, **{k: v for k, v in fields.items() if k != "SPLIT_T"})
    if fields.get("PAIR") is False:
        d.pop("PAIR")
    if "SPLIT_T" in fields or "BKB" in fields:
        chunks = -(-kp // d["BKB"])
        d["CPS"] = -(-chunks // fields.get("SPLIT_T", d["SPLIT"]))
        d["SPLIT"] = -(-chunks // d["CPS"])  # no empty split
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="4,8")
    ap.add_argument("--proj", default="gate_up", choices=sorted(PROJ))
    ap.add_argument(
        "--tile", action="append", default=[], help="JSON fields over the key's choice (repeatable)"
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--max-keys", type=int, default=1024)
    ap.add_argument("--head", default="int8")
    ap.add_argument("--kv-cache-dtype", default="fp8")
    args = ap.parse_args()
    from bitnetlm.kernels.triton import tune
    from bitnetlm.runtime.cuda import step_tune
    from bitnetlm.runtime.cuda.bench import random_engine

    tune.configure(user_tables=None)  # the shipped table only
    batches = [int(b) for b in args.batches.split(",")]
    # step_ms replays 100 steps past the context
    eng = random_engine(max(batches), args.context + 108, args.head, args.kv_cache_dtype)
    n, k = PROJ[args.proj]
    fields = [json.loads(t) for t in args.tile]
    print(
        f"# {torch.cuda.get_device_name()}, 2B4T shape, head {args.head}, cache {args.kv_cache_dtype}, {args.proj}"
    )
    for b in batches:
        tune._choice.clear()
        tune._candidates.clear()
        eng._graphs.clear()
        eng.decode_state(b, max_keys=args.max_keys)  # loads (or tunes) every key of this step
        bucket = 1 << (b - 1).bit_length()
        key = next(c for c in tune._choice if c[0] == "auto" and c[1:4] == (n, k, bucket))
        base = tune._choice[key]
        tiles = [base] + [tile(base, f, k // 4) for f in fields]
        tiles = [t for i, t in enumerate(tiles) if t not in tiles[:i]]
        print(
            f"\n## batch {b}, key {key}\n| tile | "
            + " | ".join(f"round {r + 1}" for r in range(args.rounds))
            + " |"
        )
        print("| --- |" + " ---: |" * args.rounds)
        times = {i: [] for i in range(len(tiles))}
        for _ in range(args.rounds):
            for i, t in enumerate(tiles):
                tune._choice[key] = t
                times[i].append(step_tune.step_ms(eng, b, args.context, args.max_keys, 100))
        for i, t in enumerate(tiles):
            mark = " (the choice)" if i == 0 else ""
            print(
                f"| {step_tune._short(t)}{mark} | " + " | ".join(f"{x:.3f}" for x in times[i]) + " |",
                flush=True,
            )
        tune._choice[key] = base
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
