"""The shipped step-tune table of this GPU model: tiles timed in the whole captured decode step (GPU).

    python benchmarks/gpu_tune.py [--batches 1,8] [--context 512] [--max-keys K] [--head int8]
        [--kv-cache-dtype fp8] [--passes 1] [--rounds 3] [--min-gain 0.005] [--write] [--from-table]

The tuner (kernels/triton/tune.py) times each projection's candidates in a chain of calls of that projection
alone. In the step each kernel starts (programmatic dependent launch) while a different one drains, and whether
its programs find room on the SMs depends on that neighbour. This script takes one step's tuning keys, then for
each key in turn (coordinate descent, --passes times) recaptures the step with every candidate of that key and
keeps the fastest if it beats the current choice by --min-gain; last, the chain's choices and the step's choices
alternate for --rounds and both are printed. --write merges the step's choices into the table this package ships
for this GPU model (`bitnetlm/kernels/triton/configs/<GPU>.json`, which the tuner consults first). Random weights
of the 2B4T shape; the shipped table is ignored while this runs, so it starts from the chain's own choices, unless
--from-table: a re-tune from the shipped table's choices (the "chain" column is then the table's). The work is
`bitnetlm.runtime.cuda.step_tune`, which `bitnet tune` runs for any shape into the user's own table.
"""

from __future__ import annotations

import argparse

import common


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=common.int_list, default=[1, 8])
    ap.add_argument("--context", type=int, default=512, help="cached keys while timing")
    ap.add_argument("--max-keys", type=int, default=0, help="the step's key range (decode_state max_keys)")
    ap.add_argument("--head", default="int8", help="LM head: fp (bf16) or int8")
    ap.add_argument("--kv-cache-dtype", default="fp8", help="auto (bf16) or fp8")
    ap.add_argument("--passes", type=int, default=1, help="passes of the coordinate descent")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the before / after timing")
    ap.add_argument("--reps", type=int, default=50, help="replays a timing")
    ap.add_argument("--min-gain", type=float, default=0.005, help="a new choice must be this much faster")
    ap.add_argument("--write", action="store_true", help="merge the choices into the shipped table")
    ap.add_argument(
        "--from-table",
        action="store_true",
        help="start from the shipped table's choices (a re-tune: no chain timing) instead of the chain's",
    )
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    common.use_checkout()
    import torch

    from bitnetlm.kernels.triton import tune
    from bitnetlm.runtime.cuda import step_tune
    from bitnetlm.runtime.cuda.bench import random_engine

    if not torch.cuda.is_available():
        raise SystemExit("gpu_tune.py: needs a CUDA GPU; torch sees none")
    if args.from_table:
        tune.configure(user_tables=None)  # the shipped table only
    else:
        tune.configure(step_tables=False)  # start from the chain's own choices
    eng = random_engine(max(args.batches), args.context + args.reps + 8, args.head, args.kv_cache_dtype)
    common.header(
        "Step-tuned tiles (2B4T shape, random weights)",
        gpu=True,
        details=f"head {args.head}, KV cache {args.kv_cache_dtype}, {args.context} cached keys",
    )
    chosen: dict[str, dict] = {}
    for b in args.batches:
        print(f"\n#### batch {b}\n", flush=True)
        res = step_tune.tune_step(
            eng, b, args.context, args.max_keys, args.reps, args.min_gain, args.passes, log=print
        )
        ab = step_tune.compare(eng, res, args.context, args.max_keys, args.reps, args.rounds)
        rows = [
            [f"round {r + 1}", f"{tc:.3f}", f"{ts:.3f}", f"{ts / tc:.3f}"] for r, (tc, ts) in enumerate(ab)
        ]
        print()
        print(common.table([f"batch {b}", "chain ms/step", "step-tuned ms/step", "ratio"], rows), flush=True)
        for k in res.changed():
            print(f"changed {k}: {res.chain[k]} -> {res.step[k]}")
        chosen.update(res.table())
    if args.write:
        path = step_tune.write_table(tune.config_file(torch.cuda.get_device_name()), chosen)
        print(f"wrote {len(chosen)} choices into {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
