"""Tile choices timed in the whole captured decode step (GPU) against the tuner's chain timing.

    python benchmarks/gpu_step_tune.py [--batches 1,8] [--context 512] [--max-keys K] [--head int8]
        [--kv-cache-dtype fp8] [--passes 1] [--rounds 3] [--min-gain 0.005] [--write] [--from-table]

The tuner (kernels/triton/tune.py) times each projection's candidates in a chain of calls of that projection
alone. In the step each kernel starts (programmatic dependent launch) while a different one drains, and whether
its programs find room on the SMs depends on that neighbour. This script takes one step's tuning keys, then for
each key in turn (coordinate descent, --passes times) recaptures the step with every candidate of that key and
keeps the fastest if it beats the current choice by --min-gain; last, the chain's choices and the step's choices
alternate for --rounds and both are printed. --write merges the step's choices into the package's shipped table
for this GPU model (kernels/triton/configs/, which `tune._tune` consults first). Random weights of the 2B4T
shape; the shipped table is ignored while this runs, so it starts from the chain's own choices, unless
--from-table: a re-tune from the shipped table's choices (the "chain" column is then the table's). The work
is `bitnetlm.runtime.cuda.step_tune`, which `bitnet tune` runs for any shape into the user's own table.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--max-keys", type=int, default=0, help="the step's key range (decode_state max_keys)")
    ap.add_argument("--head", default="int8")
    ap.add_argument("--kv-cache-dtype", default="fp8")
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=50, help="replays a timing")
    ap.add_argument("--min-gain", type=float, default=0.005, help="a new choice must be this much faster")
    ap.add_argument("--write", action="store_true", help="merge the choices into the shipped table")
    ap.add_argument(
        "--from-table",
        action="store_true",
        help="start from the shipped table's choices (a re-tune: no chain timing) instead of the chain's",
    )
    args = ap.parse_args()
    from bitnetlm.kernels.triton import tune
    from bitnetlm.runtime.cuda import step_tune
    from bitnetlm.runtime.cuda.bench import random_engine

    if args.from_table:
        tune.configure(user_tables=None)  # the shipped table only
    else:
        tune.configure(step_tables=False)  # start from the chain's own choices
    batches = [int(b) for b in args.batches.split(",")]
    eng = random_engine(max(batches), args.context + args.reps + 8, args.head, args.kv_cache_dtype)
    print(f"# {torch.cuda.get_device_name()}, 2B4T shape, head {args.head}, cache {args.kv_cache_dtype}")
    chosen: dict[str, dict] = {}
    for b in batches:
        print(f"\n## batch {b}", flush=True)
        res = step_tune.tune_step(
            eng, b, args.context, args.max_keys, args.reps, args.min_gain, args.passes, log=print
        )
        print(f"\n| batch {b} | chain ms/step | step-tuned ms/step | ratio |\n| --- | ---: | ---: | ---: |")
        ab = step_tune.compare(eng, res, args.context, args.max_keys, args.reps, args.rounds)
        for r, (tc, ts) in enumerate(ab):
            print(f"| round {r + 1} | {tc:.3f} | {ts:.3f} | {ts / tc:.3f} |", flush=True)
        for k in res.changed():
            print(f"changed {k}: {res.chain[k]} -> {res.step[k]}")
        chosen.update(res.table())
    if args.write:
        path = step_tune.write_table(tune.config_file(torch.cuda.get_device_name()), chosen)
        print(f"wrote {len(chosen)} choices into {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
