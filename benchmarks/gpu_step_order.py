"""Does a decode step's time depend on what ran before it in the process? (device machine)

    python benchmarks/gpu_step_order.py [--sequence 8,8,1,8,64,8,8,empty,8,16,8,gc,8] [--head int8]
        [--kv-cache-dtype fp8] [--context 512] [--max-keys 1024]

One random 2B4T engine, one process; each entry of --sequence runs in order:
- a batch size: the captured decode step timed by `step_tune.step_ms` without its settling (a fresh capture,
  100 replays from the context), twice, printed as `batch B: ms/step` (the better of the two);
- `again`: the last captured step timed again the same way, without a new capture (`againB`: the last of batch B);
- `eager1`: batch 1's forward three times without a graph (its kernels load and run, nothing is captured);
- `keep1`: batch 1's step captured and replayed, and its graph kept alive to the end (step_ms frees its own);
- `tiny`: a graph of one small kernel captured and kept; `dropkept`: the graphs keep1 and tiny kept destroyed;
- `settle`: `step_tune.settle_graphs()` (three small graphs, once a process);
- `newcs`: the next capture on a new capture stream; `upload`: cuGraphUpload of the last captured step;
- `empty`: the engine's graphs dropped and `torch.cuda.empty_cache()`; `gc`: `gc.collect()` and the same;
- `smi`: nvidia-smi's temperatures, clocks, power and throttle reasons; `mem`: the caching allocator's reserved
  and allocated bytes and segments; `zero`: every KV cache and the last step's input tokens zeroed; `tokens`:
  the last step's input tokens; `sleep`: two seconds idle;
- `prof`: 20 replays of the last captured step under torch.profiler, a Chrome trace in --trace-dir.
--again-stream side (a new side stream) or capture (torch's capture stream) replays `again` off the default
stream. docs/PERF_LOG.md stop 43: a process's first captured steps replay a batch-8 step 3% faster than those
timed after a few more captures of anything; that is why step_ms settles first.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ENTRIES = ("eager1", "keep1", "empty", "gc", "mem", "sleep", "again", "smi", "zero", "tokens", "prof", "tiny")
ENTRIES += ("dropkept", "newcs", "upload", "settle")


def _time_replays(st, context: int, stream: str = "default", reps: int = 100) -> float:
    from bitnetlm.runtime.cuda.step_tune import replay_ms

    if stream == "default":
        return replay_ms(st, context, reps)
    side = torch.cuda.Stream() if stream == "side" else torch.cuda.graph.default_capture_stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        return replay_ms(st, context, reps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequence", default="8,8,1,8,64,8,8,empty,8,16,8,gc,8")
    ap.add_argument("--head", default="int8")
    ap.add_argument("--kv-cache-dtype", default="fp8")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--max-keys", type=int, default=1024)
    ap.add_argument("--trace-dir", default=".", help="where `prof` entries write their Chrome traces")
    ap.add_argument("--again-stream", choices=("default", "side", "capture"), default="default")
    args = ap.parse_args()
    from bitnetlm.runtime.cuda.bench import gpu_name, random_engine
    from bitnetlm.runtime.cuda.step_tune import settle_graphs, small_graph, step_ms

    seq = args.sequence.split(",")
    bad = [
        x
        for x in seq
        if not x.isdigit() and not (x.startswith("again") and x[5:].isdigit()) and x not in ENTRIES
    ]
    if bad:
        raise SystemExit(
            f"gpu_step_order.py: --sequence entry {bad[0]!r}: expected a batch size or an entry the docstring names"
        )
    batches = [int(x) for x in seq if x.isdigit()] + [1]
    eng = random_engine(max(batches), args.context + 200, args.head, args.kv_cache_dtype)
    print(
        f"GPU: {gpu_name()}; context {args.context}, max keys {args.max_keys}, head {args.head}", flush=True
    )
    kept = []
    for i, item in enumerate(seq):
        torch.cuda.nvtx.range_push(f"{i}:{item}")  # names each entry's kernels in an nsys trace
        if item.isdigit():
            b = int(item)
            ms = min(
                step_ms(eng, b, args.context, args.max_keys, reps=100, tries=1, settle=False)
                for _ in range(2)
            )
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
        elif item.startswith("again"):  # again, or againB: the last captured step of batch B
            st = [s for s in eng._graphs.values() if item == "again" or s.tok.shape[0] == int(item[5:])][-1]
            ms = min(_time_replays(st, args.context, args.again_stream) for _ in range(2))
            print(f"again (batch {st.tok.shape[0]}, no new capture): {ms:.3f} ms/step", flush=True)
        elif item == "settle":
            settle_graphs()
            print("settle: step_tune.settle_graphs()", flush=True)
        elif item == "tiny":
            g = small_graph(eng.device)
            g.replay()
            torch.cuda.synchronize()
            kept.append(g)
            print("tiny: a one-kernel graph captured and kept", flush=True)
        elif item == "upload":  # cuGraphUpload of the last captured step, through the driver API
            import ctypes

            st = list(eng._graphs.values())[-1]
            cu = ctypes.CDLL("libcuda.so.1")
            r = cu.cuGraphUpload(
                ctypes.c_void_p(st.graph.raw_cuda_graph_exec()),
                ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
            )
            torch.cuda.synchronize()
            print(f"upload: cuGraphUpload returned {r}", flush=True)
        elif item == "newcs":
            torch.cuda.graph.default_capture_stream = None  # the next capture makes a new capture stream
            print("newcs: the next capture on a new stream", flush=True)
        elif item == "dropkept":
            for k in [k for k, v in eng._graphs.items() if any(v is x for x in kept)]:
                del eng._graphs[k]
            kept.clear()
            gc.collect()
            torch.cuda.synchronize()
            print("dropkept: the kept graphs destroyed", flush=True)
        elif item == "prof":
            from torch.profiler import ProfilerActivity, profile

            st = list(eng._graphs.values())[-1]
            _time_replays(st, args.context, reps=20)
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                _time_replays(st, args.context, reps=20)
            path = f"{args.trace_dir}/{i}_prof.json"
            p.export_chrome_trace(path)
            print(f"prof: 20 replays of batch {st.tok.shape[0]} traced to {path}", flush=True)
        elif item == "smi":
            q = "temperature.gpu,temperature.memory,clocks.sm,clocks.mem,power.draw,clocks_throttle_reasons.active"
            r = subprocess.run(
                ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True
            )
            print(f"smi ({q}): {r.stdout.strip()}", flush=True)
        elif item == "zero":
            for c in eng.k_cache + eng.v_cache:
                c.zero_()
            for st in eng._graphs.values():
                st.tok.zero_()
            torch.cuda.synchronize()
            print("zero: KV caches and input tokens zeroed", flush=True)
        elif item == "tokens":
            st = list(eng._graphs.values())[-1]
            print(f"tokens: {st.tok.flatten().tolist()}", flush=True)
        elif item == "mem":
            m = torch.cuda.memory_stats()
            print(
                f"mem: reserved {m['reserved_bytes.all.current'] / 2**20:.0f} MiB, allocated "
                f"{m['allocated_bytes.all.current'] / 2**20:.0f} MiB, segments {m['segment.all.current']}",
                flush=True,
            )
        elif item == "sleep":
            time.sleep(2.0)
            print("sleep: 2 s", flush=True)
        else:  # empty, gc
            eng._graphs.clear()
            if item == "gc":
                gc.collect()
            torch.cuda.empty_cache()
            print(f"{item}: graphs dropped, cache emptied", flush=True)
        torch.cuda.nvtx.range_pop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
