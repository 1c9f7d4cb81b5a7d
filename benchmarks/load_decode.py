#!/usr/bin/env python3
"""Load time, peak RSS and greedy decode tokens/s for a real-shape packed checkpoint (random weights).

Each (backend) case runs in a fresh subprocess so peak RSS is its own. Prints a markdown table naming the machine.
Usage: python benchmarks/load_decode.py [--shape 2b4t] [--backends reference,cpu] [--tokens 8] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one_case(path: str, backend: str, tokens: int, dtype: str) -> dict:
    import resource
    import time

    import torch

    import bitnetlm

    t0 = time.perf_counter()
    model, _ = bitnetlm.load(path, backend=backend, dtype=getattr(torch, dtype))
    load_s = time.perf_counter() - t0
    rss_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cache = model.new_cache(1, 64 + tokens)
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = model(ids, cache=cache, last_only=True)
        ttft = time.perf_counter() - t0
        tok = logits[:, -1].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for pos in range(8, 8 + tokens):
            logits = model(tok, positions=torch.tensor([[pos]]), cache=cache)
            tok = logits[:, -1].argmax(-1, keepdim=True)
        dt = time.perf_counter() - t0
    return {
        "backend": backend,
        "dtype": dtype,
        "load_s": load_s,
        "rss_after_load_mb": rss_load,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "prefill8_s": ttft,
        "decode_tok_s": tokens / dt,
        "threads": torch.get_num_threads(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="2b4t")
    ap.add_argument("--backends", default="reference")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--_case", help=argparse.SUPPRESS)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from make_checkpoint import write_checkpoint

    path = write_checkpoint(ROOT / ".assets" / f"bench-{a.shape}", a.shape)
    if a._case:
        print(json.dumps(one_case(str(path), a._case, a.tokens, a.dtype)))
        return 0
    rows = []
    for b in a.backends.split(","):
        r = subprocess.run(
            [
                sys.executable,
                __file__,
                "--shape",
                a.shape,
                "--tokens",
                str(a.tokens),
                "--dtype",
                a.dtype,
                "--_case",
                b,
            ],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            print(f"backend {b} failed:\n{r.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    file_mb = (path / "model.safetensors").stat().st_size / 2**20
    if a.json:
        print(
            json.dumps(
                {"machine": platform.processor() or platform.machine(), "file_mb": file_mb, "rows": rows},
                indent=2,
            )
        )
        return 0
    from bitnetlm.bench import cpu_model_name

    cpu = cpu_model_name()
    print(f"\n{a.shape} packed checkpoint ({file_mb:.0f} MiB, random weights) on {cpu}\n")
    print(
        "| backend | dtype | threads | load s | RSS after load MiB | peak RSS MiB | prefill 8 tok s | decode tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['backend']} | {r['dtype']} | {r['threads']} | {r['load_s']:.2f} | {r['rss_after_load_mb']:.0f} | "
            f"{r['peak_rss_mb']:.0f} | {r['prefill8_s']:.2f} | {r['decode_tok_s']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
