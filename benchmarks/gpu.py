"""What bitnet-lm gives a user on a CUDA GPU: one markdown table each, naming the GPU, the host and the date.

    python benchmarks/gpu.py                                        # every table, default settings
    python benchmarks/gpu.py --tables step --reps 3                 # = bitnet bench --shape 2b4t --device cuda ...
    python benchmarks/gpu.py --tables generate,memory --options bf16/auto,int8/fp8
    python benchmarks/gpu.py --tables first-token --via generate|engine|serve --runs 3 [--compile-bytecode]

Tables (--tables, comma-separated):
- step: the engine's prefill of --n-prompt tokens and its captured decode step (--n-gen steps) at each of
  --batches and --depths (tokens already in every row's KV cache, llama-bench's -d), the ternary engine (Triton
  W2A8) for each --heads x --kv against the same engine running the model unquantized through cuBLAS (bf16);
  random weights of the 2B4T shape. `bitnet bench --shape 2b4t --device cuda` prints the same table
  (`bitnetlm.runtime.cuda.bench.bench_cuda`).
- prefill: ms to prefill one prompt of each of --lengths into one row: a captured graph per padded length (16,
  32, 64 or a multiple of 128 tokens), mean of --prefill-reps replays; random 2B4T weights, each of --options.
- generate: `bitnetlm.generate` (1 prompt) and `bitnetlm.batch_generate` (--batch prompts of different lengths)
  of --tokens tokens, greedy and with llama.cpp's default sampler: TTFT, decode tok/s of the first row, generated
  tok/s of all rows. A 2B4T-shaped checkpoint in the real packed HF format with random weights (--dir, written by
  benchmarks/make_checkpoint.py when absent) and the real LLaMA-3 tokenizer, loaded with
  `bitnetlm.load(dir, device="cuda", head_dtype=..., kv_cache_dtype=...)` for each of --options.
- memory: GPU memory holding weights after the load and after the first generate (the model and its CUDA engine,
  each storage counted once), and all memory allocated then (weights, KV cache, graphs), for each of --options.
- first-token: --runs fresh processes, each timed from before `python` starts to the first token on the host
  (warm Triton and tuner caches after the first run); the process's exit is shown apart. --via generate: what
  `bitnet generate` does (load, tokenizer, runner, stream_generate with the CLI's sampling defaults); engine: the
  CudaEngine alone over the loaded model, one eager forward; serve: what `bitnet serve` does before it reports
  ready (8 rows of the full context, every capture), then one request's first token.
- request: the serving engine in process (no HTTP), one greedy request of 48 words at a time: p50 ms from submit
  to the first chunk and to the end, for --max-tokens and for 1 token, each of --options.

Random weights: speed and memory only, never quality.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

import common

TABLES = ("step", "prefill", "generate", "memory", "first-token", "request")
SAMPLERS = {
    "greedy": dict(temperature=0.0),
    "llama.cpp defaults (t0.8 k40 p.95 minp.05)": dict(
        temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=0
    ),
}
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. Once upon a time"
WORDS = "the quick brown fox jumps over the lazy dog while a single man in possession of a fortune".split()


def options(text: str) -> list[tuple[str, str]]:
    """--options "bf16/auto,int8/fp8" -> [(head, kv cache)] (argparse type)."""
    out = []
    for item in common.str_list(text):
        head, _, kv = item.partition("/")
        if head not in ("bf16", "int8") or kv not in ("auto", "bf16", "fp8"):
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected HEAD/KV with HEAD bf16|int8, KV auto|bf16|fp8"
            )
        out.append((head, kv))
    return out


def checkpoint(args) -> str:
    """The 2B4T-shaped checkpoint at --dir with the tokenizer's files beside it (written once, then cached)."""
    from make_checkpoint import write_checkpoint

    write_checkpoint(args.dir, "2b4t")
    if not os.path.isfile(os.path.join(args.dir, "tokenizer.json")):
        if not os.path.isfile(os.path.join(args.tokenizer, "tokenizer.json")):
            raise SystemExit(
                f"gpu.py: --tokenizer {args.tokenizer}: no tokenizer.json (scripts/fetch_assets.py)"
            )
        for f in os.listdir(args.tokenizer):
            shutil.copy(os.path.join(args.tokenizer, f), args.dir)
    return args.dir


# ---- step: the engine's prefill and decode step -------------------------------------------------------------
def step_table(args) -> None:
    from bitnetlm.runtime.cuda.bench import bench_cuda, markdown

    heads = tuple("fp" if h == "bf16" else h for h in args.heads)
    res = bench_cuda(
        None,
        tuple(args.batches),
        args.n_prompt,
        args.n_gen,
        heads=heads,
        reps=args.reps,
        kv=tuple(args.kv),
        depths=tuple(args.depths),
    )
    common.header("Decode step and prefill: ternary and bf16 engines (2B4T shape, random weights)", gpu=True)
    print(markdown(res), flush=True)


# ---- prefill by prompt length -------------------------------------------------------------------------------
def replay_ms(eng, ids: list[int], reps: int) -> float:
    import torch

    for _ in range(3):
        eng.prefill(ids, 0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        eng.prefill(ids, 0)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def prefill_table(args) -> None:
    import torch

    from bitnetlm.runtime.cuda.bench import random_engine
    from bitnetlm.runtime.cuda.graphs import prefill_len

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 100_000, (n,), generator=g).tolist() for n in args.lengths]
    cols = {}
    for head, kv in args.options:
        eng = random_engine(8, max(4096, 2 * max(args.lengths)), "fp" if head == "bf16" else head, kv)
        with torch.inference_mode():
            cols[f"ms, head {head}, cache {kv}"] = [replay_ms(eng, ids, args.prefill_reps) for ids in prompts]
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    common.header(
        "Prefill of one prompt by its length (2B4T shape, random weights)",
        gpu=True,
        details=f"One row, a captured graph per padded length; mean of {args.prefill_reps} replays to a CUDA sync.",
    )
    rows = [[n, prefill_len(n), *(f"{c[i]:.3f}" for c in cols.values())] for i, n in enumerate(args.lengths)]
    print(common.table(["tokens", "padded to", *cols], rows), flush=True)


# ---- generate and memory --------------------------------------------------------------------------------------
def weight_bytes(model) -> int:
    """Bytes of GPU memory holding weights: the model's parameters and buffers and those of the CUDA engine its
    kept runner holds, each storage counted once (the engine shares the packed projections with the model)."""
    import torch

    from bitnetlm.runtime import kept_runner

    ts = list(model.parameters()) + list(model.buffers())
    eng = getattr(kept_runner(model), "eng", None)
    if eng is not None:
        ts += [t for L in eng.layers for t in vars(L).values() if isinstance(t, torch.Tensor)]
        names = ("embed", "head", "embed_q", "embed_s", "head_q", "head_s", "final_norm")
        ts += [t for t in (getattr(eng, n, None) for n in names) if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts if t.is_cuda}
    return sum(storages.values())


def timed_generate(model, tok, prompts, n_new: int, sampler: str, eager: bool = False) -> tuple[float, ...]:
    """(TTFT ms, decode tok/s of the first row, generated tok/s of all rows) of one call."""
    import torch

    from bitnetlm.generate import SamplingParams, batch_generate, generate
    from bitnetlm.runtime import config_for

    p = SamplingParams(max_tokens=n_new, ignore_eos=True, **SAMPLERS[sampler])
    rt = config_for(model).replace(enforce_eager=True) if eager else None  # (None: the options of the load)
    torch.cuda.synchronize()
    t = time.perf_counter()
    if len(prompts) == 1:
        res = [generate(model, tok, prompts[0], p, runtime=rt)]
    else:
        res = batch_generate(model, tok, prompts, p, runtime=rt)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    return res[0].ttft_s * 1e3, res[0].generation_tps, sum(r.generation_tokens for r in res) / dt


def generate_rows(model, tok, args, label: str) -> tuple[list, dict]:
    """The generate table's rows of one loaded model and its memory after the first generate."""
    import torch

    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def ids(n):
        return torch.randint(min(1000, vocab // 2), min(vocab, 100_000), (n,), generator=g).tolist()

    single, batch = [ids(args.prompt)], [ids(args.prompt - 8 * i) for i in range(args.batch)]
    rows, mem = [], {}
    for eager in (False, True) if args.eager_tokens else (False,):
        n_new = args.eager_tokens if eager else args.tokens
        for sampler in SAMPLERS:  # warm-up: compilation, tuning, captures (every batch size and sampler)
            timed_generate(model, tok, batch, 4, sampler, eager)
            timed_generate(model, tok, single, 4, sampler, eager)
        if not eager:
            mem = dict(weights=weight_bytes(model), allocated=torch.cuda.memory_allocated())
        path = "eager forward (enforce_eager)" if eager else "CUDA graphs"
        for sampler in SAMPLERS:
            for prompts in (single, batch):
                ttft, tps, total = timed_generate(model, tok, prompts, n_new, sampler, eager)
                rows.append(
                    [label, path, len(prompts), sampler, n_new, f"{ttft:.1f}", f"{tps:,.1f}", f"{total:,.1f}"]
                )
    return rows, mem


def generate_tables(args, tables: set[str]) -> None:
    import torch

    import bitnetlm

    path = checkpoint(args)
    rows, mem_rows = [], []
    for head, kv in args.options:
        model, tok = bitnetlm.load(path, device="cuda", head_dtype=head, kv_cache_dtype=kv)
        model.eval()
        loaded = (weight_bytes(model), torch.cuda.memory_allocated())
        label = f"{head}, {kv}"
        got, mem = generate_rows(model, tok, args, label)
        rows += got
        mem_rows.append(
            [label, f"{loaded[0] / 1e9:.3f}", f"{mem['weights'] / 1e9:.3f}", f"{mem['allocated'] / 1e9:.3f}"]
        )
        del model, tok
        gc.collect()
        torch.cuda.empty_cache()
    if "generate" in tables:
        common.header(
            "`generate` on CUDA (2B4T shape, random weights, LLaMA-3 tokenizer)",
            gpu=True,
            details=f"{args.prompt}-token prompt; the {args.batch} prompts {args.prompt - 8 * (args.batch - 1)}-"
            f"{args.prompt} tokens; ignore_eos; the call after a warm-up of every batch size and sampler.",
        )
        cols = ["head, KV cache", "path", "prompts", "sampler", "tokens", "TTFT ms", "decode tok/s (row 0)"]
        print(common.table([*cols, "generated tok/s (all rows)"], rows, [False] * 4 + [True] * 4), flush=True)
    if "memory" in tables:
        common.header("GPU memory holding weights (2B4T shape)", gpu=True)
        cols = ["head, KV cache", "weights after load GB", "weights after the first generate GB"]
        print(common.table([*cols, "all allocated then GB"], mem_rows), flush=True)


# ---- first-token: fresh processes -----------------------------------------------------------------------------
def _report(t0: tuple[float, float], marks: dict[str, float], **extra) -> None:
    """A child's one JSON line: its phases (seconds between the marks, in order), the wall-clock times of its
    start and first token (the parent times the process by them) and the GPU."""
    import torch

    t_first, first_wall = time.perf_counter(), time.time()
    names, times = list(marks), [t0[0], *marks.values()]
    phases = {f"{n}_s": times[i + 1] - times[i] for i, n in enumerate(names)}
    out = dict(phases, **extra, t0_wall=t0[1], first_wall=first_wall - (t_first - times[-1]))
    print(json.dumps(dict(out, gpu=torch.cuda.get_device_name())))


def child_generate(args, t0) -> None:
    """`bitnet generate -m DIR PROMPT`: load, tokenizer, the model's runner, stream_generate to its first token."""
    import torch

    from bitnetlm.commands.generate import DEFAULTS
    from bitnetlm.generate import prompt_to_ids, stream_generate
    from bitnetlm.loading import load_model, load_tokenizer
    from bitnetlm.runtime import runner_for

    marks = {"import": time.perf_counter()}
    model = load_model(args.dir, device="cuda").eval()
    torch.cuda.synchronize()
    marks["load"] = time.perf_counter()
    tok = load_tokenizer(args.dir)
    marks["tokenizer"] = time.perf_counter()
    ids = prompt_to_ids(tok, PROMPT_TEXT)
    runner_for(model, None, 1, len(ids) + DEFAULTS["max_tokens"])  # the runner stream_generate then takes
    torch.cuda.synchronize()
    marks["runner"] = time.perf_counter()
    stream = stream_generate(model, tok, ids, seed=0, **DEFAULTS)
    first = next(stream).token  # a host int
    marks["first_token"] = time.perf_counter()
    _report(t0, marks, token=first, prompt_tokens=len(ids))
    stream.close()  # (after the report: closing frees the row and drains the queued step)


def child_engine(args, t0) -> None:
    """The CudaEngine alone over the loaded model: one eager forward of --first-prompt random ids, greedy."""
    import torch

    from bitnetlm.loading import load_model
    from bitnetlm.runtime.cuda.engine import CudaEngine, EngineConfig

    marks = {"import": time.perf_counter()}
    model = load_model(args.dir, device="cuda", backend="triton").eval()
    torch.cuda.synchronize()
    marks["load"] = time.perf_counter()
    ecfg = EngineConfig(max_batch=1, max_seq_len=args.first_prompt + 64)
    eng = CudaEngine.from_model(model, ecfg, device="cuda")
    del model
    torch.cuda.synchronize()
    marks["runner"] = time.perf_counter()
    ids = torch.randint(
        0, eng.cfg.vocab_size, (1, args.first_prompt), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        logits = eng.forward(ids.cuda(), torch.zeros(1, dtype=torch.int32, device="cuda"))
        first = int(eng.sample(logits)[0])
    marks["first_token"] = time.perf_counter()
    _report(t0, marks, token=first, prompt_tokens=args.first_prompt)


def one_request(engine, prompt: list[int], max_tokens: int) -> tuple[float, float, float]:
    """perf_counter times of one greedy request's submit, first chunk and end on the serving engine."""
    from bitnetlm.sampling import SamplingParams
    from bitnetlm.serve.requests import Chunk, Failed, Finished, GenerationRequest

    done, first, failed = threading.Event(), [], []

    def sink(ev):
        if isinstance(ev, Chunk) and not first:
            first.append(time.perf_counter())
        elif isinstance(ev, (Finished, Failed)):
            failed.extend([ev] if isinstance(ev, Failed) else [])
            done.set()

    t0 = time.perf_counter()
    engine.submit(
        GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)),
        sink,
    )
    if not done.wait(600) or failed or not first:
        raise RuntimeError(f"the serving engine did not finish a request: {failed or 'no answer in 600 s'}")
    return t0, first[0], time.perf_counter()


def child_serve(args, t0) -> None:
    """`bitnet serve -m DIR`: load, tokenizer, the serving engine (8 rows of the full context, every graph
    captured before it reports ready), then one request of --first-prompt random ids to its first token."""
    import torch

    from bitnetlm.loading import load_model, load_tokenizer
    from bitnetlm.serve.engine import Engine

    marks = {"import": time.perf_counter()}
    model = load_model(args.dir, device="cuda", max_batch=8).eval()
    torch.cuda.synchronize()
    marks["load"] = time.perf_counter()
    tok = load_tokenizer(args.dir)
    marks["tokenizer"] = time.perf_counter()
    engine = Engine(model, tok)
    torch.cuda.synchronize()
    marks["runner"] = time.perf_counter()
    ids = torch.randint(
        0, model.config.vocab_size, (args.first_prompt,), generator=torch.Generator().manual_seed(0)
    )
    _, t_first, _ = one_request(engine, ids.tolist(), 1)
    marks["first_token"] = t_first
    graphs = len(getattr(getattr(engine.runner, "eng", None), "_graphs", ()))
    _report(t0, marks, prompt_tokens=args.first_prompt, graphs=graphs)
    engine.shutdown(drain=False)


CHILDREN = {"generate": child_generate, "engine": child_engine, "serve": child_serve}


def compile_bytecode() -> None:
    """compileall over the packages a run imports, as `pip install` does by default: an image without .pyc files
    compiles torch's Python from source in every process."""
    import importlib.util

    t = time.perf_counter()
    for name in ("torch", "triton", "numpy", "tokenizers", "safetensors", "jinja2", "bitnetlm"):
        spec = importlib.util.find_spec(name)
        for d in (spec.submodule_search_locations or []) if spec else []:
            subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", d], check=False)
    print(f"bytecode compiled in {time.perf_counter() - t:.1f} s", flush=True)


def spawn(args, run: int) -> dict:
    """One fresh process of --via: its report, with wall seconds from the spawn to its start and first token and
    the seconds its exit took after that."""
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", args.via, "--dir", args.dir]
    t = time.time()
    out = subprocess.run([*cmd, "--first-prompt", str(args.first_prompt)], capture_output=True, text=True)
    wall = time.time() - t
    if out.returncode:
        sys.stderr.write(out.stdout + out.stderr)
        raise SystemExit(f"gpu.py: first-token run {run}: the process exited with {out.returncode}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["wall_s"] = r.pop("first_wall") - t
    r["start_s"] = r.pop("t0_wall") - t
    r["exit_s"] = wall - r["wall_s"]
    return r


def first_token_table(args) -> None:
    path = checkpoint(args)
    if args.compile_bytecode:
        compile_bytecode()
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    runs = [spawn(args, i + 1) for i in range(args.runs)]
    what = {
        "generate": f"bitnetlm.load + stream_generate of a {runs[0]['prompt_tokens']}-token text prompt with the "
        "CLI's sampling defaults, as `bitnet generate`",
        "engine": f"CudaEngine.from_model, one eager forward of {args.first_prompt} random ids, greedy",
        "serve": f"the serving engine (8 rows, full context, {runs[0].get('graphs', '?')} graphs captured), then a "
        f"request of {args.first_prompt} random ids, as `bitnet serve` then its first request",
    }[args.via]
    common.header(
        f"Load to first token, fresh processes (--via {args.via})",
        gpu=True,
        details=f"2B4T-shaped packed checkpoint ({size / 2**30:.2f} GiB, random weights); {what}. Each run timed "
        "from before `python` starts to the first token on the host; its exit after that is not counted.",
    )
    cols = ["wall_s", "start_s", "import_s", "load_s", "tokenizer_s", "runner_s", "first_token_s", "exit_s"]
    rows = [[i + 1, *(f"{r[c]:.2f}" if c in r else "-" for c in cols)] for i, r in enumerate(runs)]
    names = ["run", "wall s (start -> first token)", "start s", "import s", "load s", "tokenizer s"]
    names += ["engine / runner s", "captures + prefill + first token s", "exit s (not counted)"]
    print(common.table(names, rows), flush=True)


# ---- request: the serving engine in process ---------------------------------------------------------------------
def request_table(args) -> None:
    import torch

    import bitnetlm
    from bitnetlm.serve.engine import Engine

    path, rows = checkpoint(args), []
    for head, kv in args.options:
        model, tok = bitnetlm.load(path, device="cuda", head_dtype=head, kv_cache_dtype=kv, max_batch=32)
        engine = Engine(model.eval(), tok)
        prompts = [tok.encode(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(48))) for i in range(64)]
        try:
            for n in (4, args.max_tokens, 1):  # (4: a warm-up)
                runs = [one_request(engine, prompts[i % 64], n) for i in range(args.requests)]
                ttft = statistics.median(f - s for s, f, _ in runs) * 1e3
                e2e = statistics.median(e - s for s, _, e in runs) * 1e3
                if n != 4:
                    rows.append(
                        [
                            f"{head}, {kv}",
                            len(prompts[0]),
                            n,
                            f"{ttft:.2f}",
                            f"{e2e:.2f}",
                            f"{n / e2e * 1e3:,.1f}",
                        ]
                    )
        finally:
            engine.shutdown(drain=False)
        del engine, model, tok
        gc.collect()
        torch.cuda.empty_cache()
    common.header(
        "One request at a time on the serving engine, in process (2B4T shape, random weights)",
        gpu=True,
        details=f"Greedy, ignore_eos, 48-word prompts; p50 of {args.requests} requests; server rows: 32.",
    )
    cols = [
        "head, KV cache",
        "prompt tokens",
        "completion tokens",
        "first chunk p50 ms",
        "request p50 ms",
        "tok/s",
    ]
    print(common.table(cols, rows), flush=True)


# ---- command line -------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--tables", type=common.str_list, default=list(TABLES), help=f"of {', '.join(TABLES)} (default: all)"
    )
    step = ap.add_argument_group("step")
    step.add_argument("--batches", type=common.int_list, default=[1, 8, 64], help="decode batch sizes")
    step.add_argument(
        "--depths", type=common.int_list, default=[0, 512], help="tokens cached before each test"
    )
    step.add_argument("--n-prompt", type=int, default=512, help="prefill tokens a row")
    step.add_argument("--n-gen", type=int, default=128, help="decode steps timed")
    step.add_argument("--heads", type=common.str_list, default=["bf16", "int8"], help="LM heads: bf16, int8")
    step.add_argument(
        "--kv",
        type=common.str_list,
        default=["auto", "fp8"],
        help="KV caches: auto (bf16), fp8, each also as NAME+paged (a paged cache, blocks scattered)",
    )
    step.add_argument("--reps", type=int, default=3, help="timings a test (median)")
    pre = ap.add_argument_group("prefill")
    pre.add_argument("--lengths", type=common.int_list, default=[1, 20, 49, 64, 100, 128, 200, 256, 512])
    pre.add_argument("--prefill-reps", type=int, default=20, help="replays a length (mean)")
    gen = ap.add_argument_group("generate, memory, request, first-token")
    gen.add_argument(
        "--options", type=options, default=options("bf16/auto,int8/fp8"), help="HEAD/KV-CACHE pairs"
    )
    gen.add_argument("--dir", default=str(common.ASSETS / "bench-2b4t"), help="the 2B4T-shaped checkpoint")
    gen.add_argument("--tokenizer", default=str(common.ASSETS / "llama3-tokenizer"), help="copied into --dir")
    gen.add_argument("--prompt", type=int, default=128, help="prompt tokens (the batch's: 8 fewer each row)")
    gen.add_argument("--tokens", type=int, default=256, help="tokens generated a row")
    gen.add_argument("--batch", type=int, default=8, help="prompts of the batch_generate rows")
    gen.add_argument(
        "--eager-tokens", type=int, default=0, help="also the eager forward's rows, this many tokens"
    )
    gen.add_argument("--requests", type=int, default=16, help="request: requests a row (p50)")
    gen.add_argument("--max-tokens", type=int, default=64, help="request: completion tokens")
    gen.add_argument(
        "--via", choices=sorted(CHILDREN), default="generate", help="first-token: what the process runs"
    )
    gen.add_argument("--runs", type=int, default=3, help="first-token: fresh processes")
    gen.add_argument(
        "--first-prompt", type=int, default=16, help="first-token: random prompt ids (engine, serve)"
    )
    gen.add_argument(
        "--compile-bytecode", action="store_true", help="first-token: write the packages' .pyc first"
    )
    ap.add_argument("--_child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if set(args.tables) - set(TABLES):
        ap.error(
            f"--tables: unknown {sorted(set(args.tables) - set(TABLES))}; choose from {', '.join(TABLES)}"
        )
    if set(args.heads) - {"bf16", "int8"} or {k.removesuffix("+paged") for k in args.kv} - {
        "auto",
        "bf16",
        "fp8",
    }:
        ap.error(f"--heads takes bf16|int8, --kv auto|bf16|fp8; found {args.heads} and {args.kv}")
    return args


def main(argv=None) -> int:
    t0 = (time.perf_counter(), time.time())
    args = parse_args(argv)
    common.use_checkout()
    if args._child:
        CHILDREN[args._child](args, t0)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu.py: needs a CUDA GPU; torch sees none", file=sys.stderr)
        return 2
    tables = set(args.tables)
    if "step" in tables:
        step_table(args)
    if "prefill" in tables:
        prefill_table(args)
    if tables & {"generate", "memory"}:
        generate_tables(args, tables)
    if "first-token" in tables:
        first_token_table(args)
    if "request" in tables:
        request_table(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
