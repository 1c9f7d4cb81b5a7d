"""Where a CUDA-graph decode step spends its time (GPU): kernel table of one engine's decode.

    python benchmarks/gpu_profile.py [--batches 1,8] [--context 512[,2048]] [--attn 0,13/32/1] [--max-seq-len N]
        [--max-keys K] [--weights ternary] [--kv-cache-dtype fp8] [--head int8] [--timeline N]
        [--quant-warps W] [--rounds R] [--variants ';attn_pf_programs=0;defer_max_b=0,quant_late_max_m=8']
        [--plan FIELD=VALUE,...] [--fresh-tune]

Random weights of the 2B4T shape; replays the captured decode step under torch.profiler and prints the kernels
by total time, plus decode ms/step for attention variants (splits per row and kv head / keys per block / pipeline
stages / warps) and for --variants (`DecodePlan` fields set in-process on the engine's plan, so every variant
shares one tune: an A/B without a second package; a field that changes a tuning key's candidates takes effect
for keys not tuned yet); --rounds repeats them, interleaved; --quant-warps sets the quantization launch's warps.
--plan sets DecodePlan fields for everything (the timings, the variants on top, the profile). The decode kernels
use programmatic dependent launch: a kernel starts early and waits for its predecessor, so its profiled duration
includes that wait. For per-kernel durations run with `--plan pdl=false` (and --fresh-tune: no tuning cache).
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


def _attn(spec: str) -> dict:
    """An --attn variant, SPLITS[/BS[/STAGES[/WARPS[/MAXNREG]]]] (0: the launcher's choice), as DecodePlan fields."""
    names = ("attn_splits", "attn_bs", "attn_stages", "attn_warps", "attn_maxnreg")
    return dict(zip(names, ([int(v) for v in spec.split("/")] + [0] * 4)[:5]))


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
        help="DecodePlan variants to A/B in one process, separated by ';', each comma-separated FIELD=VALUE "
        "with JSON values (e.g. 'defer_max_b=0,attn_pf_table=[2048,1024];pdl=false'); an empty variant is the "
        "engine's own plan",
    )
    ap.add_argument(
        "--plan", default="", help="DecodePlan fields for every run, FIELD=VALUE,... (e.g. 'pdl=false')"
    )
    ap.add_argument("--fresh-tune", action="store_true", help="no tuning cache on disk: tune from scratch")
    args = ap.parse_args()
    import dataclasses

    from bitnetlm.kernels.triton import tune
    from bitnetlm.kernels.triton.plan import parse_values
    from bitnetlm.runtime.cuda.bench import random_engine
    from bitnetlm.runtime.cuda.step_tune import step_ms

    if args.fresh_tune:
        tune.configure(cache=None)
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
    base = dataclasses.replace(eng.plan, quant_warps=args.quant_warps).with_values(
        parse_values(args.plan), "--plan"
    )
    plans = {var: base.with_values(parse_values(var), f"--variants {var!r}") for var in variants}
    for b in batches:
        for _ in range(args.rounds):
            for var in variants:
                for c, spec in ((c, sp) for c in contexts for sp in args.attn.split(",")):  # 0: the default
                    eng.plan = dataclasses.replace(plans[var], **_attn(spec)) if spec != "0" else plans[var]
                    ms = step_ms(eng, b, c, args.max_keys, reps=100, tries=1)
                    tag = f" [{var}]" if var else ""
                    ctx = f" context {c}" if len(contexts) > 1 else ""
                    print(f"batch {b}{ctx} attn {spec}{tag}: {ms:.3f} ms/step", flush=True)
        eng.plan = base
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
