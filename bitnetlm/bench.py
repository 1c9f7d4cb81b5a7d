"""`bitnet bench`: prefill (ppN) and decode (tgN) tokens/s, llama-bench style, as a table or --json.

    bitnet bench --shape 2b4t -p 128,512 -n 128 -t 1,2          # random weights of the exact 2B4T shape
    bitnet bench -m path/to/model --head-dtype int8 --json
    bitnet bench -m path/to/model --device cuda -b 1,8,64 --kv-cache-dtype auto,fp8   # CUDA-graph engine vs bf16

--device auto (the default) benches the GPU when there is one, else the CPU.

ppN: one forward pass over an N-token prompt into an empty KV cache (only the last position's logits, as
llama.cpp computes them). tgN: N single-token decode steps from an empty cache. `-d D` (llama-bench's
--n-depth) runs each test after D tokens already in the cache instead ("pp512 @ d512": the context a test
starts from, filled untimed). Each test repeats `-r` times; the table shows mean +- std of tokens/s.
Device-specific parts (`_setup_threads`, `_sync`) are small functions so other devices extend the same command.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from bitnetlm import progress
from bitnetlm.generate.args import add_speculative_arguments, speculative_from_args
from bitnetlm.models.shapes import SHAPES
from bitnetlm.runtime.args import add_runtime_arguments, int_list, runtime_from_args


# ---- random-weight models ---------------------------------------------------------------------------
def _code_lut() -> torch.Tensor:
    # byte value for each of the 81 combinations of four 2-bit codes in {0, 1, 2}
    d = torch.arange(81)
    return ((d % 3) | ((d // 3 % 3) << 2) | ((d // 9 % 3) << 4) | ((d // 27 % 3) << 6)).to(torch.uint8)


def random_packed(n: int, k: int, backend, gen: torch.Generator) -> torch.Tensor:
    """Uniform random ternary weights [n, k] directly in `backend`'s packed layout."""
    from bitnetlm.quant.packing import PackingFormat

    if PackingFormat(backend.layout) is PackingFormat.CPU_2BIT and k % 128 == 0 and n % 4 == 0:
        from bitnetlm.kernels.cpu import arena

        idx = torch.randint(0, 81, (n, k // 4), generator=gen, dtype=torch.int64)
        return arena.place(_code_lut()[idx])  # [n, k/4] bytes of four uniform codes (no padding to fill)
    return backend.pack(torch.randint(-1, 2, (n, k), generator=gen, dtype=torch.int8))


def random_model(
    shape: str | dict, head_dtype: str | None = "bf16", backend: str | None = None, seed: int = 0
):
    """An inference model of a real shape with random ternary weights, packed for the CPU backend.

    Built on the meta device and filled tensor by tensor, so no float32 copy of the embedding is ever made
    when head_dtype is "bf16" or "int8" (the 2B4T embedding alone is 1.3 GB in float32).
    """
    from torch import nn

    from bitnetlm.kernels import select_backend
    from bitnetlm.kernels.cpu.head import CompactEmbedding, CompactHead
    from bitnetlm.models import ModelConfig, build_empty_model
    from bitnetlm.models.transformer import rope_inv_freq
    from bitnetlm.quant.bitlinear import BitLinear

    cfg = ModelConfig(**(SHAPES[shape] if isinstance(shape, str) else shape))
    gen = torch.Generator().manual_seed(seed)
    be = select_backend("cpu", backend)
    model = build_empty_model(cfg, "infer")
    for mod in model.modules():
        if isinstance(mod, BitLinear):
            mod.packed = random_packed(mod.out_features, mod.in_features, be, gen)
            mod.weight_scale = torch.rand(1, generator=gen) * 0.5 + 0.5
            mod.layout = be.layout
            mod.kernel = be
    model.inv_freq = rope_inv_freq(cfg)

    def table(v: int) -> torch.Tensor:
        w = torch.empty(v, cfg.hidden_size, dtype=torch.bfloat16)
        for i in range(0, v, 8192):
            w[i : i + 8192] = torch.randn(min(8192, v - i), cfg.hidden_size, generator=gen)
        return w

    emb = table(cfg.vocab_size)
    if head_dtype is None:
        model.embed_tokens.weight = nn.Parameter(emb.float(), requires_grad=False)
        if model.lm_head is not None:
            model.lm_head.weight = nn.Parameter(table(cfg.vocab_size).float(), requires_grad=False)
    else:
        head = CompactHead(emb, head_dtype)
        model.embed_tokens = CompactEmbedding(head)
        model.lm_head = head if model.lm_head is None else CompactHead(table(cfg.vocab_size), head_dtype)
    for mod in model.modules():  # norms: real ones
        for name, p in list(mod.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(mod, name, nn.Parameter(torch.ones(p.shape, dtype=p.dtype), requires_grad=False))
    return model.eval()


def model_bytes(model) -> int:
    """Bytes of weights held by the model (packed projections, head/embedding, norms)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_meta or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


# ---- device-specific parts ------------------------------------------------------------------------
def _setup_threads(device: torch.device, n: int, model: torch.nn.Module) -> int:
    """CPU: n threads for the C kernels and 1 for torch's own ops while `model` runs on the C kernels: those ops
    are small next to the projections, and libgomp workers spinning after each of them steal the cores the
    kernel threads need (measured on 2 cores, 2B4T shape: decode step 92 ms with torch at 1 thread vs
    156 ms at 2; pp128 100 tok/s vs 75). Without the C kernels torch gets the n threads."""
    if device.type == "cpu":
        from bitnetlm.kernels import configure_threads

        configure_threads(model, n)  # C kernels: n kernel threads, torch 1; otherwise torch n
    return n


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_threads() -> list[int]:
    from bitnetlm.kernels.cpu import physical_cores

    n = physical_cores()
    return [1, n] if n > 1 else [1]


# ---- the tests ------------------------------------------------------------------------------------
def _runner(model, n: int, depth: int, vocab: int, gen: torch.Generator):
    """A one-row runner for `depth` + n positions whose first `depth` hold a random prompt (run untimed)."""
    from bitnetlm.runtime import make_runner
    from bitnetlm.runtime.config import RuntimeConfig

    runner = make_runner(model, RuntimeConfig(), 1, depth + n)
    if depth:
        runner.prefill(0, torch.randint(0, vocab, (depth,), generator=gen).tolist())
    return runner


def _time_pass(model, n: int, device, vocab: int, gen, depth: int, verify: bool) -> float:
    """Seconds of one forward over n random tokens after `depth` cached ones: a prefill chunk (the last
    position's logits) or a verify pass (every position's)."""
    runner = _runner(model, n, depth, vocab, gen)
    ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
    _sync(device)
    t0 = time.perf_counter()
    (runner.verify if verify else runner.prefill)(0, ids, depth)
    _sync(device)
    return time.perf_counter() - t0


def time_prefill(
    model, n_prompt: int, device: torch.device, vocab: int, gen: torch.Generator, depth: int = 0
):
    return _time_pass(model, n_prompt, device, vocab, gen, depth, verify=False)


def time_decode(model, n_gen: int, device: torch.device, vocab: int, gen: torch.Generator, depth: int = 0):
    runner = _runner(model, n_gen, depth, vocab, gen)
    tok = int(torch.randint(0, vocab, (1,), generator=gen))
    _sync(device)
    t0 = time.perf_counter()
    for pos in range(depth, depth + n_gen):
        tok = int(runner.decode([0], [tok], [pos])[0].argmax())
    _sync(device)
    return time.perf_counter() - t0


def time_verify(model, n: int, device: torch.device, vocab: int, gen: torch.Generator, depth: int = 0):
    """One pass scoring n tokens after the cached ones (speculative decoding's verify: logits at each)."""
    return _time_pass(model, n, device, vocab, gen, max(depth, 1), verify=True)  # (it continues a prompt)


def bench_speculative(
    model, tok, prompt: str, n_gen: int, spec, repetitions: int = 3, label: str = "", threads: int = 0
) -> list[dict]:
    """Greedy generation of n_gen tokens after `prompt`, without and with speculative decoding `spec`: one row
    each, with the drafts' acceptance and the tokens emitted per target pass on the second."""
    from bitnetlm.generate import generate

    rows = []
    for name, sp in ((f"tg{n_gen} (prompt)", None), (f"sg{n_gen} ({_spec_name(spec)})", spec)):
        runs, res = [], None
        for _ in range(repetitions + 1):  # (the first warms up)
            res = generate(
                model, tok, prompt, max_tokens=n_gen, temperature=0, ignore_eos=True, speculative=sp
            )
            runs.append(res.generation_tps)
        runs = runs[1:]
        row = dict(model=label, test=name, threads=threads, tokens_per_s=statistics.mean(runs))
        row.update(std=statistics.stdev(runs) if len(runs) > 1 else 0.0, runs=runs, tokens=res.tokens)
        if sp is not None:
            passes = res.generation_tokens - res.accepted_tokens  # each pass emits its accepted tokens + one
            row.update(draft_tokens=res.draft_tokens, accepted_tokens=res.accepted_tokens)
            row.update(acceptance=res.accepted_tokens / max(1, res.draft_tokens))
            row.update(tokens_per_pass=res.generation_tokens / max(1, passes))
            row.update(
                speedup=row["tokens_per_s"] / rows[0]["tokens_per_s"],
                same_output=res.tokens == rows[0]["tokens"],
            )
        rows.append(row)
    return rows


def _spec_name(spec) -> str:
    how = f"lookup {spec.lookup_min}-{spec.lookup}" if spec.lookup else "draft model"
    return f"{how}, k<={spec.num_tokens}"


def bench(
    model,
    n_prompt=(128, 512),
    n_gen=(128,),
    threads=None,
    repetitions: int = 3,
    device="cpu",
    label: str = "",
    warmup: bool = True,
    depths=(0,),
    n_verify=(),
) -> list[dict]:
    """Run ppN / tgN / vN (a verify pass of N tokens) at each depth (cached tokens before the test) for each
    thread count; returns one dict per (threads, test, depth)."""
    device = torch.device(device)
    threads = list(threads or default_threads())
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    backend = _backend_name(model)
    rows = []
    for nt in threads:
        _setup_threads(device, nt, model)
        if warmup:
            time_decode(model, 4, device, vocab, gen)
            time_prefill(model, 16, device, vocab, gen)
        tests = [(f"pp{n}", n, time_prefill) for n in n_prompt if n > 0]
        tests += [(f"tg{n}", n, time_decode) for n in n_gen if n > 0]
        tests += [(f"v{n}", n, time_verify) for n in n_verify if n > 0]
        for (name, n, fn), d in ((t, d) for t in tests for d in depths):
            speeds = [n / fn(model, n, device, vocab, gen, d) for _ in range(repetitions)]
            name_d = f"{name} @ d{d}" if d else name  # llama-bench's names
            rows.append(
                dict(
                    model=label,
                    size_gib=model_bytes(model) / 2**30,
                    params=model.config.num_parameters(),
                    backend=backend,
                    head=_head_name(model),
                    device=device.type,
                    threads=nt,
                    test=name_d,
                    depth=d,
                    tokens_per_s=statistics.mean(speeds),
                    std=statistics.stdev(speeds) if len(speeds) > 1 else 0.0,
                    runs=speeds,
                )
            )
    return rows


def _backend_name(model) -> str:
    from bitnetlm.quant.bitlinear import BitLinear

    for m in model.modules():
        if isinstance(m, BitLinear) and m.kernel is not None:
            name = m.kernel.name
            if name == "cpu":
                from bitnetlm.kernels import cpu

                name = f"cpu-{cpu.get_isa()}"
            return name
    return "torch"


def _head_name(model) -> str:
    from bitnetlm.kernels.cpu.head import CompactHead

    if isinstance(model.lm_head, CompactHead):
        return model.lm_head.dtype_name
    return str(model.lm_head_weight().dtype).replace("torch.", "")


# AMD's x86 families by core generation: a VM's model name is often only "AMD EPYC", which hides it
_AMD_FAMILIES = {23: "Zen/Zen 2", 25: "Zen 3/Zen 4", 26: "Zen 5"}


def cpu_model_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name from /proc/cpuinfo, with its x86 family and model (and AMD's core generation);
    platform's answer where that file is missing."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip():  # the first processor's block ends here
                    break
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name")
    if not name:
        return platform.processor() or platform.machine()
    fam, model = fields.get("cpu family", ""), fields.get("model", "")
    if fam.isdigit() and model.isdigit():
        gen = _AMD_FAMILIES.get(int(fam)) if fields.get("vendor_id") == "AuthenticAMD" else None
        name += f" (family {fam} model {model}{', ' + gen if gen else ''})"
    return name


def machine_name() -> str:
    import os

    return f"{cpu_model_name()}, {os.cpu_count()} CPUs, {platform.system()} {platform.machine()}"


def markdown(rows: list[dict]) -> str:
    out = [
        "| model | size | params | backend | head | threads | test | t/s |",
        "| --- | ---: | ---: | --- | --- | ---: | --- | ---: |",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['size_gib']:.2f} GiB | {r['params'] / 1e9:.2f} B | {r['backend']} | {r['head']} | "
            f"{r['threads']} | {r['test']} | {r['tokens_per_s']:.2f} ± {r['std']:.2f} |"
        )
    return "\n".join(out)


# ---- CLI ------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="model directory, .gguf file or zoo name (or use --shape)")
    p.add_argument(
        "--shape", choices=sorted(SHAPES), help="random weights of a real model shape instead of -m"
    )
    p.add_argument(
        "-p", "--n-prompt", type=int_list, default=[128, 512], help="prompt lengths (default: 128,512)"
    )
    p.add_argument("-n", "--n-gen", type=int_list, default=[128], help="tokens to generate (default: 128)")
    p.add_argument(
        "-t",
        "--threads",
        type=int_list,
        default=None,
        help="CPU thread counts, comma-separated (default: 1,physical cores)",
    )
    p.add_argument("-r", "--repetitions", type=int, default=3, help="runs of each test (default: 3)")
    p.add_argument(
        "-d",
        "--n-depth",
        type=int_list,
        default=[0],
        help="tokens already in the KV cache before each test, comma-separated (default: 0, an empty cache)",
    )
    p.add_argument(
        "--head-dtype",
        choices=["bf16", "int8", "none"],
        default="bf16",
        help="embedding/LM head storage on CPU: bf16 (default), int8 (per-row scaled) or none (model dtype)",
    )
    p.add_argument(
        "-b",
        "--batch",
        type=int_list,
        default=None,
        help="--device cuda: decode batch sizes (default: 1,8,64)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        type=lambda s: [v for v in s.split(",") if v],
        default=None,
        help="--device cuda: KV-cache types of the ternary rows, comma-separated auto|bf16|fp8 (default: auto)",
    )
    p.add_argument(
        "--n-verify",
        type=int_list,
        default=[],
        help="verify passes of N tokens (speculative decoding's cost per pass; compare with tgN), comma-separated",
    )
    p.add_argument(
        "-f",
        "--prompt-file",
        default=None,
        help="with --lookup or --draft-model: greedy generation of -n tokens after this text, without and with "
        "speculative decoding (speedup, acceptance, tokens per target pass)",
    )
    add_speculative_arguments(p)
    add_runtime_arguments(p, ("device", "backend", "weights_layout"))
    p.add_argument("--json", action="store_true", help="print results as JSON")
    progress.add_argument(p)


def run(args: argparse.Namespace) -> int:
    head = None if args.head_dtype == "none" else args.head_dtype
    if bool(args.model) == bool(args.shape):
        print("bitnet bench: give exactly one of -m/--model or --shape", file=sys.stderr)
        return 2
    if any(d < 0 for d in args.n_depth):
        print(f"bitnet bench: -d/--n-depth takes counts >= 0, found {args.n_depth}", file=sys.stderr)
        return 2
    if args.threads is not None and (not args.threads or min(args.threads) < 1):
        print(f"bitnet bench: -t/--threads takes counts >= 1, found {args.threads}", file=sys.stderr)
        return 2
    rt = runtime_from_args(args, ("device", "backend", "weights_layout"))
    args.device = str(rt.torch_device)  # auto; absent: one line
    spec = speculative_from_args(args)
    if bool(spec) != bool(args.prompt_file) or (spec and not args.model):
        print("bitnet bench: -f/--prompt-file goes with --lookup or --draft-model, and -m", file=sys.stderr)
        return 2
    if args.device.startswith("cuda"):  # the CUDA half lives with the Triton kernels
        from bitnetlm.runtime.cuda.bench import run_cuda

        return run_cuda(args)
    if args.batch or args.kv_cache_dtype:
        print("bitnet bench: -b/--batch and --kv-cache-dtype apply to --device cuda only", file=sys.stderr)
        return 2
    if args.shape:
        from bitnetlm.runtime.cpu import set_weights_layout

        model = random_model(args.shape, head_dtype=head, backend=args.backend)
        set_weights_layout(model, rt.weights_layout)
        label = f"{args.shape} (random weights)"
    else:
        from bitnetlm.loading import load_model

        opts = dict(
            device=args.device, backend=args.backend, head_dtype=head, weights_layout=rt.weights_layout
        )
        model = load_model(args.model, **opts).eval()
        label = str(args.model)
    rows = bench(
        model,
        args.n_prompt,
        args.n_gen,
        args.threads,
        args.repetitions,
        args.device,
        label,
        depths=args.n_depth,
        n_verify=args.n_verify,
    )
    spec_rows = _speculative(args, model, label) if spec else []
    if args.json:
        print(json.dumps({"machine": machine_name(), "results": rows + spec_rows}, indent=2))
        return 0
    print(f"machine: {machine_name()}\n")
    print(markdown(rows))
    for line in verify_costs(rows):
        print(line)
    if spec_rows:
        print("\n" + speculative_markdown(spec_rows))
    return 0


def _speculative(args, model, label: str) -> list[dict]:
    from bitnetlm.loading import load_speculative, load_tokenizer

    tok = load_tokenizer(args.model)
    spec = load_speculative(speculative_from_args(args), None, tok)
    with open(args.prompt_file, encoding="utf-8") as f:
        prompt = f.read()
    threads = (args.threads or default_threads())[-1]  # (the last count `bench` set)
    return bench_speculative(model, tok, prompt, args.n_gen[0], spec, args.repetitions, label, threads)


def verify_costs(rows: list[dict]) -> list[str]:
    """A line per vN row: what one verify pass costs in decode steps (the tgN row of the same threads and depth)."""
    out = []
    for v in (r for r in rows if r["test"].startswith("v")):
        tg = [
            r
            for r in rows
            if r["test"].startswith("tg") and (r["threads"], r["depth"]) == (v["threads"], v["depth"])
        ]
        if tg:
            n = int(v["test"].split()[0][1:])
            steps = (n / v["tokens_per_s"]) * tg[0]["tokens_per_s"]
            out.append(
                f"{v['test']}, {v['threads']} threads: one pass of {n} tokens costs {steps:.2f} decode steps"
            )
    return out


def speculative_markdown(rows: list[dict]) -> str:
    out = [
        "| model | threads | test | t/s | speedup | acceptance | tokens/pass | same output |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        extra = (
            f"{r['speedup']:.2f}x | {r['acceptance']:.0%} | {r['tokens_per_pass']:.2f} | {r['same_output']}"
            if "speedup" in r
            else "1.00x | | 1.00 |"
        )
        out.append(
            f"| {r['model']} | {r['threads']} | {r['test']} | {r['tokens_per_s']:.2f} ± {r['std']:.2f} | {extra} |"
        )
    return "\n".join(out)
