#!/usr/bin/env python3
"""How far the CPU reference agrees with itself on the zoo's models: the bound tests/test_gpu_zoo.py sets its
teacher-forced checks by.

For each model and each of the test's prompts, the reference backend (float32) decodes N greedy tokens through
its KV cache; its own uncached forward over prompt + those tokens then ranks each token (0 = its argmax), and
the gap between its top two logits is taken at every position. Two paths of one float32 model differ only in
summation order, yet one flipped int8 activation code moves later logits, so a model whose top logits lie close
(smollm2-135m-1.58 with the test's random embedding, tests/zoo_parts.py) is not token-exact against itself.

    python benchmarks/zoo_reference_ranks.py [--tokens 64]

Runs on the CPU; prints a markdown table naming the machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    from oracle import greedy_with_cache
    from zoo_parts import TEXTS, smollm2_random_embedding, teacher_forced

    from bitnetlm import zoo
    from bitnetlm.bench import machine_name
    from bitnetlm.loading import load_model
    from bitnetlm.text.tokenizer import Tokenizer

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    tmp = tempfile.TemporaryDirectory()
    dirs = {
        "bitnet-tiny": zoo.resolve("bitnet-tiny"),
        "smollm2-135m-1.58 (random embedding)": str(smollm2_random_embedding(tmp.name)),
    }
    print(f"machine: {machine_name()}; reference backend, float32, {args.tokens} greedy tokens a prompt\n")
    print("| model | prompt | worst rank | ranked first | smallest top-2 gap | median top-2 gap |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, d in dirs.items():
        model = load_model(d, device="cpu", backend="reference").eval()
        tok = Tokenizer.from_dir(d)
        for i, text in enumerate(TEXTS):
            p = tok.encode(text)
            got = greedy_with_cache(model, torch.tensor([p]), args.tokens)[0]
            logits, rank = teacher_forced(model, p, got)  # [N, V], [N]
            top2 = logits.topk(2, dim=1).values
            gap = top2[:, 0] - top2[:, 1]
            print(
                f"| {name} | {i} | {int(rank.max())} | {int((rank == 0).sum())} of {len(rank)} | "
                f"{gap.min():.4f} | {gap.median():.4f} |"
            )
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
