"""Decode attention alone (GPU): our split-KV Triton kernel against PyTorch SDPA, in GB/s of K/V.

    python benchmarks/gpu_attention.py [--batches 1,8,64] [--contexts 512,2048] [--kv bf16,fp8] [--layers 30]
        [--attn 0,8/32]

The 2B4T attention shape (20 query heads, 5 KV heads, head size 128). Each timed step runs one attention per
layer over that layer's own cache, as a decode step does, so the K/V reads come from DRAM and not from L2 (one
layer's cache at batch 64 and context 512 is 84 MB in bf16). Both sides are captured in a CUDA graph. The
baseline is `scaled_dot_product_attention(..., enable_gqa=True)` over the bf16 cache's live context (SDPA
takes no float8 cache). The copy bandwidth of a 1 GiB tensor (bytes read + written) is measured in the same
run, as the roof. Prints a markdown table naming the GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

H, HKV, D = 20, 5, 128


def _graph_us(fn, steps: int, calls: int) -> float:
    """Microseconds a call of fn (which makes `calls` calls), captured once and replayed `steps` times."""
    from bitnetlm.runtime.cuda.bench import _events_ms
    from bitnetlm.runtime.cuda.engine import capture

    g, _ = capture(fn)  # eager warm-up first: compiles, allocates workspaces
    g.replay()

    def replays():
        for _ in range(steps):
            g.replay()

    return min(_events_ms(replays, 3)) * 1e3 / (steps * calls)


def _attn(spec: str) -> dict:
    """An --attn variant, SPLITS[/BS[/STAGES[/WARPS[/MAXNREG]]]] (0: the launcher's choice), as DecodePlan fields."""
    names = ("attn_splits", "attn_bs", "attn_stages", "attn_warps", "attn_maxnreg")
    return dict(zip(names, ([int(v) for v in spec.split("/")] + [0] * 4)[:5]))


def copy_gbps() -> float:
    x = torch.empty(2**29, dtype=torch.float16, device="cuda")
    y = torch.empty_like(x)
    us = _graph_us(lambda: y.copy_(x), 10, 1)
    return 2 * x.numel() * 2 / us / 1e3


def time_config(
    b: int, ctx: int, dt: torch.dtype, layers: int, steps: int, baseline: bool, plan=None
) -> tuple[float, float | None]:
    """(our us a layer, SDPA's if `baseline` and the cache is bf16, else None) at batch b over ctx keys, our
    kernel by `plan` (a DecodePlan; None: the default)."""
    import torch.nn.functional as F

    from bitnetlm.kernels.triton.attention import attn_decode

    s = ctx + 16
    q = torch.randn(b, H, D, device="cuda").bfloat16()
    ks = [torch.randn(b, HKV, s, D, device="cuda").to(dt) for _ in range(layers)]
    vs = [torch.randn(b, HKV, s, D, device="cuda").to(dt) for _ in range(layers)]
    pos = torch.full((b,), ctx - 1, dtype=torch.int32, device="cuda")  # ctx keys: 0..ctx-1
    out = torch.empty(b, H, D, device="cuda", dtype=torch.bfloat16)

    def ours():
        for k, v in zip(ks, vs):
            attn_decode(q, k, v, pos, out, D**-0.5, plan=plan)

    def sdpa():
        for k, v in zip(ks, vs):
            F.scaled_dot_product_attention(q[:, :, None], k[:, :, :ctx], v[:, :, :ctx], enable_gqa=True)

    us = _graph_us(ours, steps, layers)
    return us, (_graph_us(sdpa, steps, layers) if baseline and dt == torch.bfloat16 else None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--kv", default="bf16,fp8")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument(
        "--attn",
        default="0",
        help="our kernel's variants: comma-separated SPLITS[/BS[/STAGES[/WARPS[/MAXNREG]]]] (0 = the default)",
    )
    args = ap.parse_args()
    from bitnetlm.kernels.triton.plan import DecodePlan
    from bitnetlm.runtime.config import kv_cache_dtype as parse_kv_cache_dtype
    from bitnetlm.runtime.cuda.bench import gpu_name

    roof = copy_gbps()
    print(f"GPU: {gpu_name()}; copy bandwidth {roof:.0f} GB/s; {args.layers} layers a step, best of 3\n")
    print(
        "| batch | context | KV cache | variant | ours us/layer | ours GB/s | of copy | SDPA us/layer | SDPA GB/s "
        "| ours vs SDPA (bf16 cache) |"
    )
    print("| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    torch.manual_seed(0)
    for b in (int(v) for v in args.batches.split(",")):
        for ctx in (int(v) for v in args.contexts.split(",")):
            base = None
            for kvname, spec in [(k, a) for k in args.kv.split(",") for a in args.attn.split(",")]:
                plan = DecodePlan(**_attn(spec))
                dt = parse_kv_cache_dtype(kvname) or torch.bfloat16
                us, sdpa = time_config(b, ctx, dt, args.layers, args.steps, base is None, plan)
                base = sdpa or base
                gbps = 2 * b * HKV * ctx * D * dt.itemsize / us / 1e3
                sd = f"{sdpa:.1f} | {2 * b * HKV * ctx * D * 2 / sdpa / 1e3:.0f}" if sdpa else "n/a | n/a"
                print(
                    f"| {b} | {ctx} | {kvname} | {spec} | {us:.1f} | {gbps:.0f} | {gbps / roof:.0%} | {sd} | "
                    f"{f'{base / us:.2f}x' if base else 'n/a'} |",
                    flush=True,
                )
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
