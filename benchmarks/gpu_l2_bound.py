"""How much of a decode step waits on DRAM for weights (device machine): an upper bound by L2-resident weights.

    python benchmarks/gpu_l2_bound.py [--batches 1,8] [--rounds 2] [--context 512] [--max-keys 1024]
        [--head int8] [--kv-cache-dtype fp8]

Random weights of the 2B4T shape. Times the captured decode step (ms/step, `step_tune.step_ms`) as it is, then
with every layer reading layer 0's projection weights (17 MB, which stay in L2 from layer to layer), with that
and the attention's L2 prefetch off, and with only the MLP's weights shared. The shared steps compute other
numbers (the weights differ) through the same kernels and shapes, so their time is what the step would take if
no weight read missed L2: the gap to the real step is all that any weight prefetch can still win.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--max-keys", type=int, default=1024)
    ap.add_argument("--head", default="int8", help="LM head: fp (bf16) or int8")
    ap.add_argument("--kv-cache-dtype", default="fp8", help="auto (bf16), bf16 or fp8")
    args = ap.parse_args()

    from bitnetlm.kernels.triton import attention
    from bitnetlm.kernels.triton.bench import gpu_name, random_engine
    from bitnetlm.kernels.triton.step_tune import step_ms

    batches = [int(b) for b in args.batches.split(",")]
    eng = random_engine(max(batches), args.context + 200, args.head, args.kv_cache_dtype)
    own = list(eng.layers)
    l0 = own[0]
    shared = [dataclasses.replace(L, qkv=l0.qkv, o=l0.o, gate_up=l0.gate_up, down=l0.down) for L in own]
    mlp = [dataclasses.replace(L, gate_up=l0.gate_up, down=l0.down) for L in own]
    variants = (  # (name, layers, the attention's prefetch override: -1 its table, 0 none)
        ("own weights", own, -1),
        ("every layer layer 0's", shared, -1),
        ("every layer layer 0's, no attention prefetch", shared, 0),
        ("MLP weights layer 0's", mlp, -1),
    )
    print(f"GPU: {gpu_name()}; head {args.head}, KV cache {args.kv_cache_dtype}, context {args.context}")
    print("\n| batch | round | " + " | ".join(v[0] for v in variants) + " |")
    print("| ---: | ---: |" + " ---: |" * len(variants))
    saved = attention.ATTN_PF_PROGRAMS
    try:
        for b in batches:
            for r in range(args.rounds):
                row = []
                for _, layers, pf in variants:
                    eng.layers, attention.ATTN_PF_PROGRAMS = layers, pf
                    row.append(step_ms(eng, b, args.context, args.max_keys, reps=100, tries=1))
                print(f"| {b} | {r + 1} | " + " | ".join(f"{ms:.3f}" for ms in row) + " |", flush=True)
    finally:
        eng.layers, attention.ATTN_PF_PROGRAMS = own, saved
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
