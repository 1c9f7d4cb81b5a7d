#!/usr/bin/env python3
"""CPU decode/prefill speed of the C kernels on real model shapes with random ternary weights.

Builds BitNet b1.58 2B4T (and the 0.7B 1bitLLM "large" shape) directly in the CPU packed layout
(random weights: the real checkpoints are not reachable offline), then measures
  - STREAM-like copy bandwidth (bytes read + written per second, the library's own threads),
  - read-only bandwidth around each decode row, and the tokens/s it allows (weights read per token),
  - decode tokens/s (tgN from an empty cache) with a bf16 and an int8 embedding/LM head,
  - prefill tokens/s (ppN, last position's logits only),
  - weight bytes read per decoded token and the GB/s that implies,
  - resident memory against packed weights + KV cache.
Prints a markdown table naming the machine (and its load average: a busy machine gives lower numbers).

    python benchmarks/cpu_decode.py --shapes 2b4t,large --threads 2 --heads bf16,int8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bitnetlm import bench  # noqa: E402
from bitnetlm.kernels import cpu  # noqa: E402
from bitnetlm.kernels.cpu.head import CompactHead  # noqa: E402
from bitnetlm.models.cache import parse_kv_cache_dtype  # noqa: E402
from bitnetlm.quant.bitlinear import BitLinear  # noqa: E402


def _best_seconds(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(threads: int, mib: int = 512, reps: int = 5) -> float:
    """Best-of-`reps` GB/s of a parallel memcpy, counting bytes read and written (STREAM 'copy' convention)."""
    cpu.set_num_threads(threads)
    src = torch.ones(mib << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    lib = cpu._lib.load()
    t = _best_seconds(lambda: lib.bn_parallel_copy(dst.data_ptr(), src.data_ptr(), src.numel()), reps)
    return 2 * src.numel() / t / 1e9


def read_bandwidth(threads: int, mib: int = 512, reps: int = 5) -> float:
    """Best-of-`reps` GB/s of a parallel read-only sweep (the sum of 64-bit words): decode's own access pattern,
    so its ceiling. Measured again before each decode row: this VM's bandwidth drifts by tens of percent."""
    cpu.set_num_threads(threads)
    src = torch.ones(mib << 20, dtype=torch.uint8)
    lib = cpu._lib.load()
    t = _best_seconds(lambda: lib.bn_parallel_read(src.data_ptr(), src.numel()), reps)
    return src.numel() / t / 1e9


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def weight_bytes_per_token(model) -> tuple[int, int]:
    """(ternary projection bytes, LM head bytes) read for one decoded token."""
    tern = sum(m.packed.numel() for m in model.modules() if isinstance(m, BitLinear))
    head = model.compact_head.nbytes() if model.compact_head is not None else model.lm_head_weight().nbytes
    return tern, head


def set_head(model, dtype: str, bf16_table: torch.Tensor, bf16_head: torch.Tensor | None) -> None:
    model.compact_embed = CompactHead(bf16_table, dtype)
    model.compact_head = model.compact_embed if bf16_head is None else CompactHead(bf16_head, dtype)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="2b4t,large")
    ap.add_argument("--threads", default=None, help="comma-separated thread counts (default: physical cores)")
    ap.add_argument("--heads", default="bf16,int8")
    ap.add_argument("--tg", type=int, default=64, help="decode tokens per run (default 64)")
    ap.add_argument("--pp", default="128", help="prompt lengths (default 128)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096, help="KV cache length for the resident-memory row")
    ap.add_argument(
        "--kv", default="auto", choices=["auto", "bf16"], help="KV-cache dtype (--kv-cache-dtype)"
    )
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")] if a.threads else [cpu.physical_cores()]
    pps = [int(p) for p in a.pp.split(",") if p]
    heads = [h for h in a.heads.split(",") if h]

    out = {
        "machine": bench.machine_name(),
        "isa": cpu.get_isa(),
        "kv": a.kv,
        "loadavg_start": os.getloadavg(),
        "rows": [],
    }
    out["copy_gbps"] = {t: copy_bandwidth(t) for t in threads}
    for shape in a.shapes.split(","):
        t0 = time.perf_counter()
        model = bench.random_model(shape, head_dtype=heads[0])
        model.kv_cache_dtype = parse_kv_cache_dtype(a.kv)
        build_s = time.perf_counter() - t0
        table = model.compact_embed.weight if heads[0] == "bf16" else None
        untied = model.compact_head is not model.compact_embed
        head_w = model.compact_head.weight if (untied and heads[0] == "bf16") else None
        for hd in heads:
            if hd != heads[0]:
                if table is None:
                    raise SystemExit("list bf16 first in --heads (the int8 head is made from the bf16 table)")
                set_head(model, hd, table, head_w if untied else None)
                if hd == heads[-1]:  # the bf16 tables are not needed any more: keep them out of the RSS row
                    table = head_w = None
            tern, headb = weight_bytes_per_token(model)
            for nt in threads:
                read_before = read_bandwidth(nt)
                rows = bench.bench(model, pps, [a.tg], [nt], a.reps, "cpu", f"{shape} (random)")
                read_gbps = (read_before + read_bandwidth(nt)) / 2  # around the runs
                for r in rows:
                    r.update(head=hd, build_s=build_s, copy_gbps=out["copy_gbps"][nt])
                    if r["test"].startswith("tg"):
                        r["weight_bytes_per_token"] = tern + headb
                        r["weights_gbps"] = (tern + headb) * r["tokens_per_s"] / 1e9
                        r["read_gbps"] = read_gbps
                        r["ceiling_tokens_per_s"] = read_gbps * 1e9 / (tern + headb)
                out["rows"].extend(rows)
            cache = model.new_cache(1, a.ctx)
            kv = cache.nbytes()
            out["rows"].append(
                dict(
                    model=f"{shape} (random)",
                    head=hd,
                    test="memory",
                    rss_mb=rss_bytes() / 2**20,
                    model_mb=bench.model_bytes(model) / 2**20,
                    kv_mb_at_ctx=kv / 2**20,
                    ctx=a.ctx,
                )
            )
            del cache
        del model
    out["loadavg_end"] = os.getloadavg()
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    la = ", ".join(f"{x:.1f}" for x in out["loadavg_start"])
    print(
        f"machine: {out['machine']}; kernels: {out['isa']}; KV cache: {a.kv}; load average at start: {la}\n"
    )
    print("| threads | copy GB/s (read+write) |\n| ---: | ---: |")
    for t, g in out["copy_gbps"].items():
        print(f"| {t} | {g:.1f} |")
    print(
        "\n| model | head | threads | test | t/s | weights read/token | weight GB/s | read GB/s around the row "
        "| ceiling t/s (read GB/s / weights) | of ceiling |"
    )
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in out["rows"]:
        if r["test"] == "memory":
            continue
        wb = r.get("weight_bytes_per_token")
        extra = (
            f"{wb / 1e6:.0f} MB | {r['weights_gbps']:.1f} | {r['read_gbps']:.1f} | "
            f"{r['ceiling_tokens_per_s']:.2f} | {r['tokens_per_s'] / r['ceiling_tokens_per_s']:.0%}"
            if wb
            else " | | | |"
        )
        print(
            f"| {r['model']} | {r['head']} | {r['threads']} | {r['test']} | "
            f"{r['tokens_per_s']:.2f} ± {r['std']:.2f} | {extra} |"
        )
    print("\n| model | head | RSS MB (after runs) | weights MB | KV cache MB at ctx | ctx |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for r in out["rows"]:
        if r["test"] == "memory":
            print(
                f"| {r['model']} | {r['head']} | {r['rss_mb']:.0f} | {r['model_mb']:.0f} | "
                f"{r['kv_mb_at_ctx']:.0f} | {r['ctx']} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
