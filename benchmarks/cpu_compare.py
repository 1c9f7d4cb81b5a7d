#!/usr/bin/env python3
"""A/B of two checkouts' CPU speed on a noisy machine: alternating processes, the same shapes, one table.

    git worktree add /tmp/base <rev> && (cd /tmp/base && python setup.py build_ext --inplace)
    python benchmarks/cpu_compare.py --baseline /tmp/base --shapes 2b4t --heads bf16,int8 --rounds 3

Each round runs one process per tree (baseline first in odd rounds, this tree first in even ones), so both see
the same stretch of the shared VM's load; each process builds the random model (bench.random_model, real packed
layout), then times `--pp`-token prefills and `--tg`-token greedy decodes from an empty cache with `bitnet
bench`'s timers. The table gives the
median over every run of each tree and the ratio this tree / baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def worker(root: str, shape: str, head: str, pp: int, tg: int, reps: int, threads: int) -> dict:
    sys.path.insert(0, root)
    import torch

    from bitnetlm import bench
    from bitnetlm.kernels import cpu

    if not bench.__file__.startswith(root):
        raise SystemExit(f"cpu_compare: imported bitnetlm from {bench.__file__}, expected it under {root}")
    cpu.set_num_threads(threads)
    torch.set_num_threads(1)
    model = bench.random_model(shape, head_dtype=head)
    gen, dev, vocab = torch.Generator().manual_seed(1), torch.device("cpu"), model.config.vocab_size
    # the same timed prefill / greedy decode as `bitnet bench` (bench.time_prefill / time_decode)
    return {
        "pp": [pp / bench.time_prefill(model, pp, dev, vocab, gen) for _ in range(reps)],
        "tg": [tg / bench.time_decode(model, tg, dev, vocab, gen) for _ in range(reps)],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="another checkout with its C extension built in place")
    ap.add_argument("--shapes", default="2b4t")
    ap.add_argument("--heads", default="bf16,int8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3, help="prefills and decodes per process")
    ap.add_argument("--pp", type=int, default=128)
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", nargs=3, metavar=("ROOT", "SHAPE", "HEAD"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(*a.worker, a.pp, a.tg, a.reps, a.threads)))
        return 0
    trees = {"baseline": str(Path(a.baseline).resolve()), "this tree": str(HERE)}
    sys.path.insert(0, str(HERE))
    from bitnetlm import bench

    print(
        f"machine: {bench.machine_name()}; load average at start {os.getloadavg()[0]:.1f}; {a.threads} threads"
    )
    print(f"baseline: {trees['baseline']}\n")
    print("| shape | head | test | baseline t/s (median) | this tree t/s (median) | ratio | runs each |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for shape in a.shapes.split(","):
        for head in a.heads.split(","):
            got = {k: {"pp": [], "tg": []} for k in trees}
            for r in range(a.rounds):
                order = list(trees) if r % 2 == 0 else list(reversed(trees))
                for name in order:
                    cmd = [
                        sys.executable,
                        __file__,
                        "--baseline",
                        a.baseline,
                        "--worker",
                        trees[name],
                        shape,
                        head,
                    ]
                    cmd += [
                        "--pp",
                        str(a.pp),
                        "--tg",
                        str(a.tg),
                        "--reps",
                        str(a.reps),
                        "--threads",
                        str(a.threads),
                    ]
                    res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
                    for k in ("pp", "tg"):
                        got[name][k] += res[k]
            for k, label in (("pp", f"pp{a.pp}"), ("tg", f"tg{a.tg}")):
                b, t = statistics.median(got["baseline"][k]), statistics.median(got["this tree"][k])
                n = len(got["this tree"][k])
                print(f"| {shape} | {head} | {label} | {b:.2f} | {t:.2f} | {t / b:.2f}x | {n} |", flush=True)
    print(f"\nload average at end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
