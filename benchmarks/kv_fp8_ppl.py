"""Perplexity cost of the float8 (e4m3, unscaled) KV cache (`--kv-cache-dtype fp8`), on a real pretrained model.

    python benchmarks/kv_fp8_ppl.py [--model .assets/smollm2-gguf/SmolLM2-135M-Instruct.Q4_1.gguf]

Each 512-token window of held-out text (the last 4096 tokens of each Austen novel) runs through the model's own
forward with a KV cache, so every query attends over the keys and values as the cache stores them: in the
activations' dtype (the default) or rounded to float8_e4m3fn, the rounding the CUDA engine's cache applies (its
kernels store the same float8 bytes: tests/test_kv_fp8.py). Runs on the CPU in float32.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_int8_head_ppl import model_and_heldout, ppl, report

    args, model, ids = model_and_heldout(__doc__.splitlines()[0])
    rows = []
    for name, dtype in (
        ("float32 (auto)", None),
        ("bfloat16", torch.bfloat16),
        ("fp8 (e4m3)", torch.float8_e4m3fn),
    ):
        model.kv_cache_dtype = dtype
        rows.append((name, ppl(model, ids, cached=True)))
    report(args, ids, "KV cache", rows, ", float32 activations")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
