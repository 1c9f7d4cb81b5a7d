"""How much of a decode step waits on DRAM for weights (GPU): an upper bound by L2-resident weights.

    python benchmarks/gpu_l2_bound.py [--batches 1,8] [--rounds 2] [--context 512[,0]] [--max-keys 1024]
        [--head int8] [--kv-cache-dtype fp8]

Random weights of the 2B4T shape. Times the captured decode step (ms/step, `step_tune.step_ms`) as it is, then
with every layer reading layer 0's projection weights (17 MB, which stay in L2 from layer to layer), with that
and the attention's L2 prefetch off, with only the MLP's weights shared, and with every layer reading and writing
layer 0's KV cache (its own weights: at batch 8 and 512 keys a float8 layer's K/V are 5.2 MB, which stay in L2).
The shared steps compute other numbers (the weights or caches differ) through the same kernels and shapes, so
their time is what the step would take if no weight (or K/V) read missed L2: the gap to the real step is all that
any weight (or K/V) prefetch can still win.
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
    ap.add_argument("--context", default="512", help="keys already cached, comma-separated")
    ap.add_argument("--max-keys", type=int, default=1024)
    ap.add_argument("--head", default="int8", help="LM head: fp (bf16) or int8")
    ap.add_argument("--kv-cache-dtype", default="fp8", help="auto (bf16), bf16 or fp8")
    args = ap.parse_args()

    from bitnetlm.runtime.cuda.bench import gpu_name, random_engine
    from bitnetlm.runtime.cuda.step_tune import step_ms

    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.context.split(",")]
    eng = random_engine(max(batches), max(contexts) + 200, args.head, args.kv_cache_dtype)
    own = list(eng.layers)
    l0 = own[0]
    shared = [dataclasses.replace(L, qkv=l0.qkv, o=l0.o, gate_up=l0.gate_up, down=l0.down) for L in own]
    mlp = [dataclasses.replace(L, gate_up=l0.gate_up, down=l0.down) for L in own]
    kv_own = (eng.k_cache, eng.v_cache)
    kv_l0 = ([eng.k_cache[0]] * len(own), [eng.v_cache[0]] * len(own))
    variants = (  # (name, layers, KV caches, the plan's attn_pf_programs: -1 its table, 0 none)
        ("own weights", own, kv_own, -1),
        ("every layer layer 0's", shared, kv_own, -1),
        ("every layer layer 0's, no attention prefetch", shared, kv_own, 0),
        ("MLP weights layer 0's", mlp, kv_own, -1),
        ("KV cache layer 0's", own, kv_l0, -1),
    )
    print(f"GPU: {gpu_name()}; head {args.head}, KV cache {args.kv_cache_dtype}, contexts {args.context}")
    print("\n| batch | context | round | " + " | ".join(v[0] for v in variants) + " |")
    print("| ---: | ---: | ---: |" + " ---: |" * len(variants))
    plan = eng.plan
    try:
        for b in batches:
            for c in contexts:
                for r in range(args.rounds):
                    row = []
                    for _, layers, kv, pf in variants:
                        eng.layers, (eng.k_cache, eng.v_cache) = layers, kv
                        eng.plan = dataclasses.replace(plan, attn_pf_programs=pf)
                        row.append(step_ms(eng, b, c, args.max_keys, reps=100, tries=1))
                    print(
                        f"| {b} | {c} | {r + 1} | " + " | ".join(f"{ms:.3f}" for ms in row) + " |", flush=True
                    )
    finally:
        eng.layers, (eng.k_cache, eng.v_cache), eng.plan = own, kv_own, plan
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
