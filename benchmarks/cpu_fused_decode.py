#!/usr/bin/env python3
"""Decode (and prefill) tokens/s with the fused CPU decode step (kernels.cpu.decode) on and off, in the same run.

Random weights of the 2B4T shape (bench.random_model, bf16 head), C kernels on `--threads` threads, torch at
1 thread. For each KV cache type and context length, two identical caches are filled by one prefill (not
timed); then `--tg` decode steps are run on each, fused and unfused steps interleaved one by one (order
alternating), so load from other processes hits both about equally. The table gives tokens/s from the median
and the fastest step of each. Prints the machine and its load average: a shared machine makes numbers noisy.
--pp N adds a prefill table: `--pp-reps` prefills of N tokens per row into fresh caches (allocated outside
the timing), fused and unfused alternating (order swapped every repetition), after one warm-up of each.

    python benchmarks/cpu_fused_decode.py --threads 2 --ctx 0,1024 --tg 32
    python benchmarks/cpu_fused_decode.py --batch 4 --ctx 256 --kv bf16     # batched decode (serve engine)
    python benchmarks/cpu_fused_decode.py --pp 128 --pp-reps 6 --tg 0 --kv bf16   # prefill pp128 only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bitnetlm import bench  # noqa: E402
from bitnetlm.kernels import cpu  # noqa: E402
from bitnetlm.kernels.cpu.decode import attach  # noqa: E402

KV = {"fp32": torch.float32, "bf16": torch.bfloat16}


@torch.inference_mode()
def twin_caches(model, batch: int, ctx: int, n: int, kv_dtype: torch.dtype):
    """Two caches holding the same `ctx` prefilled positions per row, with room for n more."""
    a, b = (model.new_cache(batch, ctx + n, dtype=kv_dtype) for _ in range(2))
    if ctx:
        model(torch.randint(0, 1000, (batch, ctx), generator=torch.Generator().manual_seed(0)), cache=a)
        for x, y in zip(a.k + a.v, b.k + b.v):
            y.copy_(x)
        b.valid.copy_(a.valid)
    return a, b


@torch.inference_mode()
def step_seconds(model, fused, caches, ctx: int, n: int) -> dict[str, list[float]]:
    """Per-step seconds of n decode steps with the fused step on (cache 0) and off (cache 1), interleaved."""
    out = {"on": [], "off": []}
    b = caches[0].batch_size
    toks = {"on": torch.full((b, 1), 7), "off": torch.full((b, 1), 7)}
    for i in range(n):
        pos = torch.full((b, 1), ctx + i)
        for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
            model.cpu_decode = fused if mode == "on" else None
            calls = fused.calls
            t0 = time.perf_counter()
            logits = model(toks[mode], positions=pos, cache=caches[mode == "off"])
            out[mode].append(time.perf_counter() - t0)
            assert (fused.calls == calls + 1) == (mode == "on")
            toks[mode] = logits[:, -1].argmax(-1, keepdim=True)
    return out


@torch.inference_mode()
def prefill_seconds(model, fused, batch: int, pp: int, reps: int, kv_dtype) -> dict[str, list[float]]:
    """Seconds of `reps` prefills of pp tokens per row with the fused step on and off, alternating."""
    out = {"on": [], "off": []}
    ids = torch.randint(0, 1000, (batch, pp), generator=torch.Generator().manual_seed(1))
    for i in range(reps + 1):  # repetition 0: warm-up
        for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
            cache = model.new_cache(batch, pp, dtype=kv_dtype)
            model.cpu_decode = fused if mode == "on" else None
            calls = fused.calls
            t0 = time.perf_counter()
            model(ids, cache=cache, last_only=True)
            dt = time.perf_counter() - t0
            assert (fused.calls == calls + 1) == (mode == "on")
            if i:
                out[mode].append(dt)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="2b4t")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", default="0,1024", help="cached positions before the timed steps")
    ap.add_argument("--kv", default="fp32,bf16")
    ap.add_argument("--tg", type=int, default=32, help="timed steps per mode (after 2 warm-up steps)")
    ap.add_argument("--batch", type=int, default=1, help="rows decoded together (t/s counts every row)")
    ap.add_argument("--pp", type=int, default=0, help="prefill tokens per row to time (0: no prefill table)")
    ap.add_argument("--pp-reps", type=int, default=6, help="timed prefills per mode")
    a = ap.parse_args()
    model = bench.random_model(a.shape, head_dtype="bf16")
    fused = attach(model)
    if fused is None:
        raise SystemExit("the fused step cannot run for this model / build")
    cpu.set_num_threads(a.threads)
    torch.set_num_threads(1)
    la0 = os.getloadavg()
    rows = []
    pre = []
    for kv in a.kv.split(",") if a.pp else []:
        pre.append((kv, prefill_seconds(model, fused, a.batch, a.pp, a.pp_reps, KV[kv])))
    for kv in a.kv.split(",") if a.tg else []:
        for ctx in (int(c) for c in a.ctx.split(",")):
            model.cpu_decode = None
            caches = twin_caches(model, a.batch, ctx, a.tg + 2, KV[kv])
            step_seconds(model, fused, caches, ctx, 2)  # warm-up
            rows.append((kv, ctx, step_seconds(model, fused, caches, ctx + 2, a.tg)))
    la1 = os.getloadavg()
    print(f"machine: {bench.machine_name()}; kernels: {cpu.get_isa()}, {a.threads} threads, torch 1 thread")
    print(f"load average {la0[0]:.1f} at start, {la1[0]:.1f} at end (other work on the machine adds noise)\n")
    if pre:
        print(
            "| model | batch | KV cache | prefill | runs | fused off s (median / best) "
            "| fused on s (median / best) | on/off speed (median) |"
        )
        print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
        for kv, t in pre:
            off, on = statistics.median(t["off"]), statistics.median(t["on"])
            print(
                f"| {a.shape} (random) | {a.batch} | {kv} | pp{a.pp} | {a.pp_reps} | {off:.3f} / {min(t['off']):.3f} | "
                f"{on:.3f} / {min(t['on']):.3f} | {off / on:.2f}x |"
            )
        print()
    if not rows:
        return 0
    print(
        "| model | batch | KV cache | context | steps | fused off t/s (median / best) "
        "| fused on t/s (median / best) | on/off (median) |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for kv, ctx, t in rows:
        off, on = statistics.median(t["off"]), statistics.median(t["on"])
        b = a.batch
        print(
            f"| {a.shape} (random) | {b} | {kv} | {ctx} | {a.tg} | {b / off:.2f} / {b / min(t['off']):.2f} | "
            f"{b / on:.2f} / {b / min(t['on']):.2f} | {off / on:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
