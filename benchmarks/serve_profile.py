#!/usr/bin/env python3
"""Where a profiled server's host time goes: `serve_load.py --profile FILE`'s py-spy stacks summed.

    python benchmarks/serve_profile.py prof.txt [--top 25] [--skip GraphRows.__init__,load_in_background]

py-spy's raw format is one line per distinct stack: "thread (tid): name;frame;frame... count", frames root first.
Prints a markdown table per thread: samples, share of all, and the functions with the most samples inclusive
(on the stack) and self (the innermost frame). --skip drops every stack holding one of the named functions (the
server's start-up: graph capture, model load), so that the shares are of the serving work alone.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter, defaultdict

_FRAME = re.compile(r"^(.*) \((.*?)(?::\d+)?\)$")


def _func(frame: str) -> str:
    """'name (path/file.py:123)' -> 'file.py:name' (the line dropped, so that a function's lines add up)."""
    m = _FRAME.match(frame)
    if not m:
        return frame
    name, path = m.groups()
    return f"{path.rsplit('/', 1)[-1]}:{name}"


def load(path: str, skip: list[str]) -> dict[str, list[tuple[list[str], int]]]:
    """thread name -> [(functions root first, samples)] of the stacks that hold none of `skip`."""
    out: dict[str, list[tuple[list[str], int]]] = defaultdict(list)
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            frames = stack.split(";")
            thread = re.sub(r"^thread \(\d+\):? ?", "", frames[0]) or "(unnamed)"
            funcs = [_func(fr) for fr in frames[1:]]
            if any(s in fn for s in skip for fn in funcs):
                continue
            out[thread].append((funcs, int(n)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--skip",
        default="GraphRows.__init__,load_in_background,_find_and_load",
        help="comma-separated function names (file.py:name or a part of it) whose stacks are dropped",
    )
    args = ap.parse_args(argv)
    threads = load(args.profile, [s for s in args.skip.split(",") if s])
    total = sum(n for stacks in threads.values() for _, n in stacks)
    if not total:
        print(f"{args.profile}: no samples left", file=sys.stderr)
        return 1
    print(f"### {args.profile}: {total} samples (stacks holding {args.skip} dropped)\n")
    for thread, stacks in sorted(threads.items(), key=lambda kv: -sum(n for _, n in kv[1])):
        n_thread = sum(n for _, n in stacks)
        incl, self_ = Counter(), Counter()
        for funcs, n in stacks:
            for fn in set(funcs):
                incl[fn] += n
            if funcs:
                self_[funcs[-1]] += n
        print(f"#### thread {thread}: {n_thread} samples ({100 * n_thread / total:.1f}%)\n")
        print("| function | inclusive | % of thread | self | % of thread |")
        print("|---|---:|---:|---:|---:|")
        for fn, n in incl.most_common(args.top):
            print(
                f"| `{fn}` | {n} | {100 * n / n_thread:.1f} | {self_[fn]} | {100 * self_[fn] / n_thread:.1f} |"
            )
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
