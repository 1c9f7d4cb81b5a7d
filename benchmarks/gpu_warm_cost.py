"""What a server's sampler warm-up (`generate/reductions.warm`) costs, from an empty Triton cache and a full one.

    python benchmarks/gpu_warm_cost.py [--max-batch 32] [--vocab 128256] [--topk 16,32,40,64,128,256]

Two fresh processes share one new TRITON_CACHE_DIR: the first compiles every kernel, the second loads them from
disk. Each times, in seconds, `warm` over logits [max batch, vocab] without a top-k class (the argmax + logsumexp
pass for every batch 1..max batch), then one top-k class at a time (its draw's four flag variants; classes are the
power of 2 >= k, at least 16, so 40 after 32 is 64's class: compiled then, cached after). Prints a markdown table
naming the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _child(args) -> None:
    """One process's timings, as a JSON line: [(part, seconds)]."""
    import torch

    from bitnetlm.sampling import reductions

    x = torch.zeros(args.max_batch, args.vocab, device="cuda")  # [B, V] float32, as the engine's logits
    rows = []

    def timed(part, fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        rows.append((part, time.perf_counter() - t))

    timed(f"argmax + logsumexp, batches 1..{args.max_batch}", lambda: reductions.warm(x, kmaxes=()))
    for k in (int(s) for s in args.topk.split(",")):
        # (batch 1's argmax is compiled by now: what this adds is the draw's)
        timed(f"draw, top-k {k} (4 variants)", lambda k=k: reductions.warm(x[:1], kmaxes=(k,)))
    print(json.dumps(rows))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--topk", default="16,32,40,64,128,256")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    runs = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        for _ in ("empty", "full"):
            out = subprocess.run(
                [sys.executable, __file__, "--child", *(argv if argv is not None else sys.argv[1:])],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
    import torch

    from bitnetlm.bench import cpu_model_name

    print("\n### reductions.warm: seconds, from an empty Triton cache and from the full one it left\n")
    print(
        f"machine: {torch.cuda.get_device_name(0)}, {cpu_model_name()}; logits [{args.max_batch}, {args.vocab}]\n"
    )
    print("| part | empty cache s | full cache s |")
    print("|---|---:|---:|")
    for (part, cold), (_, warm) in zip(*runs, strict=True):
        print(f"| {part} | {cold:.2f} | {warm:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
