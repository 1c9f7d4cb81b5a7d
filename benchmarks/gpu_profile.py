"""Where a CUDA-graph decode step spends its time (GPU), and A/B runs of the step against another checkout.

    python benchmarks/gpu_profile.py [--batches 1,8] [--context 512[,2048]] [--attn 0,13/32/1] [--max-seq-len N]
        [--max-keys K] [--weights ternary] [--kv-cache-dtype fp8] [--head int8] [--timeline N] [--prefill N]
        [--quant-warps W] [--rounds R] [--variants ';attn_pf_programs=0;defer_max_b=0,quant_late_max_m=8']
        [--plan FIELD=VALUE,...] [--fresh-tune] [--kernels 1,8,16,64,512]
    python benchmarks/gpu_profile.py --baseline DIR [--processes 2] [--check-logits] [the options above]

Random weights of the 2B4T shape. Prints decode ms/step of the captured step for attention variants (splits per
row and kv head / keys per block / pipeline stages / warps) and for --variants (`DecodePlan` fields set on the
engine's plan in-process, so every variant shares one tune: an A/B without a second package; a field that changes
a tuning key's candidates takes effect for keys not tuned yet); --rounds repeats them, interleaved. Then the
kernels of 10 replays under torch.profiler, by total time (--timeline: one step's kernels in launch order).
--plan sets DecodePlan fields for everything; --quant-warps the quantization launch's warps. The decode kernels
use programmatic dependent launch: a kernel starts early and waits for its predecessor, so its profiled duration
includes that wait; for per-kernel durations run with `--plan pdl=false` (and --fresh-tune: no tuning cache).
--kernels: each projection of the 2B4T layer alone (`launch.ternary_linear`) at those row counts: us a call,
GB/s of its weights, int8 TOPS and the tile the tuner chose.

--baseline DIR: the same command in alternating processes of this checkout and of DIR, a tree holding another
version's `bitnetlm/` and `benchmarks/` (a plain copy, e.g. `mkdir -p .scratch/base && git archive main bitnetlm
benchmarks | tar -x -C .scratch/base`), --processes each (the baseline first in odd rounds); every process tunes
on its own (the tune cache is keyed by each package's source). Prints each timed line's ms/step a process and
the ratio of the medians, this tree / baseline: a kernel's speed can move with its code layout alone, so a change
is timed against the previous package, not only against a switch inside the new one. DIR's gpu_profile.py must
understand the options passed. --check-logits (with --baseline): first, whether both packages' engines give
bit-identical logits over --logit-steps eager decode steps (`CudaEngine.forward`, the captured step's kernels)
from position 0 at each of --batches, feeding back their greedy tokens, same seed and weights; exits 1 if not.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import statistics
import subprocess
import sys
import tempfile

import common

LINE = re.compile(r"^(batch .*): ([0-9.]+) ms/step$")  # a timed line, as --baseline reads them
PARENT_ONLY = {
    "--baseline": 1,
    "--processes": 1,
    "--check-logits": 0,
    "--logit-steps": 1,
}  # options (and their values) not passed on


# ---- one process: time and profile the step ---------------------------------------------------------------
def _attn(spec: str) -> dict:
    """An --attn variant, SPLITS[/BS[/STAGES[/WARPS[/MAXNREG]]]] (0: the launcher's choice), as DecodePlan fields."""
    names = ("attn_splits", "attn_bs", "attn_stages", "attn_warps", "attn_maxnreg")
    return dict(zip(names, ([int(v) for v in spec.split("/")] + [0] * 4)[:5]))


def time_variants(eng, args, b: int, plans: dict) -> None:
    """ms/step of every (round, variant, context, attention variant) at batch b, one printed line each."""
    from bitnetlm.runtime.cuda.step_tune import step_ms

    for _ in range(args.rounds):
        for var, plan in plans.items():
            for c, spec in ((c, sp) for c in args.context for sp in args.attn):  # 0: the default
                eng.plan = dataclasses.replace(plan, **_attn(spec)) if spec != "0" else plan
                ms = step_ms(eng, b, c, args.max_keys, reps=100, tries=1)
                tag = f" [{var}]" if var else ""
                ctx = f" context {c}" if len(args.context) > 1 else ""
                print(f"batch {b}{ctx} attn {spec}{tag}: {ms:.3f} ms/step", flush=True)


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


def profile_decode(eng, b: int, args) -> None:
    """The kernels of 10 replays of the batch-b step under torch.profiler, by total time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    eng._graphs.clear()
    st = eng.decode_state(b, max_keys=args.max_keys)
    st.pos.fill_(args.context[0])
    st.step.fill_(1)
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


def profile_prefill(eng, n: int) -> None:
    """ms of one captured batch-1 prefill of n tokens, and its kernels over 5 replays."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bitnetlm.runtime.cuda.graphs import capture

    tok = torch.randint(0, eng.cfg.vocab_size, (1, n), device="cuda")
    pos0 = torch.zeros((1,), dtype=torch.int32, device="cuda")
    graph, _ = capture(lambda: eng.forward(tok, pos0))
    a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        graph.replay()
    e.record()
    e.synchronize()
    print(f"prefill {n} tokens: {a.elapsed_time(e) / 10:.3f} ms", flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    print(f"--- prefill {n}: kernels over 5 prefills", flush=True)
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60),
        flush=True,
    )


# (name, N out, K in, gated, norm, residual, per-row scale): the 2B4T layer's projections as the engine calls them
PROJECTIONS = (
    ("qkv", 3840, 2560, False, True, False, True),
    ("o", 2560, 2560, False, True, True, False),
    ("gate|up", 6912, 2560, True, True, False, True),
    ("down", 2560, 6912, False, True, True, False),
)


def kernel_rows(ms: list[int]) -> list[list]:
    """Each projection alone at each row count: [op, M, NxK, us, weight GB/s, int8 TOPS, tuned tile]."""
    import torch
    import triton

    from bitnetlm.kernels.triton import launch, tune
    from bitnetlm.kernels.triton.layout import pack_triton

    rows = []
    for name, n, k, gated, norm, res, per_row in PROJECTIONS:
        rows_w = n * (2 if gated else 1)
        p = pack_triton(torch.randint(-1, 2, (rows_w, k), dtype=torch.int8, device="cuda"))
        s = torch.rand(rows_w if per_row else 1, device="cuda")
        nw = torch.rand(k, device="cuda") if norm else None
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) if res else None

            def fn(x=x, p=p, s=s, n=n, nw=nw, r=r, g=gated):
                return launch.ternary_linear(x, p, s, n, norm_weight=nw, residual=r, gated=g)

            fn()  # tunes
            t = statistics.median(
                triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") for _ in range(3)
            )  # ms
            key = ("auto", n, k, min(1 << max(0, (m - 1).bit_length()), 1024), gated, norm, res, per_row)
            tile = tune._choice.get(key, "")
            rows.append([name, m, f"{n}x{k}", f"{t * 1e3:.1f}", f"{p.numel() / t / 1e6:.0f}"])
            rows[-1] += [f"{2 * m * rows_w * k / t / 1e9:.1f}", str(tile)]
    return rows


def profile_main(args) -> int:
    from bitnetlm.kernels.triton import tune
    from bitnetlm.kernels.triton.plan import parse_values
    from bitnetlm.runtime.cuda.bench import random_engine

    if args.fresh_tune:
        tune.configure(cache=None)
    print(common.machine(gpu=True), flush=True)
    eng = random_engine(
        max(args.batches),
        args.max_seq_len or max(args.context) + 200,
        args.head,
        args.kv_cache_dtype,
        args.weights,
    )
    base = dataclasses.replace(eng.plan, quant_warps=args.quant_warps).with_values(
        parse_values(args.plan), "--plan"
    )
    variants = args.variants.split(";") if args.variants else [""]
    plans = {var: base.with_values(parse_values(var), f"--variants {var!r}") for var in variants}
    for b in args.batches:
        time_variants(eng, args, b, plans)
        eng.plan = base
        profile_decode(eng, b, args)
    if args.prefill:
        profile_prefill(eng, args.prefill)
    if args.kernels:
        common.header("Each projection of the 2B4T layer alone (Triton W2A8)", gpu=True)
        cols = ["op", "M", "N x K", "us", "weight GB/s", "int8 TOPS", "tuned tile"]
        print(common.table(cols, kernel_rows(args.kernels), [False, True, False, True, True, True, False]))
    return 0


# ---- two checkouts: timings and logits -------------------------------------------------------------------------
def child_argv(argv: list[str]) -> list[str]:
    """The command line without the options that only the comparing process reads."""
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        name, eq, _ = a.partition("=")
        if name in PARENT_ONLY:
            skip = 0 if eq else PARENT_ONLY[name]
            continue
        out.append(a)
    return out


def timed_lines(tree: str, argv: list[str]) -> dict[str, float]:
    """ms/step of every timed line of one gpu_profile.py process in `tree` (its own package first on the path)."""
    cmd = [sys.executable, os.path.join(tree, "benchmarks", "gpu_profile.py"), *argv]
    res = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"gpu_profile.py failed in {tree} (exit {res.returncode}):\n{res.stderr[-3000:]}")
    return {m[1]: float(m[2]) for m in map(LINE.match, res.stdout.splitlines()) if m}


def compare_timings(args, argv: list[str]) -> None:
    trees = {"base": os.path.abspath(args.baseline), "new": str(common.ROOT)}
    runs: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    for i in range(args.processes):
        for p in ("base", "new") if i % 2 == 0 else ("new", "base"):
            runs[p].append(timed_lines(trees[p], argv))
    keys = list(dict.fromkeys(k for r in runs["base"] + runs["new"] for k in r))
    common.header(
        "Decode step, this checkout against a baseline (alternating processes)",
        gpu=True,
        details=f"baseline {trees['base']}; gpu_profile.py {' '.join(argv)}; ms/step",
    )
    cols = [f"{p} {i + 1}" for i in range(args.processes) for p in ("base", "new")]
    rows = []
    for k in keys:
        cells = [runs[p][i].get(k) for i in range(args.processes) for p in ("base", "new")]
        b, n = [r[k] for r in runs["base"] if k in r], [r[k] for r in runs["new"] if k in r]
        ratio = f"{statistics.median(n) / statistics.median(b):.3f}" if b and n else "-"
        rows.append([k, *("-" if c is None else f"{c:.3f}" for c in cells), ratio])
    print(common.table(["line", *cols, "this tree / baseline"], rows), flush=True)


def logits_child(args) -> None:
    """In the package of args._tree: the logits of every (batch, step) of a random 2B4T engine into args._logits."""
    import torch

    from bitnetlm.models import ModelConfig

    try:
        from bitnetlm.runtime.cuda.engine import CudaEngine, EngineConfig
    except ImportError:  # (a tree from before the runtime package)
        from bitnetlm.engine_cuda import CudaEngine, EngineConfig

    cfg = ModelConfig()
    kv = {"fp8": torch.float8_e4m3fn}.get(args.kv_cache_dtype)
    ecfg = EngineConfig(
        max_batch=max(args.batches), max_seq_len=args.logit_steps + 8, head=args.head, kv_dtype=kv
    )
    eng = CudaEngine.random(cfg, ecfg)
    g = torch.Generator(device="cuda").manual_seed(1)
    res = {}
    with torch.no_grad():
        for b in args.batches:
            tok = torch.randint(0, cfg.vocab_size, (b, 1), device="cuda", generator=g)
            pos = torch.zeros(b, dtype=torch.int32, device="cuda")
            for step in range(args.logit_steps):
                logits = eng.forward(tok, pos)
                res[f"{b},{step}"] = logits.float().cpu()
                tok = logits.argmax(-1, keepdim=True)
                pos += 1
    from safetensors.torch import save_file

    save_file(res, args._logits)


def check_logits(args) -> bool:
    """Whether this checkout's and the baseline's engines give bit-identical logits; prints a row a (batch, step)."""
    import torch
    from safetensors.torch import load_file

    opts = ["--batches", ",".join(map(str, args.batches)), "--logit-steps", str(args.logit_steps)]
    opts += ["--head", args.head, "--kv-cache-dtype", args.kv_cache_dtype]
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, tree in (("base", os.path.abspath(args.baseline)), ("new", str(common.ROOT))):
            out = os.path.join(tmp, f"{name}.safetensors")
            cmd = [sys.executable, os.path.abspath(__file__), *opts, "--_tree", tree, "--_logits", out]
            if subprocess.run(cmd, cwd=tree).returncode:
                raise SystemExit(f"gpu_profile.py --check-logits: the {name} tree's process failed")
            got[name] = load_file(out)
    common.header(
        "Logits of this checkout against the baseline's",
        gpu=True,
        details=f"random 2B4T engine, head {args.head}, cache {args.kv_cache_dtype}, eager decode steps",
    )
    rows, same = [], True
    for key in sorted(got["base"], key=lambda k: tuple(map(int, k.split(",")))):
        x, y = got["base"][key], got["new"][key]
        ok = torch.equal(x, y)
        same &= ok
        rows.append([*key.split(","), "identical" if ok else f"max |diff| {(x - y).abs().max().item():.3g}"])
    print(common.table(["batch", "step", "logits"], rows, [True, True, False]))
    print("\nall identical" if same else "\nDIFFERENT", flush=True)
    return same


# ---- command line -------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("--batches", type=common.int_list, default=[1, 8])
    ap.add_argument("--weights", default="ternary", help="ternary (Triton W2A8) or dense (bf16, cuBLAS)")
    ap.add_argument(
        "--context", type=common.int_list, default=[512], help="cached keys before the timed steps"
    )
    ap.add_argument(
        "--max-keys", type=int, default=0, help="the captured steps' key bound (short: short splits)"
    )
    ap.add_argument(
        "--attn",
        type=common.str_list,
        default=["0"],
        help="SPLITS[/BS[/STAGES[/WARPS[/MAXNREG]]]],... (0: default)",
    )
    ap.add_argument("--max-seq-len", type=int, default=0, help="KV-cache positions (default context + 200)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16), bf16 or fp8")
    ap.add_argument("--head", default="fp", help="LM head: fp (bf16) or int8")
    ap.add_argument(
        "--prefill", type=int, default=0, help="also profile a batch-1 prefill of this many tokens"
    )
    ap.add_argument(
        "--timeline", type=int, default=0, help="also one step's first and last N kernels in order"
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
        "--plan", default="", help="DecodePlan fields for every run, FIELD=VALUE,... ('pdl=false')"
    )
    ap.add_argument("--fresh-tune", action="store_true", help="no tuning cache on disk: tune from scratch")
    ap.add_argument(
        "--kernels", type=common.int_list, default=[], help="also each projection alone at these rows"
    )
    ab = ap.add_argument_group("against another checkout")
    ab.add_argument("--baseline", help="a tree holding the baseline's bitnetlm/ and benchmarks/")
    ab.add_argument("--processes", type=int, default=2, help="processes a tree, alternating (default: 2)")
    ab.add_argument(
        "--check-logits", action="store_true", help="first compare both packages' logits bit for bit"
    )
    ab.add_argument("--logit-steps", type=int, default=6, help="--check-logits: decode steps a batch size")
    ap.add_argument("--_tree", help=argparse.SUPPRESS)
    ap.add_argument("--_logits", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.check_logits and not args.baseline:
        ap.error("--check-logits compares with a --baseline tree; give one")
    if args.baseline and not os.path.isfile(os.path.join(args.baseline, "benchmarks", "gpu_profile.py")):
        ap.error(f"--baseline {args.baseline}: no benchmarks/gpu_profile.py there (expected a package tree)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    common.use_checkout(args._tree or common.ROOT)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_profile.py: needs a CUDA GPU; torch sees none")
    if args._logits:
        logits_child(args)
        return 0
    if not args.baseline:
        return profile_main(args)
    same = check_logits(args) if args.check_logits else True
    compare_timings(args, child_argv(argv))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
