"""Where a CUDA-graph decode step spends its time (device machine): kernel table of one engine's decode.

    python benchmarks/gpu_profile.py [--batches 1,8] [--context 512[,2048]] [--attn 0,13/32/1] [--max-seq-len N]
        [--max-keys K] [--weights ternary] [--kv-cache-dtype fp8] [--head int8] [--timeline N]
        [--quant-warps W] [--rounds R] [--variants ';engine_cuda.FUSED_ENDS=0']

Random weights of the 2B4T shape; replays the captured decode step under torch.profiler and prints the kernels
by total time, plus decode ms/step for attention variants (splits per row and kv head / keys per block / pipeline
stages / warps) and for --variants (package constants set in-process, so every variant shares one tune: an A/B
without a second package); --rounds repeats them, interleaved; --quant-warps sets the quantization launch's
warps. The decode kernels use programmatic dependent launch: a kernel starts early and waits for its
predecessor, so its profiled duration includes that wait. For per-kernel durations run with
BITNETLM_TRITON_PDL=0 (and BITNETLM_TRITON_TUNE_CACHE= for a fresh tune).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _timeline(prof, steps: int, n: int) -> None:
    """One step's kernels in order (the middle replay): where the step's wall time goes between kernels."""
    ks = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    per = len(ks) // steps
    step = ks[(steps // 2) * per : (steps // 2 + 1) * per]  # [per] kernels of one replay
    t0 = step[0].time_range.start
    busy = sum(e.time_range.elapsed_us() for e in step)
    wall = step[-1].time_range.end - t0
    gap = t0 - ks[(steps // 2) * per - 1].time_range.end  # between two replays of the graph
    print(
        f"--- one step: {per} kernels, {wall:.1f} us from first start to last end, kernels busy {busy:.1f} us; "
        f"{gap:.1f} us from the previous step's last end to this step's first start"
    )
    print(f"{'start us':>9} {'dur us':>7} {'gap us':>7}  kernel")
    prev = t0
    for i, e in enumerate(step):
        s, d = e.time_range.start, e.time_range.elapsed_us()
        if i < n or i >= len(step) - n:  # the first and the last n
            print(f"{s - t0:9.2f} {d:7.2f} {s - prev:7.2f}  {e.name[:70]}")
        elif i == n:
            print("      ...")
        prev = e.time_range.end
    print(flush=True)


_SAVED: dict = {}


def _set(var: str, restore: bool = False) -> None:
    """Apply (or undo) one --variants entry: comma-separated module.NAME=VALUE under bitnetlm."""
    import importlib

    for item in filter(None, var.split(",")):
        path, value = item.split("=")
        mod, name = path.rsplit(".", 1)
        m = importlib.import_module(f"bitnetlm.{mod}")
        if restore:
            setattr(m, name, _SAVED.pop((mod, name)))
        else:
            old = _SAVED[(mod, name)] = getattr(m, name)
            setattr(m, name, value if isinstance(old, str) else type(old)(int(value)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--weights", default="ternary")
    ap.add_argument(
        "--context", default="512", help="cache positions before the timed steps; a comma list times each"
    )
    ap.add_argument(
        "--max-keys",
        type=int,
        default=0,
        help="the captured steps' key bound (decode_state's max_keys: a short one picks the attention's "
        "short-context splits; the timed steps run from the context to 100 keys past it)",
    )
    ap.add_argument(
        "--attn",
        default="0",
        help="attention variants to time: comma-separated SPLITS[/BS[/STAGES[/WARPS[/MAXNREG]]]] (0 = the default)",
    )
    ap.add_argument(
        "--max-seq-len",
        type=int,
        default=0,
        help="KV-cache positions (default context + 200; a server's is 4096)",
    )
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16), bf16 or fp8")
    ap.add_argument("--head", default="fp", help="LM head: fp (bf16) or int8")
    ap.add_argument(
        "--prefill", type=int, default=0, help="also profile one batch-1 prefill of this many tokens"
    )
    ap.add_argument(
        "--timeline",
        type=int,
        default=0,
        help="also print the first and last N kernels of one step in launch order: start, duration, gap to the "
        "previous",
    )
    ap.add_argument("--quant-warps", type=int, default=0, help="the quantization launch's warps (0: default)")
    ap.add_argument("--rounds", type=int, default=1, help="time every variant this many times, interleaved")
    ap.add_argument(
        "--variants",
        default="",
        help="package constants to A/B in one process: variants separated by ';', each comma-separated "
        "module.NAME=VALUE under bitnetlm (e.g. 'engine_cuda.HEAD_A16=0,kernels.triton.attention.ATTN_BS=64'); "
        "an empty variant is the package as it is",
    )
    args = ap.parse_args()
    from bitnetlm.kernels.triton import attention, launch
    from bitnetlm.runtime.cuda.bench import random_engine
    from bitnetlm.runtime.cuda.step_tune import step_ms

    launch.QUANT_WARPS = args.quant_warps

    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.context.split(",")]
    variants = args.variants.split(";") if args.variants else [""]
    eng = random_engine(
        max(batches),
        args.max_seq_len or max(contexts) + 200,
        args.head,
        args.kv_cache_dtype,
        weights=args.weights,
    )
    for b in batches:
        for _ in range(args.rounds):
            for var in variants:
                _set(var)
                for c, spec in ((c, sp) for c in contexts for sp in args.attn.split(",")):  # 0: the default
                    attention.set_overrides(spec)
                    ms = step_ms(eng, b, c, args.max_keys, reps=100, tries=1)
                    tag = f" [{var}]" if var else ""
                    ctx = f" context {c}" if len(contexts) > 1 else ""
                    print(f"batch {b}{ctx} attn {spec}{tag}: {ms:.3f} ms/step", flush=True)
                _set(var, restore=True)
        attention.set_overrides()
        eng._graphs.clear()
        st = eng.decode_state(b, max_keys=args.max_keys)
        st.pos.fill_(contexts[0])
        st.step.fill_(1)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                st.graph.replay()
            torch.cuda.synchronize()
        print(f"--- batch {b}: kernels over 10 decode steps", flush=True)
        print(
            prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60),
            flush=True,
        )
        if args.timeline:
            _timeline(prof, 10, args.timeline)
    if args.prefill:
        from torch.profiler import ProfilerActivity, profile

        from bitnetlm.runtime.cuda.engine import capture

        tok = torch.randint(0, eng.cfg.vocab_size, (1, args.prefill), device="cuda")
        pos0 = torch.zeros((1,), dtype=torch.int32, device="cuda")
        graph, _ = capture(lambda: eng.forward(tok, pos0))
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            graph.replay()
        e.record()
        e.synchronize()
        print(f"prefill {args.prefill} tokens: {a.elapsed_time(e) / 10:.3f} ms", flush=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
        print(f"--- prefill {args.prefill}: kernels over 5 prefills", flush=True)
        print(
            prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
