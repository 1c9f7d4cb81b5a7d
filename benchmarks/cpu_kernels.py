#!/usr/bin/env python3
"""Kernel-level speed of the C ternary kernels per instruction-set path: GEMV (decode) weight GB/s and
GEMM (prefill) GMAC/s on the 2B4T projection shapes, next to a STREAM-like copy. Markdown table.

    python benchmarks/cpu_kernels.py --threads 1,2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bitnetlm import bench  # noqa: E402
from bitnetlm.kernels import cpu  # noqa: E402
from bitnetlm.kernels.cpu import ops  # noqa: E402

# one 2B4T layer: q, k, v, o, gate, up, down
LAYER = [(2560, 2560), (640, 2560), (640, 2560), (2560, 2560), (6912, 2560), (6912, 2560), (2560, 6912)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument(
        "--layers", type=int, default=8, help="distinct layers (8 x 17 MB: larger than the caches)"
    )
    ap.add_argument("--m", default="1,128", help="tokens per call")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cpu_decode import copy_bandwidth

    gen = torch.Generator().manual_seed(0)
    mats = [(bench.random_packed(n, k, cpu.BACKEND, gen), n, k) for _ in range(a.layers) for n, k in LAYER]
    nbytes = sum(p.numel() for p, _, _ in mats)
    macs = sum(n * k for _, n, k in mats)
    s = torch.tensor([1.0])
    print(
        f"machine: {bench.machine_name()}; load average {os.getloadavg()[0]:.1f}; {nbytes / 1e6:.0f} MB of weights\n"
    )
    print("| isa | threads | tokens | ms/pass | weight GB/s | GMAC/s | copy GB/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for nt in [int(t) for t in a.threads.split(",")]:
        bw = copy_bandwidth(nt)
        cpu.set_num_threads(nt)
        for isa in reversed(cpu.supported_isas()):
            for m in [int(v) for v in a.m.split(",")]:
                if isa == "scalar" and m > 1:
                    continue  # minutes per pass
                xs = {k: torch.randn(m, k, generator=gen) for k in (2560, 6912)}
                with cpu.use_isa(isa):
                    best = float("inf")
                    for _ in range(a.reps):
                        t0 = time.perf_counter()
                        for p, n, k in mats:
                            ops.ternary_linear(xs[k], p, s, n)
                        best = min(best, time.perf_counter() - t0)
                print(
                    f"| {isa} | {nt} | {m} | {best * 1e3:.1f} | {nbytes / best / 1e9:.2f} | "
                    f"{m * macs / best / 1e9:.1f} | {bw:.1f} |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
