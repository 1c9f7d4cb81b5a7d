"""The C kernels' thread pool on shared cores: batch-1 decode tokens/s with 1 and N kernel threads, with no
competitor and with one busy process competing for the cores (a Python busy loop, unpinned, or pinned to the
last CPU this process may use).

    python benchmarks/cpu_threads.py [-m bitnet-tiny | --shape 2b4t] [-n 64] [-r 5] [-t 1,2] [--head-dtype bf16]

Every configuration runs `-r` times, interleaved with the others of the same competitor; the table shows the best
and the median run (a shared machine's other load only ever slows a run down). The load average at the start is
printed: "no competitor" means none of ours, not an idle machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bitnetlm import bench  # noqa: E402
from bitnetlm.runtime.args import int_list  # noqa: E402

BUSY = "while True: pass"


def start_competitor(kind: str) -> subprocess.Popen | None:
    """None, or a busy Python process: unpinned, or pinned to the last CPU of this process's affinity."""
    if kind == "none":
        return None
    cpus = sorted(os.sched_getaffinity(0))
    pin = (lambda: os.sched_setaffinity(0, {cpus[-1]})) if kind == "pinned" else None
    proc = subprocess.Popen([sys.executable, "-c", BUSY], preexec_fn=pin)
    time.sleep(0.2)  # let it reach its loop
    return proc


def decode_tps(model, n: int, gen: torch.Generator) -> float:
    return n / bench.time_decode(model, n, torch.device("cpu"), model.config.vocab_size, gen)


def load(a):
    if a.shape:
        return bench.random_model(a.shape, head_dtype=a.head_dtype), a.shape
    import bitnetlm

    model, _ = bitnetlm.load(a.model, head_dtype=a.head_dtype)
    return model.eval(), a.model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="bitnet-tiny", help="model directory or zoo name")
    ap.add_argument("--shape", default=None, help="random weights of a real model shape instead of -m")
    ap.add_argument("--head-dtype", default=None, choices=["bf16", "int8"], help="CPU head storage")
    ap.add_argument("-n", "--n-gen", type=int, default=64, help="decode steps per run")
    ap.add_argument("-r", "--repetitions", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int_list, default=None, help="default: 1,physical cores")
    ap.add_argument("--competitors", default="none,unpinned,pinned", help="none,unpinned,pinned")
    a = ap.parse_args()
    model, label = load(a)
    threads = a.threads or bench.default_threads()
    gen = torch.Generator().manual_seed(0)
    print(f"machine: {bench.machine_name()}; load average {os.getloadavg()[0]:.2f} at start")
    print(f"model: {label}, head {bench._head_name(model)}, tg{a.n_gen}, {a.repetitions} runs each\n")
    print("| competitor | kernel threads | best tok/s | median tok/s |\n| --- | ---: | ---: | ---: |")
    for kind in a.competitors.split(","):
        proc = start_competitor(kind)
        try:
            runs: dict[int, list[float]] = {t: [] for t in threads}
            for t in threads:  # warm-up: the pool's threads, the runner's first steps
                bench._setup_threads(torch.device("cpu"), t, model)
                decode_tps(model, 4, gen)
            for _ in range(a.repetitions):
                for t in threads:
                    bench._setup_threads(torch.device("cpu"), t, model)
                    runs[t].append(decode_tps(model, a.n_gen, gen))
        finally:
            if proc is not None:
                proc.kill()
                proc.wait()
        for t in threads:
            print(f"| {kind} | {t} | {max(runs[t]):.1f} | {statistics.median(runs[t]):.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
