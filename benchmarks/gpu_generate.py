"""What a user of `bitnetlm.generate` / `bitnet generate --device cuda` gets on the GPU: the CUDA-graph path
(generate/graph.py) against the model's eager forward (`enforce_eager=True`), in the same process.

A 2B4T-shaped packed HF checkpoint (random weights, the real offline-packed format, written by
benchmarks/make_checkpoint.py if absent) is loaded in bf16 and generates from a random prompt with the real
LLaMA-3 tokenizer (`.assets/llama3-tokenizer`): greedy and llama.cpp's default sampler, one prompt, and a batch
of prompts of different lengths. Random weights: speed only, never quality.

    python benchmarks/gpu_generate.py [--dir DIR] [--prompt 128] [--tokens 256] [--batch 8]
        [--head-dtype int8] [--kv-cache-dtype fp8] [--eager-tokens 0 (no eager rows)] [--host-sampler]

--host-sampler: the CUDA-graph rows sample on the host (`generate.graph.GRAPH_SAMPLER = False`, the path before
stop 51) instead of in their captured sampler graph; run both in alternating processes for an A/B.

Prints a markdown table naming the GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bitnetlm.generate import SamplingParams, Tokenizer, batch_generate, generate  # noqa: E402
from bitnetlm.loading import load_model  # noqa: E402

SAMPLERS = {
    "greedy": dict(temperature=0),
    "llama.cpp defaults (t0.8 k40 p.95 minp.05)": dict(
        temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=0
    ),
}


def run(model, tok, prompts, n_new, sampler, eager) -> tuple[float, float, float]:
    """(decode tok/s of the first row, total generated tok/s incl. prefill, TTFT ms) of one call."""
    p = SamplingParams(max_tokens=n_new, ignore_eos=True, **SAMPLERS[sampler])
    torch.cuda.synchronize()
    t = time.perf_counter()
    if len(prompts) == 1:
        res = [generate(model, tok, prompts[0], p, enforce_eager=eager)]
    else:
        res = batch_generate(model, tok, prompts, p, enforce_eager=eager)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    return res[0].generation_tps, sum(r.generation_tokens for r in res) / dt, res[0].ttft_s * 1e3


def weight_gb(model) -> float:
    """GB of GPU memory holding weights: the model's parameters and buffers and its CUDA-graph engine's weights
    (generate/graph.py caches the engine on the model), each storage counted once."""
    from bitnetlm.generate.graph import _ATTR

    ts = list(model.parameters()) + list(model.buffers())
    eng = model.__dict__.get(_ATTR, (None,))[0]
    if eng is not None:
        ts += [t for L in eng.layers for t in vars(L).values() if isinstance(t, torch.Tensor)]
        extra = ("embed", "head", "embed_q", "embed_s", "head_q", "head_s", "final_norm")
        ts += [t for t in (getattr(eng, n, None) for n in extra) if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts if t.is_cuda}
    return sum(storages.values()) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=os.path.join(ROOT, ".assets", "bench-2b4t"))
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, ".assets", "llama3-tokenizer"))
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument(
        "--eager-tokens", type=int, default=32, help="decode steps of the (slow) eager rows (0: none)"
    )
    ap.add_argument("--head-dtype", default=None, help="int8: the engine's int8 LM head, as --head-dtype")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16) or fp8, as --kv-cache-dtype")
    ap.add_argument("--host-sampler", action="store_true", help="the CUDA-graph rows sample on the host")
    a = ap.parse_args()
    if a.host_sampler:
        from bitnetlm.generate import graph as graph_mod

        graph_mod.GRAPH_SAMPLER = False
    from make_checkpoint import write_checkpoint

    from bitnetlm.models.cache import parse_kv_cache_dtype

    write_checkpoint(a.dir, "2b4t")
    model = load_model(a.dir, device="cuda", dtype=torch.bfloat16, head_dtype=a.head_dtype).eval()
    model.kv_cache_dtype = parse_kv_cache_dtype(a.kv_cache_dtype)
    tok = Tokenizer.from_dir(a.tokenizer)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def ids(n):
        return torch.randint(1000, min(vocab, 100000), (n,), generator=g).tolist()

    single = [ids(a.prompt)]
    batch = [ids(a.prompt - 8 * i) for i in range(a.batch)]  # different lengths
    rows = []
    mem = {"after load": weight_gb(model)}
    for eager in (False, True) if a.eager_tokens else (False,):
        n_new = a.eager_tokens if eager else a.tokens
        for sampler in SAMPLERS:  # warm-up: compilation (each sampler's kernels too), tuning, graph capture
            run(model, tok, single, 4, sampler, eager)
            run(model, tok, batch, 4, sampler, eager)
        if not eager:
            mem["after the first CUDA-graph generate (model + engine)"] = weight_gb(model)
        for sampler in SAMPLERS:
            for name, prompts in (("1 prompt", single), (f"{a.batch} prompts", batch)):
                tps, total, ttft = run(model, tok, prompts, n_new, sampler, eager)
                path = "eager forward (enforce_eager)" if eager else "CUDA graph (default)"
                if a.host_sampler and not eager:
                    path = "CUDA graph, host sampler"
                rows.append((path, name, sampler, n_new, ttft, tps, total))
    p = torch.cuda.get_device_properties(0)
    print(
        f"GPU: {p.name} ({p.multi_processor_count} SMs), torch {torch.__version__}; 2B4T shape, random ternary "
        f"weights, bf16, head {a.head_dtype or 'bf16'}, KV cache {a.kv_cache_dtype}; prompt {a.prompt} tokens "
        f"(batch rows {a.prompt - 8 * (a.batch - 1)}-{a.prompt})\n"
    )
    print(
        "| path | prompts | sampler | tokens | TTFT ms | decode tok/s (row 0) | generated tok/s (all rows) |"
    )
    print("|---|---|---|---:|---:|---:|---:|")
    for path, name, sampler, n, ttft, tps, total in rows:
        print(f"| {path} | {name} | {sampler} | {n} | {ttft:.1f} | {tps:,.1f} | {total:,.1f} |")
    print("\n| GPU memory holding weights | GB |\n|---|---:|")
    for what, gb in mem.items():
        print(f"| {what} | {gb:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
