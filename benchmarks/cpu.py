"""What bitnet-lm gives a user on a CPU: one markdown table each, naming the CPU, its kernels and the date.

    python benchmarks/cpu.py                                         # every table, default settings
    python benchmarks/cpu.py --tables decode --shapes 2b4t,large --threads 2 --heads bf16,int8 --reps 3
    python benchmarks/cpu.py --tables decode --isa avx512vnni,avx2   # the same rows on each instruction set
    python benchmarks/cpu.py --tables decode --shapes 2b4t --threads 1,2 --layouts 2bit,base3  # weights 2 / 1.6 bits
    python benchmarks/cpu.py --tables threads --shapes 2b4t --sweep 1,2 --competitors none,unpinned,pinned
    python benchmarks/cpu.py --tables generate,load --backends cpu,reference --runs 3
    python benchmarks/cpu.py --baseline DIR --shapes 2b4t --heads bf16,int8 --rounds 3

Tables (--tables, comma-separated):
- decode: prefill (ppN: one forward over an N-token prompt into an empty KV row) and decode (tgN: N greedy steps
  from an empty row) tokens/s of each of --shapes with each of --heads (the compact bf16 / int8 embedding + LM
  head) at each of --threads, for each of --isa (`kernels.cpu.use_isa`; default: the best this CPU runs), through
  the CPU runner (`runtime.cpu.CpuRunner`: the fused C layer step) as `bitnet bench` times it, with the KV cache
  of --kv, for each of --layouts (the ternary weights in 2 or 1.6 bits; their runs alternate). Next to each row: the packed weight bytes a decoded token reads, the rate it read them at, and that
  rate against the read bandwidth measured just before and after the row (the "read ceiling"). Then the
  resident memory with a --ctx-token KV row held.
- threads: batch-1 decode tokens/s at each of --sweep kernel threads (default 1, 2, 4, ... and the CPUs this
  process may use), alone and with one busy process competing for the cores (a Python busy loop, unpinned, or
  pinned to the last of those CPUs), with the first of --heads; best and median of --reps runs, interleaved.
- generate: `bitnetlm.generate` through the public API on a checkpoint in the real packed HF format with random
  weights (--dir, written by benchmarks/make_checkpoint.py for --checkpoint-shape when absent, with the LLaMA-3
  tokenizer's files copied in), loaded with `bitnetlm.load(dir, head_dtype=..., kv_cache_dtype=..., threads=...)`:
  TTFT and decode tok/s of a --prompt-token prompt, --tg tokens, greedy and with llama.cpp's default sampler.
- load: --runs fresh processes for each of --models (the checkpoint at --dir, zoo names) and --backends: import,
  `bitnetlm.load`, resident memory after it, the first token of an 8-token prompt through `stream_generate`, the
  decode tok/s of the next --load-tokens and the peak resident memory.

--baseline DIR: instead of the tables, prefill and decode of --shapes x --heads in alternating processes of this
checkout's package and of DIR's (another checkout with its C library built in place: `python setup.py
build_ext --inplace`), --rounds each, the baseline first in odd rounds, so both see the same stretch of a shared
machine's load; the medians and their ratio. BITNETLM_CPU_ISA (inherited by both) forces one instruction set.

Random weights: speed and memory only, never quality. Where the time of a step goes: benchmarks/cpu_profile.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import common

TABLES = ("decode", "threads", "generate", "load")
SAMPLERS = {
    "greedy": dict(temperature=0.0),
    "llama.cpp defaults (t0.8 k40 p.95 minp.05)": dict(
        temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=0
    ),
}


# ---- shared -----------------------------------------------------------------------------------------------------
def details(threads, extra: str = "", isa: str = "") -> str:
    """What a table's rows ran on: the kernels' instruction set, the threads and the machine's load at the start."""
    from bitnetlm.kernels import cpu

    la = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"C kernels {isa or cpu.get_isa()}, {threads} threads; load average at start {la}." + (
        f" {extra}" if extra else ""
    )


def set_head(model, dtype: str) -> None:
    """Store a random model's compact embedding + LM head as `dtype`, from the values it holds (a tied model keeps
    one matrix for both uses)."""
    from bitnetlm.kernels.cpu.head import CompactEmbedding, CompactHead

    if model.lm_head.dtype_name == dtype:
        return
    tied = model.embed_tokens.head is model.lm_head
    head = CompactHead(model.lm_head.weight, dtype)
    model.embed_tokens = CompactEmbedding(head if tied else CompactHead(model.embed_tokens.weight, dtype))
    model.lm_head = head


def tokens_per_s(model, config, test: str, n: int, gen) -> float:
    """One run of a test as `bitnet bench` times it (bench.time_prefill / time_decode), on a runner made from
    `config` (its KV cache type): "pp" one prefill of n random tokens into an empty row, "tg" n greedy decode steps
    from an empty row. The runner is built outside the timing."""
    import torch

    from bitnetlm.runtime import make_runner

    runner = make_runner(model, config, 1, n)
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()
    t0 = time.perf_counter()
    if test == "pp":
        runner.prefill(0, ids)
    else:
        tok = ids[0]
        for pos in range(n):
            tok = int(runner.decode([0], [tok], [pos])[0].argmax())
    return n / (time.perf_counter() - t0)


def weight_bytes(model) -> int:
    """Bytes a decoded token reads: the packed ternary projections and the LM head."""
    from bitnetlm.quant.bitlinear import BitLinear

    tern = sum(m.packed.numel() for m in model.modules() if isinstance(m, BitLinear))
    return tern + model.lm_head.nbytes()


def mean_std(v: list[float]) -> str:
    return f"{statistics.mean(v):.2f} ± {statistics.stdev(v) if len(v) > 1 else 0.0:.2f}"


# ---- decode: prefill and decode speed, bytes against the read bandwidth ------------------------------------------
class Layouts:
    """The model's ternary weights packed in each of `names` ("2bit", "base3") at once, so that rows of different
    layouts can alternate without repacking: `use(name)` points every C-kernel BitLinear at that packing."""

    def __init__(self, model, names: list[str]):
        from bitnetlm.kernels import cpu
        from bitnetlm.quant.bitlinear import BitLinear

        lins = [m for m in model.modules() if isinstance(m, BitLinear) and m.kernel is not None]
        self.packs = {}
        for name in names:
            be = cpu.WEIGHTS_LAYOUTS[name]
            packs = []
            for m in lins:
                shape = (m.out_features, m.in_features)
                p = m.packed if m.kernel is be else be.repack(m.packed, m.layout, shape)
                packs.append((m, be, p if p is not None else be.pack(m.ternary_weight())))
            self.packs[name] = packs

    def use(self, name: str) -> None:
        for m, be, p in self.packs[name]:
            m.kernel, m.layout, m.packed = be, be.layout, p


def decode_rows(model, args, config, nt: int, gen, layouts: Layouts) -> list[list]:
    """One row of the decode table per weight layout (the model's head, the kernels in force, nt threads); the
    layouts' runs alternate."""
    from bitnetlm.kernels import configure_threads

    configure_threads(model, nt)
    for name in args.layouts:
        layouts.use(name)
        tokens_per_s(model, config, "tg", 4, gen)  # warm-up: the pool's threads, the first steps
        tokens_per_s(model, config, "pp", 16, gen)
    read = common.read_bandwidth(nt)
    pp = {name: [] for name in args.layouts}
    tg = {name: [] for name in args.layouts}
    for _ in range(args.reps):
        for name in args.layouts:
            layouts.use(name)
            pp[name].append(tokens_per_s(model, config, "pp", args.pp, gen))
            tg[name].append(tokens_per_s(model, config, "tg", args.tg, gen))
    read = (read + common.read_bandwidth(nt)) / 2
    rows = []
    for name in args.layouts:
        layouts.use(name)
        wb = weight_bytes(model)
        gbs = wb * statistics.mean(tg[name]) / 1e9
        rows.append(
            [
                name,
                mean_std(pp[name]),
                mean_std(tg[name]),
                f"{wb / 1e6:.0f} MB",
                f"{gbs:.1f}",
                f"{read:.1f}",
                f"{gbs / read:.0%}",
            ]
        )
    return rows


def memory_row(model, config, ctx: int) -> list:
    """Resident memory with one runner of a ctx-position KV row held, the weights and that KV row."""
    from bitnetlm import bench
    from bitnetlm.runtime import make_runner

    runner = make_runner(model, config, 1, ctx)
    kv = runner.cache.nbytes()
    return [
        f"{common.rss_bytes() / 2**20:.0f}",
        f"{bench.model_bytes(model) / 2**20:.0f}",
        f"{kv / 2**20:.0f}",
    ]


def decode_table(args) -> None:
    import torch

    from bitnetlm import bench
    from bitnetlm.kernels import cpu
    from bitnetlm.runtime.config import RuntimeConfig

    config = RuntimeConfig(device="cpu", kv_cache_dtype=args.kv)
    gen = torch.Generator().manual_seed(0)
    copy = {nt: f"{common.copy_bandwidth(nt):.1f}" for nt in args.threads}
    rows, mem = [], []
    la = details(",".join(map(str, args.threads)), isa=",".join(args.isa))
    for shape in args.shapes:
        model = bench.random_model(shape, head_dtype=args.heads[0])
        layouts = Layouts(model, args.layouts)
        for head in args.heads:
            set_head(model, head)
            for isa in args.isa:
                with cpu.use_isa(isa):
                    for nt in args.threads:
                        for got in decode_rows(model, args, config, nt, gen, layouts):
                            rows.append([shape, head, cpu.get_isa(), nt, *got])
                            print(f"# {' | '.join(map(str, rows[-1]))}", file=sys.stderr, flush=True)
            layouts.use(args.layouts[0])
            mem.append([shape, head, *memory_row(model, config, args.ctx)])
        del model, layouts
    common.header(
        "Prefill and decode, random weights of real shapes",
        details=f"{la} KV cache {args.kv}; weights {', '.join(args.layouts)} (their runs alternate); copy bandwidth (read + written) "
        + ", ".join(f"{g} GB/s at {nt} threads" for nt, g in copy.items())
        + f"; mean ± std of {args.reps} runs.",
    )
    cols = ["shape", "head", "kernels", "threads", "weights", f"prefill pp{args.pp} tok/s"]
    cols += [
        f"decode tg{args.tg} tok/s",
        "weights read / token",
        "their GB/s",
        "read GB/s (around the row)",
        "of the read ceiling",
    ]
    print(common.table(cols, rows, [False] * 3 + [True, False] + [True] * 6))
    common.header("Resident memory after the runs", details=f"One runner of a {args.ctx}-token KV row held.")
    cols = ["shape", "head", "RSS MiB", "weights MiB", f"KV cache MiB ({args.ctx} tokens, {args.kv})"]
    print(common.table(cols, mem, [False, False, True, True, True]), flush=True)


# ---- threads: the sweep, alone and beside a busy process ---------------------------------------------------------
def start_competitor(kind: str) -> subprocess.Popen | None:
    """None, or a busy Python process: unpinned, or pinned to the last CPU of this process's affinity."""
    if kind == "none":
        return None
    cpus = sorted(os.sched_getaffinity(0))
    pin = (lambda: os.sched_setaffinity(0, {cpus[-1]})) if kind == "pinned" else None
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin)
    time.sleep(0.2)  # let it reach its loop
    return proc


def sweep_runs(model, args, config, gen) -> dict[int, list[float]]:
    """Decode tok/s of --reps runs at each thread count of --sweep, interleaved."""
    from bitnetlm.kernels import configure_threads

    runs: dict[int, list[float]] = {t: [] for t in args.sweep}
    for t in args.sweep:  # warm-up: the pool's threads, the runner's first steps
        configure_threads(model, t)
        tokens_per_s(model, config, "tg", 4, gen)
    for _ in range(args.reps):
        for t in args.sweep:
            configure_threads(model, t)
            runs[t].append(tokens_per_s(model, config, "tg", args.tg, gen))
    return runs


def threads_table(args) -> None:
    import torch

    from bitnetlm import bench
    from bitnetlm.runtime.config import RuntimeConfig

    config = RuntimeConfig(device="cpu", kv_cache_dtype=args.kv)
    gen = torch.Generator().manual_seed(0)
    rows, la = [], details(",".join(map(str, args.sweep)))
    for shape in args.shapes:
        model = bench.random_model(shape, head_dtype=args.heads[0])
        for kind in args.competitors:
            proc = start_competitor(kind)
            try:
                runs = sweep_runs(model, args, config, gen)
            finally:
                if proc is not None:
                    proc.kill()
                    proc.wait()
            for t, v in runs.items():
                rows.append([shape, kind, t, f"{max(v):.2f}", f"{statistics.median(v):.2f}"])
        del model
    common.header(
        "Decode by kernel threads, alone and beside a busy process",
        details=f"{la} {args.heads[0]} head; tg{args.tg}, {args.reps} runs each, interleaved; 'none' means no "
        "competitor of ours, not an idle machine.",
    )
    cols = ["shape", "competitor", "kernel threads", f"best tg{args.tg} tok/s", "median tok/s"]
    print(common.table(cols, rows, [False, False, True, True, True]), flush=True)


# ---- generate: the public API on a checkpoint --------------------------------------------------------------------
def generate_rows(model, tok, args, label: list) -> list[list]:
    """TTFT and decode tok/s of one --prompt-token prompt, --tg tokens, for each sampler (after a warm-up)."""
    import torch

    from bitnetlm.generate import generate

    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(min(1000, vocab // 2), min(vocab, 100_000), (args.prompt,), generator=g).tolist()
    rows = []
    for name, sampler in SAMPLERS.items():
        generate(model, tok, ids, max_tokens=4, ignore_eos=True, **sampler)  # warm-up
        r = generate(model, tok, ids, max_tokens=args.tg, ignore_eos=True, **sampler)
        rows.append([*label, name, args.prompt, r.generation_tokens, f"{r.ttft_s * 1e3:.1f}"])
        rows[-1].append(f"{r.generation_tps:.2f}")
    return rows


def generate_table(args) -> None:
    import bitnetlm

    path = common.shape_checkpoint(args.dir, args.checkpoint_shape, args.tokenizer)
    rows, la = [], details(",".join(map(str, args.threads)))
    for head in args.heads:
        for nt in args.threads:
            opts = dict(device="cpu", head_dtype=head, kv_cache_dtype=args.kv, threads=nt)
            model, tok = bitnetlm.load(path, **opts)
            rows += generate_rows(model.eval(), tok, args, [head, nt])
            del model, tok
    common.header(
        f"`generate` on the CPU ({args.checkpoint_shape}-shape checkpoint, random weights)",
        details=f"{la} {path}; KV cache {args.kv}; ignore_eos; the call after a 4-token warm-up.",
    )
    cols = ["head", "threads", "sampler", "prompt tokens", "tokens", "TTFT ms", "decode tok/s"]
    print(common.table(cols, rows, [False, True, False, True, True, True, True]), flush=True)


# ---- load: fresh processes ---------------------------------------------------------------------------------------
def load_child(model: str, backend: str, threads: int, tokens: int, t0: float) -> None:
    """One fresh process: import, load, first token, decode; prints one JSON line."""
    import torch

    import bitnetlm

    t1 = time.perf_counter()
    m, tok = bitnetlm.load(model, device="cpu", backend=backend, threads=threads)
    t2 = time.perf_counter()
    rss = common.rss_bytes() / 2**20
    ids = torch.randint(0, m.config.vocab_size, (8,), generator=torch.Generator().manual_seed(0)).tolist()
    stream = bitnetlm.stream_generate(m, tok, ids, max_tokens=1 + tokens, temperature=0.0, ignore_eos=True)
    next(stream)
    t3 = time.perf_counter()
    n = sum(1 for _ in stream)
    t4 = time.perf_counter()
    peak = common.rss_bytes(peak=True) / 2**20
    out = dict(import_s=t1 - t0, load_s=t2 - t1, rss_load=rss, first_s=t3 - t2, tps=n / (t4 - t3), peak=peak)
    print(json.dumps(out))


def load_run(args, model: str, backend: str) -> dict:
    """One fresh process of load_child (this script, --_load)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--_load", model, backend]
    cmd += ["--threads", str(args.threads[0]), "--load-tokens", str(args.load_tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.stderr.write(out.stderr[-3000:])
        raise SystemExit(f"cpu.py: load of {model} ({backend}): the process exited with {out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def load_table(args) -> None:
    rows, la = [], details(args.threads[0])
    for model in args.models:
        if os.path.abspath(model) == os.path.abspath(args.dir):
            common.shape_checkpoint(args.dir, args.checkpoint_shape, args.tokenizer)
        for backend in args.backends:
            for i in range(args.runs):
                r = load_run(args, model, backend)
                rows.append([os.path.basename(model.rstrip("/")), backend, i + 1, f"{r['import_s']:.2f}"])
                rows[-1] += [f"{r['load_s']:.2f}", f"{r['rss_load']:.0f}", f"{r['first_s']:.3f}"]
                rows[-1] += [f"{r['tps']:.2f}", f"{r['peak']:.0f}"]
    common.header(
        "Load and first token, fresh processes",
        details=f"{la} Each run: import torch and bitnetlm, `bitnetlm.load`, then `stream_generate` of an "
        f"8-token prompt, greedy: its first token, then {args.load_tokens} more.",
    )
    cols = ["model", "backend", "run", "import s", "load s", "RSS after load MiB", "first token s"]
    cols += [f"decode tok/s (next {args.load_tokens})", "peak RSS MiB"]
    print(common.table(cols, rows, [False, False] + [True] * 7), flush=True)


# ---- --baseline: two checkouts in alternating processes ----------------------------------------------------------
def worker(root: str, shape: str, head: str, args) -> dict:
    """pp and tg tokens/s of --reps runs with `root`'s package: `bitnet bench`'s timers, which a checkout from
    before the runners has too."""
    common.use_checkout(root)
    import torch

    from bitnetlm import bench
    from bitnetlm.kernels import cpu

    if not os.path.abspath(bench.__file__).startswith(os.path.abspath(root) + os.sep):
        raise SystemExit(f"cpu.py: imported bitnetlm from {bench.__file__}, expected it under {root}")
    cpu.set_num_threads(args.threads[0])
    torch.set_num_threads(1)
    model = bench.random_model(shape, head_dtype=head)
    gen, dev, vocab = torch.Generator().manual_seed(1), torch.device("cpu"), model.config.vocab_size
    bench.time_decode(model, 4, dev, vocab, gen)  # warm-up: the pool's threads, the first steps
    bench.time_prefill(model, 16, dev, vocab, gen)
    return {
        "pp": [args.pp / bench.time_prefill(model, args.pp, dev, vocab, gen) for _ in range(args.reps)],
        "tg": [args.tg / bench.time_decode(model, args.tg, dev, vocab, gen) for _ in range(args.reps)],
    }


def worker_run(args, root: str, shape: str, head: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--_worker", root, shape, head]
    cmd += ["--pp", str(args.pp), "--tg", str(args.tg), "--reps", str(args.reps)]
    out = subprocess.run([*cmd, "--threads", str(args.threads[0])], capture_output=True, text=True)
    if out.returncode:
        sys.stderr.write(out.stderr[-3000:])
        raise SystemExit(f"cpu.py: the process of {root} ({shape}, {head}) exited with {out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def baseline_table(args) -> None:
    trees = {"baseline": os.path.abspath(args.baseline), "this tree": str(common.ROOT)}
    rows, la = [], details(args.threads[0])
    for shape in args.shapes:
        for head in args.heads:
            got = {k: {"pp": [], "tg": []} for k in trees}
            for r in range(args.rounds):
                for name in list(trees) if r % 2 == 0 else list(reversed(trees)):
                    for k, v in worker_run(args, trees[name], shape, head).items():
                        got[name][k] += v
            for k, test in (("pp", f"pp{args.pp}"), ("tg", f"tg{args.tg}")):
                b, t = statistics.median(got["baseline"][k]), statistics.median(got["this tree"][k])
                rows.append(
                    [shape, head, test, f"{b:.2f}", f"{t:.2f}", f"{t / b:.3f}", len(got["this tree"][k])]
                )
                print(f"# {' | '.join(map(str, rows[-1]))}", file=sys.stderr, flush=True)
    common.header(
        "This checkout against a baseline, alternating processes",
        details=f"{la} Baseline {trees['baseline']}; {args.rounds} rounds x {args.reps} runs a tree.",
    )
    cols = ["shape", "head", "test", "baseline tok/s (median)", "this tree tok/s (median)", "this / baseline"]
    print(common.table([*cols, "runs each"], rows, [False] * 3 + [True] * 4), flush=True)


# ---- command line ------------------------------------------------------------------------------------------------
def default_sweep() -> list[int]:
    """1, 2, 4, ... and the number of CPUs this process may use."""
    n, out = len(os.sched_getaffinity(0)), [1]
    while out[-1] * 2 < n:
        out.append(out[-1] * 2)
    return out + [n] if n > 1 else out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=common.str_list, default=list(TABLES), help=f"of {', '.join(TABLES)}")
    ap.add_argument("--shapes", type=common.str_list, default=["2b4t", "large"], help="2b4t, large")
    ap.add_argument("--heads", type=common.str_list, default=["bf16", "int8"], help="LM heads: bf16, int8")
    ap.add_argument("--threads", type=common.int_list, default=None, help="kernel threads (default: cores)")
    ap.add_argument("--pp", type=int, default=128, help="prompt tokens of the prefill test (default 128)")
    ap.add_argument(
        "--tg", type=int, default=64, help="tokens of the decode test and of generate (default 64)"
    )
    ap.add_argument("--reps", type=int, default=3, help="runs of each test (default 3)")
    ap.add_argument("--kv", choices=["auto", "bf16"], default="auto", help="KV cache (--kv-cache-dtype)")
    dec = ap.add_argument_group("decode")
    dec.add_argument("--isa", type=common.str_list, default=None, help="scalar, avx2, avx512vnni, neon")
    dec.add_argument("--ctx", type=int, default=4096, help="KV-cache positions of the memory table")
    dec.add_argument(
        "--layouts", type=common.str_list, default=["2bit"], help="ternary weights: 2bit, base3 (alternating)"
    )
    thr = ap.add_argument_group("threads")
    thr.add_argument("--sweep", type=common.int_list, default=None, help="kernel threads (default 1,2,4..N)")
    thr.add_argument("--competitors", type=common.str_list, default=["none", "unpinned", "pinned"])
    gen = ap.add_argument_group("generate, load")
    gen.add_argument("--dir", default=str(common.ASSETS / "bench-2b4t"), help="the random-weight checkpoint")
    gen.add_argument("--checkpoint-shape", default="2b4t", help="its shape when written: 2b4t, large, tiny")
    gen.add_argument("--tokenizer", default=str(common.ASSETS / "llama3-tokenizer"), help="copied into --dir")
    gen.add_argument("--prompt", type=int, default=128, help="generate: prompt tokens")
    gen.add_argument("--models", type=common.str_list, default=None, help="load (default: --dir,bitnet-tiny)")
    gen.add_argument("--backends", type=common.str_list, default=["cpu"], help="load: cpu, reference")
    gen.add_argument("--runs", type=int, default=3, help="load: fresh processes a model and backend")
    gen.add_argument("--load-tokens", type=int, default=8, help="load: tokens decoded after the first")
    ab = ap.add_argument_group("against another checkout")
    ab.add_argument("--baseline", help="another checkout (its C library built in place)")
    ab.add_argument("--rounds", type=int, default=3, help="processes a tree, alternating (default 3)")
    ap.add_argument("--_worker", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--_load", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not (args._worker or args._load):
        check_args(ap, args)
    return args


def check_args(ap, args) -> None:
    """One line naming the first bad option (a comparing or child process gets its options from this one)."""
    from make_checkpoint import SHAPES as CHECKPOINT_SHAPES

    for flag, have, known in (
        ("--tables", args.tables, TABLES),
        ("--shapes", args.shapes, ("2b4t", "large")),
        ("--heads", args.heads, ("bf16", "int8")),
        ("--layouts", args.layouts, ("2bit", "base3")),
        ("--backends", args.backends, ("cpu", "reference")),
        ("--competitors", args.competitors, ("none", "unpinned", "pinned")),
        ("--checkpoint-shape", [args.checkpoint_shape], tuple(CHECKPOINT_SHAPES)),
    ):
        if not have or set(have) - set(known):
            ap.error(f"{flag} {','.join(have)}: choose from {', '.join(known)}")
    for flag, v in (("--threads", args.threads), ("--sweep", args.sweep)):
        if v is not None and (not v or min(v) < 1):
            ap.error(f"{flag} takes counts >= 1, found {v}")
    if args.baseline and not os.path.isdir(os.path.join(args.baseline, "bitnetlm")):
        ap.error(f"--baseline {args.baseline}: no bitnetlm/ package there (expected another checkout)")
    args.models = args.models or [args.dir, "bitnet-tiny"]


def main(argv=None) -> int:
    t0 = time.perf_counter()
    args = parse_args(argv)
    common.use_checkout(args._worker[0] if args._worker else common.ROOT)
    if args._load:
        load_child(*args._load, args.threads[0], args.load_tokens, t0)
        return 0
    if args._worker:
        print(json.dumps(worker(*args._worker, args)))
        return 0
    from bitnetlm.kernels import cpu

    if not cpu.available():
        raise SystemExit("cpu.py: the C kernels are not built here (python setup.py build_ext --inplace)")
    args.threads = args.threads or [cpu.physical_cores()]
    args.sweep = args.sweep or default_sweep()
    args.isa = args.isa or [cpu.get_isa()]
    if set(args.isa) - set(cpu.supported_isas()):
        raise SystemExit(
            f"cpu.py: --isa {','.join(args.isa)}: this CPU and build run {', '.join(cpu.supported_isas())}"
        )
    if args.baseline:
        baseline_table(args)
        return 0
    tables = {
        "decode": decode_table,
        "threads": threads_table,
        "generate": generate_table,
        "load": load_table,
    }
    for name, fn in tables.items():
        if name in args.tables:
            fn(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
