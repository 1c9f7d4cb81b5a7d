"""The samplers' reductions over a vocabulary on the GPU: PyTorch's ops against `generate/reductions.py`'s wide ones.

    python benchmarks/gpu_sampler.py [--batches 1,8,32] [--vocab 128256]

Times, in us a call, replayed back to back from CUDA graphs as the samplers run: argmax, log_softmax against
logsumexp + argmax, and the whole captured sampler (`GraphSampler`, its own graph, no top log-probabilities) of
greedy rows and of llama.cpp's default sampler (t0.8 k40 p.95 minp.05), each built with `reductions.WIDE` off
(PyTorch's ops) and on. float32 logits, random. Prints a markdown table naming the GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_attention import _graph_us  # noqa: E402  (us a call, captured once, replayed; best of 3)
from bitnetlm.runtime.cuda.bench import _events_ms  # noqa: E402
from bitnetlm.runtime.cuda.graph_sampler import GraphSampler  # noqa: E402
from bitnetlm.sampling import reductions  # noqa: E402
from bitnetlm.sampling.sampler import RowRandom, SamplingParams, row_tensors  # noqa: E402

STEPS, CALLS = 20, 10
KINDS = {
    "greedy": SamplingParams(temperature=0),
    "llama.cpp defaults": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=0),
}


def op_rows(x: torch.Tensor) -> list[tuple[str, float, float]]:
    """(op, PyTorch us, wide us) a call over logits x."""
    ops = [
        ("argmax", lambda: x.argmax(dim=-1), lambda: reductions.argmax(x)),
        (
            "log-probabilities' normalizer (log_softmax / logsumexp + argmax)",
            lambda: torch.log_softmax(x, dim=-1),
            lambda: reductions.argmax_logsumexp(x),
        ),
    ]
    rows = []
    for name, base, wide in ops:
        us = [_graph_us(lambda f=f: [f() for _ in range(CALLS)], STEPS, CALLS) for f in (base, wide)]
        rows.append((name, *us))
    return rows


def sampler_us(x: torch.Tensor, p: SamplingParams, wide: bool) -> float:
    reductions.WIDE = wide
    try:
        b, v = x.shape
        nxt = torch.zeros((b, 1), dtype=torch.long, device=x.device)
        t = row_tensors([p] * b, v, x.device)
        gs = GraphSampler(x, nxt, t, top_n=0, cap=4096, bias=False)
        gens = [RowRandom(p.make_generator(x.device), x.device) for _ in range(b)]
        gs.load(t, [p] * b, gens, [4096] * b)
        n = STEPS * CALLS
        gs.run()  # (its own graph: replayed back to back, not captured again)
        return min(_events_ms(lambda: [gs.run() for _ in range(n)], 3)) * 1e3 / n
    finally:
        reductions.WIDE = True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--vocab", type=int, default=128256)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for b in [int(s) for s in a.batches.split(",")]:
        x = torch.randn(b, a.vocab, device="cuda", generator=g) * 3
        rows += [(b, *r) for r in op_rows(x)]
        rows += [
            (b, f"sampler graph, {k}", sampler_us(x, p, False), sampler_us(x, p, True))
            for k, p in KINDS.items()
        ]
    prop = torch.cuda.get_device_properties(0)
    print(
        f"GPU: {prop.name} ({prop.multi_processor_count} SMs), torch {torch.__version__}; vocabulary {a.vocab}\n"
    )
    print("| batch | op | PyTorch us | wide us | ratio |\n| ---: | --- | ---: | ---: | ---: |")
    for b, name, base, wide in rows:
        print(f"| {b} | {name} | {base:.1f} | {wide:.1f} | {base / wide:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
