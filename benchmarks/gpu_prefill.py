"""Prefill of one prompt on the GPU (device machine): the captured prefill's replay time by prompt length, and
with -m the serving engine's time to first token, in process (no HTTP).

    python benchmarks/gpu_prefill.py [--lengths 1,20,49,64,100,128,200,256,512] [--head int8] [--kv-cache-dtype fp8]
    python benchmarks/gpu_prefill.py -m DIR [--requests 16] [--max-tokens 64]

The replay table: `CudaEngine.prefill` of a prompt of each length into row 0 (one graph replay per padded length,
`engine_cuda.prefill_len`), 2B4T shape, random weights in the real packed layout; mean of --reps replays after 3
warm-up ones, to a CUDA sync.
-m DIR (a checkpoint with its tokenizer, e.g. benchmarks/make_checkpoint.py's with the LLaMA-3 tokenizer copied in):
`serve.Engine` over it, one greedy request at a time (48-word prompts, as benchmarks/serve_load.py sends, and
ignore_eos): p50 time from `submit` to the first chunk and to the last, for --max-tokens and for 1 token.
Prints markdown naming the GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORDS = "the quick brown fox jumps over the lazy dog while a single man in possession of a fortune".split()


def replay_ms(eng, ids: list[int], reps: int) -> float:
    for _ in range(3):
        eng.prefill(ids, 0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        eng.prefill(ids, 0)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def replay_table(args) -> None:
    from bitnetlm.runtime.cuda.bench import random_engine
    from bitnetlm.runtime.cuda.engine import prefill_len

    lengths = [int(x) for x in args.lengths.split(",")]
    eng = random_engine(8, max(4096, 2 * max(lengths)), head=args.head, kv_cache_dtype=args.kv_cache_dtype)
    print(f"\nprefill replay, 2B4T shape, random weights, head {args.head}, KV cache {args.kv_cache_dtype}\n")
    print("| tokens | padded to | ms | tok/s |\n| ---: | ---: | ---: | ---: |")
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for n in lengths:
            ids = torch.randint(100, 100_000, (n,), generator=g).tolist()
            ms = replay_ms(eng, ids, args.reps)
            print(f"| {n} | {prefill_len(n)} | {ms:.3f} | {n / ms * 1e3:,.0f} |", flush=True)


def request_ms(engine, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(ms to the first chunk, ms to Finished) of one greedy request."""
    from bitnetlm.sampling.sampler import SamplingParams
    from bitnetlm.serve.requests import Chunk, Finished, GenerationRequest

    done, first = threading.Event(), []

    def sink(ev):
        if isinstance(ev, Chunk) and not first:
            first.append(time.perf_counter())
        elif isinstance(ev, Finished):
            done.set()

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    engine.submit(GenerationRequest(prompt, params), sink)
    done.wait()
    return (first[0] - t0) * 1e3, (time.perf_counter() - t0) * 1e3


def engine_table(args) -> None:
    from bitnetlm.commands.generate import load_model_and_tokenizer
    from bitnetlm.serve.engine import Engine, EngineConfig

    kv = None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    model, tok = load_model_and_tokenizer(
        args.model, device="cuda", head_dtype=None if args.head == "fp" else args.head, kv_cache_dtype=kv
    )
    engine = Engine(model, tok, EngineConfig(max_batch=32, max_model_len=4096))
    prompts = [tok.encode(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(48))) for i in range(64)]
    print(f"\nserve.Engine in process, {args.model}, 1 request at a time, {len(prompts[0])}-token prompts\n")
    print(
        "| completion tokens | first chunk p50 ms | request p50 ms | tok/s |\n| ---: | ---: | ---: | ---: |"
    )
    try:
        for n in (4, args.max_tokens, 1):  # (4: a warm-up row)
            runs = [request_ms(engine, prompts[i % 64], n) for i in range(args.requests)]
            ttft = statistics.median(r[0] for r in runs)
            e2e = statistics.median(r[1] for r in runs)
            print(f"| {n} | {ttft:.2f} | {e2e:.2f} | {n / e2e * 1e3:,.1f} |", flush=True)
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1,20,49,64,100,128,200,256,512")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--head", default="int8", help="LM head: fp (bf16) or int8")
    ap.add_argument("--kv-cache-dtype", default="fp8", help="auto (bf16) or fp8")
    ap.add_argument("-m", "--model", default=None, help="a checkpoint with its tokenizer: the engine table")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    from bitnetlm.bench import cpu_model_name
    from bitnetlm.runtime.cuda.bench import gpu_name

    print(f"GPU: {gpu_name()}; host {cpu_model_name()}")
    replay_table(args)
    if args.model:
        engine_table(args)


if __name__ == "__main__":
    main()
