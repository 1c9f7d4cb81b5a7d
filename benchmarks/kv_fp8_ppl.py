"""Perplexity cost of the float8 (e4m3, unscaled) KV cache (`--kv-cache-dtype fp8`), on a real pretrained model.

    python benchmarks/kv_fp8_ppl.py [--model .assets/smollm2-gguf/SmolLM2-135M-Instruct.Q4_1.gguf]

Each 512-token window of held-out text (the last 4096 tokens of each Austen novel) runs through the model's own
forward with a KV cache, so every query attends over the keys and values as the cache stores them: in the
activations' dtype (the default) or rounded to float8_e4m3fn, the rounding the CUDA engine's cache applies (its
kernels store the same float8 bytes: tests/test_kv_fp8.py). Runs on the CPU in float32.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@torch.no_grad()
def ppl_cached(model, ids: torch.Tensor, ctx: int = 512) -> float:
    nll, n = 0.0, 0
    for i in range(0, ids.numel() - 1, ctx):
        x = ids[i : i + ctx + 1]
        if x.numel() < 2:
            break
        cache = model.new_cache(1, x.numel())
        logits = model(x[None, :-1], positions=torch.arange(x.numel() - 1)[None], cache=cache)[0].float()
        nll += torch.nn.functional.cross_entropy(logits, x[1:], reduction="sum").item()
        n += x.numel() - 1
    return math.exp(nll / n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=".assets/smollm2-gguf/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--tokenizer", default=".assets/carry/teacher_tok", help="directory with tokenizer.json")
    ap.add_argument("--texts", default=".assets/austen")
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens per novel (the last ones)")
    args = ap.parse_args()
    from bitnetlm.generate.tokenizer import Tokenizer
    from bitnetlm.loading import load_model

    model = load_model(args.model).eval()
    tok = Tokenizer.from_dir(args.tokenizer)
    ids = []
    for f in sorted(os.listdir(args.texts)):
        t = tok.encode(open(os.path.join(args.texts, f), encoding="utf-8").read())
        ids.append(torch.tensor(t[-args.tokens :]))
    ids = torch.cat(ids)
    rows = []
    for name, dtype in (
        ("float32 (auto)", None),
        ("bfloat16", torch.bfloat16),
        ("fp8 (e4m3)", torch.float8_e4m3fn),
    ):
        model.kv_cache_dtype = dtype
        rows.append((name, ppl_cached(model, ids)))
    print(
        f"model: {args.model} (real pretrained weights); text: last {args.tokens} tokens of each of "
        f"{len(os.listdir(args.texts))} Austen novels ({ids.numel()} tokens), context 512, float32 activations\n"
    )
    print("| KV cache | perplexity | vs float32 |\n| --- | ---: | ---: |")
    for name, v in rows:
        print(f"| {name} | {v:.3f} | {100 * (v / rows[0][1] - 1):+.2f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
