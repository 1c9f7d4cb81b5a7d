"""Generation overheads and throughput: sampler cost per step at the LLaMA-3 vocabulary, and end-to-end
decode tokens/s (single stream and batched) on a small random BitNet model with the real tokenizer.

    python benchmarks/bench_generate.py [--device cpu|cuda] [--backend reference] [--hidden 512 --layers 4]

Prints markdown tables naming the machine. Random weights: speed only, never quality.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bitnetlm.generate import SamplingParams, Tokenizer, batch_generate, generate, sample  # noqa: E402
from bitnetlm.kernels import prepare  # noqa: E402
from bitnetlm.models import ModelConfig, build_model  # noqa: E402
from bitnetlm.quant import to_inference_  # noqa: E402


def machine(device: str) -> str:
    cpu = platform.processor() or platform.machine()
    s = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
    if device.startswith("cuda"):
        s += f", {torch.cuda.get_device_name()}"
    return s


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_sampler(device: str, vocab: int = 128256, reps: int = 30):
    rows = []
    settings = {
        "greedy": SamplingParams(temperature=0),
        "temperature 0.8": SamplingParams(temperature=0.8),
        "top-k 40": SamplingParams(temperature=0.8, top_k=40),
        "top-p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
        "llama.cpp defaults (k40 p.95 minp.05)": SamplingParams(
            temperature=0.8, top_k=40, top_p=0.95, min_p=0.05
        ),
        "+ repetition 1.1, presence 0.5": SamplingParams(
            temperature=0.8, top_k=40, repetition_penalty=1.1, presence_penalty=0.5
        ),
    }
    for b in (1, 16):
        flat = torch.randn(b, vocab, device=device) * 3  # top-p 0.95 keeps ~100k tokens: full-sort fallback
        peaked = torch.randn(b, vocab, device=device) * 8  # top-p 0.95 keeps < 256 tokens, like a trained LM
        hist = [list(range(i, i + 200)) for i in range(b)]
        cases = [(name, p, flat) for name, p in settings.items()]
        cases += [("top-p 0.95, peaked logits", SamplingParams(temperature=0.8, top_p=0.95), peaked)]
        for name, p, logits in cases:
            gens = [SamplingParams(seed=i).make_generator(device) for i in range(b)]
            for _ in range(3):
                sample(logits, [p] * b, gens, hist, hist)
            sync(device)
            t = time.perf_counter()
            for _ in range(reps):
                sample(logits, [p] * b, gens, hist, hist)
            sync(device)
            rows.append((b, name, (time.perf_counter() - t) / reps * 1000))
    print(
        f"\n### sampler cost per decode step, vocab {vocab}, N(0, 3^2) logits unless noted, {device} ({machine(device)})\n"
    )
    print("| batch | sampling | ms / step |\n|---|---|---|")
    for b, name, ms in rows:
        print(f"| {b} | {name} | {ms:.3f} |")


def bench_generate(device, backend, hidden, layers, tok, n_new=64):
    heads = max(hidden // 64, 1)
    cfg = ModelConfig(
        arch="bitnet", vocab_size=128256, hidden_size=hidden, intermediate_size=hidden * 27 // 10,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1),
        max_position_embeddings=2048, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    m = build_model(cfg, "train")
    m = prepare(to_inference_(m).eval(), device, backend)
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    p = SamplingParams(max_tokens=n_new, temperature=0.8, top_k=40, top_p=0.95, seed=0, ignore_eos=True)
    generate(m, tok, prompt, p.__class__(max_tokens=4, ignore_eos=True))  # warm-up
    r = generate(m, tok, prompt, p)
    rows = [("single stream", 1, r.prompt_tokens, r.ttft_s * 1000, r.generation_tps, r.generation_tps)]
    for b in (4, 16):
        prompts = [prompt[: 40 + 17 * i] for i in range(b)]  # different lengths: padding in play
        sync(device)
        t = time.perf_counter()
        res = batch_generate(m, tok, prompts, p)
        sync(device)
        dt = time.perf_counter() - t
        total = sum(x.generation_tokens for x in res)
        rows.append((f"batch_generate {b}", b, sum(x.prompt_tokens for x in res), res[0].ttft_s * 1000,
                     res[0].generation_tps, total / dt))  # fmt: skip
    print(
        f"\n### decode, random BitNet hidden {hidden}, {layers} layers, vocab 128256, backend "
        f"{backend or 'default'}, {device} ({machine(device)})\n"
    )
    print("| run | rows | prompt tokens | TTFT ms | decode tok/s per row | total tok/s (incl. prefill) |")
    print("|---|---|---|---|---|---|")
    for name, b, pt, ttft, tps, tot in rows:
        print(f"| {name} | {b} | {pt} | {ttft:.1f} | {tps:.1f} | {tot:.1f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tokenizer", default=str(ROOT / ".assets" / "llama3-tokenizer"))
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    tok = Tokenizer.from_dir(a.tokenizer)
    with torch.inference_mode():
        bench_sampler(a.device)
    bench_generate(a.device, a.backend, a.hidden, a.layers, tok)


if __name__ == "__main__":
    main()
