"""Load-to-first-token on the GPU (device machine): a 2B4T-shaped packed HF checkpoint (random weights, the
real offline-packed format, written by benchmarks/make_checkpoint.py if absent) -> load_model on CUDA ->
CudaEngine -> prefill of a prompt -> first token on the host.

    python benchmarks/gpu_first_token.py [--dir DIR] [--prompt 16] [--runs 2] [--via engine|generate|serve]
        [--compile-bytecode]

--via serve: what `bitnet serve` does on CUDA before /health reports ready (load_model, then the server's
`GraphRows`: its engine for 8 rows of the full context and every capture), then the first prompt's captured
prefill into row 0 and its greedy token.

--via engine (default): load_model, CudaEngine.from_model, one eager forward of `--prompt` random token ids,
greedy token. --via generate: what `bitnet generate` does, as a user of the library sees it: the CLI's own
load_model_and_tokenizer (bitnetlm.load: model on CUDA in bfloat16, backend chosen, tokenizer) then
bitnetlm.generate.stream_generate of a short text prompt with the CLI's default sampling flags, timed to its
first yielded token. Its engine column is build_engine (CudaEngine.from_model, KV cache for the CLI's default
256 new tokens), captures is the decode-step and prefill graph captures, the rest is tokenizing, the prefill
replay, sampling and detokenizing. That needs a tokenizer in --dir: copied from --tokenizer (default
.assets/llama3-tokenizer) when --dir has none.

Each run is a fresh process timed from before `python` starts to the first token on the host (wall clock,
`time.time()` in both processes); the process's exit after it (freeing the GPU memory and the CUDA context) is
shown apart and not counted. The first run pays Triton's compilation and the kernel tuning (both cached on disk),
later runs find them cached, as a second launch of the CLI would. Prints a markdown table naming the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. Once upon a time"


def _timed(spent: dict, key: str, fn, sync: bool = False):
    """fn, adding the seconds each call takes (to a CUDA sync when `sync`) to spent[key]."""

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if sync:
                import torch

                torch.cuda.synchronize()
            spent[key] += time.perf_counter() - t

    return wrapper


def _report(t0: float, t0_wall: float, t_first: float, t_first_wall: float, **phases) -> None:
    """A child's one JSON line for the parent: its phases, the in-process total, the wall-clock start and first
    token (the parent times the process by them) and the GPU."""
    import torch

    summary = dict(in_process_s=t_first - t0, t0_wall=t0_wall, first_wall=t_first_wall)
    print(json.dumps(dict(phases, **summary, gpu=torch.cuda.get_device_name())))


def _load_cuda(path: str):
    """The checkpoint on CUDA in bfloat16 with the Triton kernels, as the engine paths load it (synced)."""
    import torch

    from bitnetlm.loading import load_model

    model = load_model(path, device="cuda", dtype=torch.bfloat16, backend="triton").eval()
    torch.cuda.synchronize()
    return model


def child(path: str, prompt: int) -> None:
    t0_wall = time.time()
    t0 = time.perf_counter()
    import torch

    sys.path.insert(0, ROOT)
    from bitnetlm.runtime.cuda.engine import CudaEngine, EngineConfig

    t_import = time.perf_counter()
    model = _load_cuda(path)
    t_load = time.perf_counter()
    eng = CudaEngine.from_model(model, EngineConfig(max_batch=1, max_seq_len=prompt + 64), device="cuda")
    del model
    torch.cuda.synchronize()
    t_engine = time.perf_counter()
    tok = torch.randint(0, eng.cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first = eng.sample(eng.forward(tok.cuda(), torch.zeros(1, dtype=torch.int32, device="cuda")))
    first = int(first[0])  # host sync
    t_first = time.perf_counter()
    t_first_wall = time.time()
    _report(
        t0,
        t0_wall,
        t_first,
        t_first_wall,
        import_s=t_import - t0,
        load_s=t_load - t_import,
        engine_s=t_engine - t_load,
        first_token_s=t_first - t_engine,
        token=first,
        weight_gib=sum(eng.weight_bytes().values()) / 2**30,
    )


def child_generate(path: str) -> None:
    """stream_generate as `bitnet generate -m PATH PROMPT` runs it, to the first yielded token."""
    t0_wall = time.time()
    t0 = time.perf_counter()
    import torch

    sys.path.insert(0, ROOT)
    import bitnetlm.loading
    from bitnetlm.commands.generate import DEFAULTS, load_model_and_tokenizer
    from bitnetlm.generate import graph, stream_generate
    from bitnetlm.runtime.cuda.engine import CudaEngine

    t_import = time.perf_counter()
    spent = dict(tokenizer_s=0.0, engine_s=0.0, captures_s=0.0)
    # the library's own functions, timed in place (each module looks them up as a global at call time)
    bitnetlm.loading.load_tokenizer = _timed(spent, "tokenizer_s", bitnetlm.loading.load_tokenizer)
    graph.build_engine = _timed(spent, "engine_s", graph.build_engine, sync=True)
    CudaEngine.decode_state = _timed(spent, "captures_s", CudaEngine.decode_state, sync=True)
    CudaEngine.prefill_state = _timed(spent, "captures_s", CudaEngine.prefill_state, sync=True)

    model, tok = load_model_and_tokenizer(path, device="cuda")
    torch.cuda.synchronize()
    t_load = time.perf_counter()
    first = None
    n_ids = None
    for chunk in stream_generate(model, tok, PROMPT_TEXT, seed=0, **DEFAULTS):
        first = chunk.token  # a host int: the GPU work behind it is done
        n_ids = chunk.prompt_tokens
        break
    t_first = time.perf_counter()
    t_first_wall = time.time()
    eng = model.__dict__.get(graph._ATTR, (None,))[0]  # the engine generate built and cached, if any
    _report(
        t0,
        t0_wall,
        t_first,
        t_first_wall,
        import_s=t_import - t0,
        load_s=t_load - t_import - spent["tokenizer_s"],
        tokenizer_s=spent["tokenizer_s"],
        engine_s=spent["engine_s"],
        captures_s=spent["captures_s"],
        first_token_s=t_first - t_load - spent["engine_s"] - spent["captures_s"],
        token=first,
        prompt_tokens=n_ids,
        backend=getattr(model.layers[0].mlp.up_proj._backend, "name", "?"),
        graph=eng is not None,
        weight_gib=sum(eng.weight_bytes().values()) / 2**30 if eng is not None else float("nan"),
    )


def child_serve(path: str, prompt: int, max_batch: int = 8) -> None:
    """What `bitnet serve` does on CUDA before it reports ready (`serve/graph_rows.GraphRows`: the engine for
    `max_batch` rows of the model's full context, every batch size's decode steps and short key ranges captured,
    the shortest prefill), then one prompt's prefill into row 0 and its greedy token."""
    t0_wall = time.time()
    t0 = time.perf_counter()
    import torch

    sys.path.insert(0, ROOT)
    from bitnetlm.serve.graph_rows import GraphRows

    from bitnetlm.generate import graph

    t_import = time.perf_counter()
    model = _load_cuda(path)
    t_load = time.perf_counter()
    spent = dict(engine_s=0.0)
    graph.build_engine = _timed(spent, "engine_s", graph.build_engine, sync=True)  # looked up at call time
    with torch.no_grad():
        rows = GraphRows.create(model, max_batch, model.config.max_position_embeddings)
        torch.cuda.synchronize()
        t_rows = time.perf_counter()
        ids = torch.randint(0, model.config.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0))
        first = int(rows.prefill(0, ids.tolist(), 0).argmax())  # host sync
    t_first = time.perf_counter()
    t_first_wall = time.time()
    _report(
        t0,
        t0_wall,
        t_first,
        t_first_wall,
        import_s=t_import - t0,
        load_s=t_load - t_import,
        engine_s=spent["engine_s"],
        captures_s=t_rows - t_load - spent["engine_s"],
        graphs=len(rows.eng._graphs),
        first_token_s=t_first - t_rows,
        token=first,
    )


def compile_bytecode() -> None:
    """compileall over the imported packages. Python reads .pyc files even under PYTHONDONTWRITEBYTECODE=1 (which
    only stops it writing them): an image built that way compiles torch's Python from source in every process."""
    import importlib.util

    t = time.perf_counter()
    for name in ("torch", "triton", "numpy", "tokenizers", "safetensors", "jinja2", "bitnetlm"):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        for d in spec.submodule_search_locations:
            subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", d], check=False)
    print(f"bytecode compiled in {time.perf_counter() - t:.1f} s", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=os.path.join(ROOT, ".assets", "bench-2b4t"))
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument(
        "--via",
        choices=["engine", "generate", "serve"],
        default="engine",
        help="engine: CudaEngine directly; generate: bitnetlm.load + stream_generate as the CLI; serve: the "
        "server's engine rows (8, full context, every capture) then one prefill (default: %(default)s)",
    )
    ap.add_argument(
        "--tokenizer",
        default=os.path.join(ROOT, ".assets", "llama3-tokenizer"),
        help="--via generate: tokenizer files copied into --dir when it has no tokenizer.json",
    )
    ap.add_argument(
        "--compile-bytecode",
        action="store_true",
        help="first write the bytecode of the packages the runs import (torch, triton, numpy, tokenizers, "
        "safetensors, jinja2, bitnetlm), as `pip install` does by default; for images that ship without it",
    )
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._child:
        if a.via == "generate":
            child_generate(a.dir)
        elif a.via == "serve":
            child_serve(a.dir, a.prompt)
        else:
            child(a.dir, a.prompt)
        return 0
    sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]  # (write_checkpoint imports bitnetlm)
    from make_checkpoint import write_checkpoint

    if a.compile_bytecode:
        compile_bytecode()
    t = time.perf_counter()
    write_checkpoint(a.dir, "2b4t")
    if a.via == "generate" and not os.path.isfile(os.path.join(a.dir, "tokenizer.json")):
        import shutil

        for f in os.listdir(a.tokenizer):
            shutil.copy(os.path.join(a.tokenizer, f), a.dir)
        print(f"tokenizer copied from {a.tokenizer}", flush=True)
    size = sum(
        os.path.getsize(os.path.join(a.dir, f)) for f in os.listdir(a.dir) if f.endswith(".safetensors")
    )
    print(
        f"checkpoint {a.dir}: {size / 2**30:.2f} GiB ({time.perf_counter() - t:.1f} s to write)", flush=True
    )
    rows = []
    for i in range(a.runs):
        spawn = time.time()
        out = subprocess.run(
            [sys.executable, __file__, "--_child", "--dir", a.dir, "--prompt", str(a.prompt), "--via", a.via],
            capture_output=True,
            text=True,
        )
        if out.returncode:
            sys.stderr.write(out.stdout + out.stderr)
            raise SystemExit(f"run {i + 1}: the child process exited with {out.returncode}")
        wall = time.time() - spawn  # to the child's exit
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["wall_s"] = r.pop("first_wall") - spawn  # python starting -> first token
        r["startup_s"] = r.pop("t0_wall") - spawn  # interpreter start, before `import torch`
        r["exit_s"] = wall - r["wall_s"]  # after the first token: exit, GPU memory and context teardown
        r["run"] = i + 1
        rows.append(r)
        print(json.dumps(r), flush=True)
    what = (
        f"prompt {a.prompt} random token ids, CudaEngine.from_model + eager forward, greedy"
        if a.via == "engine"
        else f"--via serve: the server's GraphRows (8 rows, full context, {rows[0]['graphs']} graphs captured), then "
        f"a captured prefill of {a.prompt} random token ids into row 0, greedy"
        if a.via == "serve"
        else f"--via generate: bitnetlm.load + stream_generate, text prompt of {rows[0]['prompt_tokens']} tokens, "
        f"CLI default sampling, backend {rows[0]['backend']}, graph engine {'yes' if rows[0]['graph'] else 'NO'}"
    )
    print(f"\nGPU: {rows[0]['gpu']}; 2B4T-shaped packed checkpoint ({size / 2**30:.2f} GiB); {what}")
    print(
        "\n| run | wall s (process start -> first token) | start s | import s | load s | tokenizer s | engine s "
        "| captures s | prefill + first token s | exit s (not counted) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")

    def f(r, k):
        return f"{r[k]:.2f}" if k in r else "-"

    for r in rows:
        cols = ["wall_s", "startup_s", "import_s", "load_s", "tokenizer_s", "engine_s", "captures_s"]
        cols += ["first_token_s", "exit_s"]
        print(f"| {r['run']} | " + " | ".join(f(r, k) for k in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
