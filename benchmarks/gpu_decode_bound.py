"""Is a decode step bound by DRAM (weight reads) or by latency? (device machine)

    python benchmarks/gpu_decode_bound.py [--batches 1,2,8] [--rounds 2]

The same ternary engine (2B4T shape, random weights in the real packed layout) decodes with its own weights per
layer, then with every layer pointing at layer 0's weights (17 MB, which stay resident in L2 after the first
layer). The KV caches stay per layer. If the step were bound by reading weights from DRAM, the shared-weights step
would be far faster. Alternating rounds in one process; prints a markdown table naming the GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,2,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128)
    args = ap.parse_args()
    from bitnetlm.runtime.cuda.bench import bench_engine, gpu_name, random_engine

    batches = tuple(int(b) for b in args.batches.split(","))
    pre = 16  # bench_engine's prefill rows (not shown): a short chunk after the context
    eng = random_engine(max(batches), args.context + pre + args.n_gen + 1)
    own = list(eng.layers)
    ms: dict = {}
    for _ in range(args.rounds):
        for label, layers in (
            ("own weights per layer", own),
            ("all layers share layer 0 (L2)", [own[0]] * len(own)),
        ):
            eng.layers = layers
            for r in bench_engine(eng, batches, pre, args.n_gen, reps=3, depths=(args.context,)):
                ms.setdefault((label, r["batch"]), []).append(r["decode_ms_per_step"])
    eng.layers = own
    print(
        f"GPU: {gpu_name()}; context {args.context}, {args.n_gen} decode steps, bf16 head; median of rounds\n"
    )
    print("| batch | own weights ms/step | shared (L2-resident) ms/step | speed-up |")
    print("| ---: | ---: | ---: | ---: |")
    for b in batches:
        a = statistics.median(ms[("own weights per layer", b)])
        s = statistics.median(ms[("all layers share layer 0 (L2)", b)])
        print(f"| {b} | {a:.3f} | {s:.3f} | {a / s:.3f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
