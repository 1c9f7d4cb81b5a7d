"""The int8 LM head against the DRAM read roof (device machine): is the head bound by its bytes?

    python benchmarks/gpu_head_roof.py [--batches 1,8,64] [--vocab 128256] [--hidden 2560]

The head's weights (int8, vocabulary x hidden: 328 MB at the 2B4T shape) are far larger than L2, so each call
reads them from DRAM. The roof is a plain streaming read of the same bytes, measured in the same run: a Triton
kernel whose programs each sum a contiguous slice (several block shapes; the fastest counts). Both sides are
captured in CUDA graphs and replayed back to back. The head is timed as the engine runs it in a greedy step
(`launch.w8a16_argmax`: the int16 quantization launch, then the head reducing its logits inside its tiles) and as
its kernel alone, at the tiles the tuner picks. Prints a markdown table naming the GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_attention import _graph_us  # noqa: E402  (us a call, captured once, replayed; best of 3)

REPS = 20  # graph replays a timing


@triton.jit
def _read_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Sum ITERS contiguous blocks of int32 words (the sum is stored so that the loads are not dead code)."""
    pid = tl.program_id(0)
    acc = tl.zeros([1024], tl.int32)
    base = pid.to(tl.int64) * BLOCK * ITERS
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs, mask=offs < N, other=0)
        acc += tl.sum(tl.reshape(v, [BLOCK // 1024, 1024]), axis=0)  # [BLOCK] -> [BLOCK/1024, 1024]
    tl.store(y_ptr + pid * 1024 + tl.arange(0, 1024), acc)


def read_roof_us(w: torch.Tensor) -> tuple[float, str]:
    """The fastest streaming read of w's bytes: (us, block shape)."""
    x = w.view(torch.int32).view(-1)  # [V*K/4] words
    n = x.numel()
    best = (float("inf"), "")
    for block, iters, warps in ((4096, 4, 4), (8192, 4, 8), (16384, 2, 8), (2048, 16, 4)):
        grid = triton.cdiv(n, block * iters)
        y = torch.empty(grid * 1024, dtype=torch.int32, device=w.device)
        us = _graph_us(
            lambda g=grid, y=y, b=block, i=iters, nw=warps: _read_kernel[(g,)](
                x, y, n, BLOCK=b, ITERS=i, num_warps=nw
            )
        )
        best = min(best, (us, f"{block} words x {iters}, {warps} warps"))
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=2560)
    args = ap.parse_args()
    from bitnetlm.kernels.triton import tune
    from bitnetlm.kernels.triton.bench import gpu_name
    from bitnetlm.kernels.triton.gemm import _w8a16_kernel
    from bitnetlm.kernels.triton.launch import quantize16, w8a16_argmax

    v, k = args.vocab, args.hidden
    w = torch.randint(-127, 128, (v, k), dtype=torch.int8, device="cuda")
    s = torch.rand(v, device="cuda") / 64
    nw = torch.rand(k, device="cuda").to(torch.bfloat16)
    roof, shape = read_roof_us(w)
    mb = w.numel() / 1e6
    print(
        f"GPU: {gpu_name()}; head {v} x {k} int8 ({mb:.0f} MB); read roof {roof:.1f} us ({mb / roof * 1e3:.0f} GB/s, {shape})\n"
    )
    print(
        "| batch | tile (BM, BN, BK, warps) | quantization + head us | GB/s | of roof | head kernel alone us | of roof |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for b in (int(x) for x in args.batches.split(",")):
        h = torch.randn(b, k, dtype=torch.bfloat16, device="cuda")
        both = _graph_us(lambda h=h: w8a16_argmax(h, nw, 1e-5, w, s), REPS, 1)  # tunes on its eager warm-up
        cfg = tune._choice[("w8a16_argmax", v, k, min(triton.next_power_of_2(b), 1024))]
        hi, lo, a = quantize16(h, nw, 1e-5)
        t = triton.cdiv(v, cfg["BN"])
        ym = torch.empty((b, t), dtype=torch.float32, device="cuda")
        yi = torch.empty((b, t), dtype=torch.int32, device="cuda")
        grid = (t, triton.cdiv(b, cfg["BM"]))
        args_k = (hi, lo, a, w, s, ym, yi, b, v, k, hi.stride(0), t)
        alone = _graph_us(lambda g=grid, ak=args_k, c=cfg: _w8a16_kernel[g](*ak, ARGMAX=True, **c), REPS, 1)
        tile = f"{cfg['BM']}, {cfg['BN']}, {cfg['BK']}, {cfg['num_warps']}"
        print(
            f"| {b} | {tile} | {both:.1f} | {mb / both * 1e3:.0f} | {roof / both:.2f} | {alone:.1f} | {roof / alone:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
