"""The decode projections alone (GPU): our W2A8 kernels against cuBLAS int8 and bf16, in GB/s.

    python benchmarks/gpu_gemm.py [--batches 1,8,64] [--layers 30] [--paths auto,splitk_t,splitk_pair]
        [--shapes q|k|v,o,gate|up,down]

The four 2B4T projections (q|k|v, o, gate|up, down) at each batch size. Every timed call runs the projection
once per layer over that layer's own weights, as a decode step does, so the weights come from DRAM and not
from L2; all of it is captured in a CUDA graph. Rows:
- `auto`: `ternary_linear` with its tuned choice, the quantization launch included (as in the engine);
- `quant`: the quantization launch alone;
- other `--paths`: the tuner's best candidate of that path only (`--verbose` prints every candidate's time);
- `int8 cuBLAS`: `torch._int_mm` over the unpacked int8 weights (4x the bytes; batch > 16 only), activations
  already int8;
- `bf16 cuBLAS`: `F.linear` over bf16 weights (8x the bytes).
GB/s counts the weight bytes each one reads. The copy bandwidth of a 1 GiB tensor (bytes read + written) is
measured in the same run. Prints a markdown table naming the GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HIDDEN, INTER, HEADS_QKV = 2560, 6912, 2560 + 2 * 640
# name, out_features (gate|up: per half), in_features, gated
SHAPES = (
    ("q|k|v", HEADS_QKV, HIDDEN, False),
    ("o", HIDDEN, HIDDEN, False),
    ("gate|up", INTER, HIDDEN, True),
    ("down", HIDDEN, INTER, False),
)


def time_shape(name, n, k, gated, b, packed, t, paths, steps, row) -> None:
    """Print the rows of one projection at batch b: our paths, the quantization launch, cuBLAS int8 and bf16."""
    import torch.nn.functional as F

    from benchmarks.gpu_attention import _graph_us
    from bitnetlm.kernels.triton import launch
    from bitnetlm.kernels.triton.layout import packed_row_bytes

    rows, L = t[0].shape[0], len(packed)
    scale = torch.ones(1, device="cuda")
    x = torch.randn(b, k, device="cuda").bfloat16()
    out = torch.empty(b, n, device="cuda", dtype=torch.bfloat16)
    for path in paths:
        p = None if path == "auto" else path

        def ours(p=p):
            for w in packed:
                launch.ternary_linear(x, w, scale, n, gated=gated, out=out, path=p)

        try:
            us = _graph_us(ours, steps, L)
        except (IndexError, KeyError, RuntimeError) as e:  # a path without candidates at this shape
            print(f"| {name} | {b} | {path}: {type(e).__name__} | | | |")
            continue
        row(name, b, path, us, packed[0].numel())
    kp = packed_row_bytes(k)
    q = torch.empty((b, 4 * kp), dtype=torch.int8, device="cuda")
    a = torch.empty((b,), dtype=torch.float32, device="cuda")
    rs = torch.empty((b,), dtype=torch.int32, device="cuda")
    us = _graph_us(lambda: [launch.launch_quant(x, None, q, a, rs, 1e-5) for _ in range(L)], steps, L)
    print(f"| {name} | {b} | quant | {us:.2f} | | |")
    if b > 16:
        xq = q[:, :k].contiguous()
        wt = [w.t() for w in t]  # [K, rows], column-major as cuBLAS wants
        us = _graph_us(lambda: [torch._int_mm(xq, w) for w in wt], steps, L)
        row(name, b, "int8 cuBLAS", us, rows * k)
    wb = [w.bfloat16() for w in t[: min(L, 8)]]  # 8 layers of bf16: past the 50 MB L2 all the same
    us = _graph_us(lambda: [F.linear(x, w) for w in wb], steps, len(wb))
    row(name, b, "bf16 cuBLAS", us, rows * k * 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--paths", default="auto", help="comma-separated ternary_linear paths (auto = tuned)")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="which projections")
    ap.add_argument("--verbose", action="store_true", help="print every tuning candidate's time")
    args = ap.parse_args()
    from bitnetlm.kernels.triton import tune

    tune.configure(verbose=args.verbose)
    from benchmarks.gpu_attention import copy_gbps
    from bitnetlm.kernels.triton.layout import pack_triton
    from bitnetlm.runtime.cuda.bench import gpu_name

    torch.manual_seed(0)
    roof = copy_gbps()
    print(f"GPU: {gpu_name()}; copy bandwidth {roof:.0f} GB/s; {args.layers} layers a call, best of 3\n")
    print("| projection | batch | kernel | us/layer | weight GB/s | of copy |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")

    def row(name, b, label, us, nbytes):
        gbs = nbytes / us / 1e3
        print(f"| {name} | {b} | {label} | {us:.2f} | {gbs:,.0f} | {gbs / roof:.0%} |", flush=True)

    for name, n, k, gated in (s for s in SHAPES if s[0] in args.shapes.split(",")):
        rows = 2 * n if gated else n
        t = [torch.randint(-1, 2, (rows, k), dtype=torch.int8, device="cuda") for _ in range(args.layers)]
        packed = [pack_triton(w) for w in t]
        for b in (int(v) for v in args.batches.split(",")):
            time_shape(name, n, k, gated, b, packed, t, args.paths.split(","), args.steps, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
