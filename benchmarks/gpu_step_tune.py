"""Tile choices timed in the whole captured decode step (device machine) against the tuner's chain timing.

    python benchmarks/gpu_step_tune.py [--batches 1,8] [--context 512] [--max-keys K] [--head int8]
        [--kv-cache-dtype fp8] [--passes 1] [--rounds 3] [--min-gain 0.005] [--write]

The tuner (kernels/triton/tune.py) times each projection's candidates in a chain of calls of that projection
alone. In the step each kernel starts (programmatic dependent launch) while a different one drains, and whether
its programs find room on the SMs depends on that neighbour. This script takes one step's tuning keys, then for
each key in turn (coordinate descent, --passes times) recaptures the step with every candidate of that key and
keeps the fastest if it beats the current choice by --min-gain; last, the chain's choices and the step's choices
alternate for --rounds and both are printed. --write merges the step's choices into the package's shipped table
for this GPU model (kernels/triton/configs/, which `tune._tune` consults first). Random weights of the 2B4T
shape; the shipped table is ignored while this runs, so it starts from the chain's own choices.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _short(cfg: dict) -> str:
    return "/".join(f"{k}={v}" for k, v in cfg.items())


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
    args = ap.parse_args()
    from bitnetlm.engine_cuda import CudaEngine, EngineConfig
    from bitnetlm.kernels.triton import tune
    from bitnetlm.models import ModelConfig
    from bitnetlm.models.cache import parse_kv_cache_dtype

    tune.SHIPPED = False
    batches = [int(b) for b in args.batches.split(",")]
    chosen: dict[str, dict] = {}
    eng = CudaEngine.random(
        ModelConfig(),
        EngineConfig(
            max_batch=max(batches),
            max_seq_len=args.context + 3 * args.reps + 64,
            head=args.head,
            kv_dtype=parse_kv_cache_dtype(args.kv_cache_dtype),
        ),
    )
    print(f"# {torch.cuda.get_device_name()}, 2B4T shape, head {args.head}, cache {args.kv_cache_dtype}")

    def step_ms(b: int) -> float:
        eng._graphs.clear()
        st = eng.decode_state(b, max_keys=args.max_keys)
        best = float("inf")
        for _ in range(2):  # the better of two timings: a one-off stall is not a tile's fault
            st.pos.fill_(args.context)
            st.step.fill_(1)
            for _ in range(3):
                st.graph.replay()
            a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(args.reps):
                st.graph.replay()
            e.record()
            e.synchronize()
            best = min(best, a.elapsed_time(e) / args.reps)
        return best

    for b in batches:
        tune._choice.clear()
        tune._candidates.clear()
        eng._graphs.clear()
        eng.decode_state(b, max_keys=args.max_keys)  # tunes (or loads) every key of this step
        keys = [k for k, c in tune._candidates.items() if len(c) > 1]
        chain = {k: tune._choice[k] for k in keys}
        base = step_ms(b)
        print(f"\n## batch {b}: {len(keys)} tuned keys, chain choices {base:.3f} ms/step", flush=True)
        for _ in range(args.passes):
            for k in keys:
                times = []
                cur = tune._choice[k]
                for cfg in tune._candidates[k]:
                    tune._choice[k] = cfg
                    try:
                        times.append((step_ms(b), cfg))
                    except Exception as exc:  # a candidate that does not compile here
                        print(f"  {k}: {_short(cfg)} failed: {type(exc).__name__}")
                t, cfg = min(times, key=lambda tc: tc[0])
                now = next((tc for tc, c in times if c == cur), float("inf"))
                cfg = cfg if t < now * (1 - args.min_gain) else cur
                tune._choice[k] = cfg
                print(f"- {k}")
                for tc, c in times:
                    mark = (" chain" if c == chain[k] else "") + (" <- step" if c == cfg else "")
                    print(f"    {tc:.3f}  {_short(c)}{mark}", flush=True)
        step = {k: tune._choice[k] for k in keys}
        print(f"\n| batch {b} | chain ms/step | step-tuned ms/step | ratio |\n| --- | ---: | ---: | ---: |")
        for r in range(args.rounds):
            tune._choice.update(chain)
            tc = step_ms(b)
            tune._choice.update(step)
            ts = step_ms(b)
            print(f"| round {r + 1} | {tc:.3f} | {ts:.3f} | {ts / tc:.3f} |", flush=True)
        changed = [k for k in keys if chain[k] != step[k]]
        for k in changed:
            print(f"changed {k}: {_short(chain[k])} -> {_short(step[k])}")
        chosen.update({str(k): step[k] for k in keys})
    if args.write:
        path = tune.config_file(torch.cuda.get_device_name())
        table = json.loads(path.read_text()) if path.exists() else {}
        table.update(chosen)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
        os.replace(tmp, path)
        print(f"wrote {len(chosen)} choices into {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
