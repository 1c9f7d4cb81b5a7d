"""A/B of two checkouts' decode step on the GPU: alternating processes, one table.

    python benchmarks/gpu_compare.py --baseline DIR [--rounds 2] [gpu_profile.py options, e.g. --batches 64
        --head int8 --kv-cache-dtype fp8 --variants ';attn_bs=32']

A kernel's speed can move with its code layout alone: a refactor that changed nothing the attention computes
changed its registers (142 -> 128) and a batch-64 step by 6% (docs/PERF_LOG.md, 2026-11-28). So a change is timed
against the baseline's own package, not only against a switch inside the new one (the GPU twin of
`cpu_compare.py`). DIR holds the baseline's `bitnetlm/` and `benchmarks/` (a plain copy: no git history needed
on the GPU machine), e.g. `mkdir -p .scratch/base && git archive main bitnetlm benchmarks | tar -x -C
.scratch/base`. Each round runs `benchmarks/gpu_profile.py` once in
each tree (the baseline first in odd rounds, this tree first in even ones); every process tunes on its own (the
tune cache is keyed by each package's source). Prints each timed line's ms/step a round and the ratio of the
medians, this tree / baseline. `--variants` (`DecodePlan` fields) must be understood by both packages'
gpu_profile.py.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"^(batch .*): ([0-9.]+) ms/step$")


def profile(tree: str, args: list[str]) -> dict[str, float]:
    """ms/step of every timed line of one gpu_profile.py run in `tree` (its own package on the path)."""
    cmd = [sys.executable, os.path.join(tree, "benchmarks", "gpu_profile.py"), *args]
    res = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"gpu_profile.py failed in {tree} (exit {res.returncode}):\n{res.stderr[-3000:]}")
    return {m[1]: float(m[2]) for m in map(LINE.match, res.stdout.splitlines()) if m}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--baseline", required=True, help="a tree with the baseline's bitnetlm/ and benchmarks/")
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="processes per package, alternating (gpu_profile.py's own --rounds is not passed through)",
    )
    args, rest = ap.parse_known_args()
    if not os.path.isfile(os.path.join(args.baseline, "benchmarks", "gpu_profile.py")):
        raise SystemExit(
            f"--baseline {args.baseline}: no benchmarks/gpu_profile.py there (expected a package tree)"
        )
    sys.path.insert(0, HERE)
    from bitnetlm.runtime.cuda.bench import gpu_name

    trees = {"base": os.path.abspath(args.baseline), "new": HERE}
    runs: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    for i in range(args.rounds):
        for p in ("base", "new") if i % 2 == 0 else ("new", "base"):
            runs[p].append(profile(trees[p], rest))
    keys = list(dict.fromkeys(k for r in runs["base"] + runs["new"] for k in r))
    print(f"GPU: {gpu_name()}; gpu_profile.py {' '.join(rest)}; {args.rounds} rounds\n")
    head = " | ".join(f"{p} {i + 1}" for i in range(args.rounds) for p in ("base", "new"))
    print(f"| line | {head} | this tree / baseline |")
    print("| --- |" + " ---: |" * (2 * args.rounds + 1))
    for k in keys:
        cells = [runs[p][i].get(k) for i in range(args.rounds) for p in ("base", "new")]
        text = " | ".join("-" if c is None else f"{c:.3f}" for c in cells)
        b = [r[k] for r in runs["base"] if k in r]
        n = [r[k] for r in runs["new"] if k in r]
        ratio = f"{statistics.median(n) / statistics.median(b):.3f}" if b and n else "-"
        print(f"| {k} | {text} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
