"""Does a decode step's time depend on what ran before it in the process? (device machine)

    python benchmarks/gpu_step_order.py [--sequence 8,8,1,8,64,8,8,empty,8,16,8,gc,8] [--head int8]
        [--kv-cache-dtype fp8] [--context 512] [--max-keys 1024]

One random 2B4T engine, one process; each entry of --sequence runs in order:
- a batch size: the captured decode step timed as `gpu_profile.py` times it (`step_tune.step_ms`, a fresh capture,
  100 replays from the context; the best of two timings), printed as `batch B: ms/step`;
- `eager1`: batch 1's forward three times without a graph (its kernels load and run, nothing is captured);
- `keep1`: batch 1's step captured and replayed, and its graph kept alive to the end (step_ms frees its own);
- `empty`: the engine's graphs dropped and `torch.cuda.empty_cache()`; `gc`: `gc.collect()` and the same.
PERF_LOG stop 42: batch 8 measured 3% faster until a batch-1 step had run in the process.
"""

from __future__ import annotations

import argparse
import gc

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequence", default="8,8,1,8,64,8,8,empty,8,16,8,gc,8")
    ap.add_argument("--head", default="int8")
    ap.add_argument("--kv-cache-dtype", default="fp8")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--max-keys", type=int, default=1024)
    args = ap.parse_args()
    from bitnetlm.engine_cuda import CudaEngine, EngineConfig
    from bitnetlm.kernels.triton.bench import gpu_name
    from bitnetlm.kernels.triton.step_tune import step_ms
    from bitnetlm.models import ModelConfig
    from bitnetlm.models.cache import parse_kv_cache_dtype

    seq = args.sequence.split(",")
    bad = [x for x in seq if not x.isdigit() and x not in ("eager1", "keep1", "empty", "gc")]
    if bad:
        raise SystemExit(
            f"gpu_step_order.py: --sequence entry {bad[0]!r}: expected a batch size, eager1, keep1, empty or gc"
        )
    batches = [int(x) for x in seq if x.isdigit()] + [1]
    eng = CudaEngine.random(
        ModelConfig(),
        EngineConfig(
            max_batch=max(batches),
            max_seq_len=args.context + 200,
            head=args.head,
            kv_dtype=parse_kv_cache_dtype(args.kv_cache_dtype),
        ),
    )
    print(
        f"GPU: {gpu_name()}; context {args.context}, max keys {args.max_keys}, head {args.head}", flush=True
    )
    kept = []
    for item in seq:
        if item.isdigit():
            b = int(item)
            ms = min(step_ms(eng, b, args.context, args.max_keys, reps=100, tries=1) for _ in range(2))
            print(f"batch {b}: {ms:.3f} ms/step", flush=True)
        elif item == "eager1":
            tok = torch.zeros((1, 1), dtype=torch.long, device=eng.device)
            pos = torch.full((1,), args.context, dtype=torch.int32, device=eng.device)
            with torch.no_grad():
                for _ in range(3):
                    eng.forward(tok, pos, head_argmax=eng.head is None)
            torch.cuda.synchronize()
            print("eager1: batch 1's forward, no graph", flush=True)
        elif item == "keep1":
            st = eng.decode_state(1, max_keys=args.max_keys)
            st.pos.fill_(args.context)
            for _ in range(3):
                st.graph.replay()
            torch.cuda.synchronize()
            kept.append(st)  # step_ms clears eng._graphs; this reference keeps the graph and its pool alive
            print("keep1: batch 1's graph captured and kept", flush=True)
        else:  # empty, gc
            eng._graphs.clear()
            if item == "gc":
                gc.collect()
            torch.cuda.empty_cache()
            print(f"{item}: graphs dropped, cache emptied", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
