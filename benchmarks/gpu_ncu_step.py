"""One captured decode step for Nsight Compute (device machine): only its replay runs inside the profiler range.

    ncu --clock-control none --graph-profiling node --profile-from-start off -k "regex:^_" -c 7 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section MemoryWorkloadAnalysis python benchmarks/gpu_ncu_step.py --batch 8 [--kv-cache-dtype fp8]

Random weights of the 2B4T shape at a context of --context keys. The engine is built, its step captured and
replayed three times (tuning, if the tuner's disk cache lacks the shapes, happens here, outside the range); then
one replay runs between `torch.cuda.profiler.start()` and `stop()`. `-k "regex:^_" -c 7` picks the first seven
Triton kernels of the step: at batch 1 one of each kind in layer 0 (at batch 8-64, whose layers have more
launches, the first seven of layer 0). ncu runs kernels one at a time with cold caches, so the
durations it reports carry each launch's start and drain, which programmatic dependent launch hides in the step.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16), bf16 or fp8")
    args = ap.parse_args()
    from bitnetlm.runtime.cuda.bench import random_engine

    eng = random_engine(args.batch, args.context + 200, kv_cache_dtype=args.kv_cache_dtype)
    st = eng.decode_state(args.batch)
    for _ in range(3):
        st.pos.fill_(args.context)
        st.step.fill_(1)
        st.graph.replay()
    torch.cuda.synchronize()
    st.pos.fill_(args.context)
    torch.cuda.profiler.start()
    st.graph.replay()
    torch.cuda.profiler.stop()
    torch.cuda.synchronize()
    print(
        f"{torch.cuda.get_device_name()}: one decode step, batch {args.batch}, context {args.context}, "
        f"KV cache {args.kv_cache_dtype}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
