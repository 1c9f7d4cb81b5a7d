"""The library's own CPU generation loop (`bitnetlm.generate`) on a real-shape model with random weights: decode
tokens/s with torch's ops on one thread beside the C kernels (`kernels.torch_threads_beside_c`, what
`generate` does) against torch left at the caller's thread count, in alternating rounds.

    python benchmarks/cpu_generate.py [--shape 2b4t] [--head int8] [--threads 2] [--tokens 48] [--rounds 3]

Needs the LLaMA-3 tokenizer asset (.assets/llama3-tokenizer, `python scripts/fetch_assets.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bitnetlm import bench  # noqa: E402
from bitnetlm.generate import Tokenizer, generate  # noqa: E402
from bitnetlm.kernels import cpu  # noqa: E402

GEN = sys.modules["bitnetlm.generate.generate"]  # the module (the package exports the function `generate`)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="2b4t")
    ap.add_argument("--head", default="int8")
    ap.add_argument(
        "--threads", type=int, default=2, help="kernel threads, and torch's count when not scoped"
    )
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokenizer", default=".assets/llama3-tokenizer")
    a = ap.parse_args()
    model = bench.random_model(a.shape, head_dtype=a.head)
    tok = Tokenizer.from_dir(a.tokenizer)
    cpu.set_num_threads(a.threads)
    torch.set_num_threads(a.threads)
    scoped = GEN.torch_threads_beside_c
    variants = {
        "torch on 1 thread beside the kernels (generate's default)": scoped,
        f"torch on {a.threads} threads (the caller's count)": lambda m: contextlib.nullcontext(),
    }

    def tps() -> float:
        r = generate(model, tok, "Once upon a time", max_tokens=a.tokens, temperature=0, ignore_eos=True)
        return r.generation_tps

    tps()  # warm-up
    print(
        f"machine: {bench.machine_name()}; {a.shape}, {a.head} head, {a.threads} kernel threads, tg{a.tokens}\n"
    )
    print("| round | variant | decode tok/s |\n| ---: | --- | ---: |")
    try:
        for rnd in range(a.rounds):
            for name, fn in variants.items():
                GEN.torch_threads_beside_c = fn
                print(f"| {rnd + 1} | {name} | {tps():.2f} |", flush=True)
    finally:
        GEN.torch_threads_beside_c = scoped
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
