#!/usr/bin/env python3
"""Time from `bitnetlm.load(name)` to the first generated token of a zoo model, in a fresh process.

Prints a markdown table naming the machine. Usage: python benchmarks/zoo_first_token.py [--model bitnet-tiny] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CASE = """
import json, time
t0 = time.perf_counter()
import torch, bitnetlm
from bitnetlm.kernels import configure_threads
t1 = time.perf_counter()
model, tok = bitnetlm.load({model!r})
configure_threads(model, {threads})
t2 = time.perf_counter()
for _ in bitnetlm.stream_generate(model, tok, "Once upon a time", max_tokens=1, temperature=0):
    pass
t3 = time.perf_counter()
print(json.dumps({{"import_s": t1 - t0, "load_s": t2 - t1, "first_token_s": t3 - t2}}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bitnet-tiny")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    rows = []
    for _ in range(a.runs):
        out = subprocess.run(
            [sys.executable, "-c", CASE.format(model=a.model, threads=a.threads)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    from bitnetlm.bench import cpu_model_name

    cpu = cpu_model_name()
    print(f"\n{a.model} on {cpu}, {a.threads} threads, fresh process per run\n")
    print("| run | import torch+bitnetlm s | load s | first token s | load + first token s |")
    print("|---|---:|---:|---:|---:|")
    for i, r in enumerate(rows, 1):
        print(
            f"| {i} | {r['import_s']:.2f} | {r['load_s']:.2f} | {r['first_token_s']:.3f} | "
            f"{r['load_s'] + r['first_token_s']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
