"""The int8 LM head against the DRAM read roof (GPU): is the head bound by its bytes?

    python benchmarks/gpu_head_roof.py [--batches 1,8,64] [--vocab 128256] [--hidden 2560]

The head's weights (int8, vocabulary x hidden: 328 MB at the 2B4T shape) are far larger than L2, so each call
reads them from DRAM. The roof is a streaming read of the same bytes, measured in the same run: Triton kernels
whose programs each sum contiguous slices, by plain loads (block shapes, eviction policies, cache modifiers) or
through the tensor memory accelerator (TMA tiles); each is printed, the fastest counts. (The head reading its
weights through TMA tiles or with an eviction policy measured no faster in the step: docs/PERF_LOG.md,
2026-12-01.) Both sides are captured in CUDA graphs and replayed back to back. The head is timed as the engine runs it in a greedy step
(`head.w8a16_argmax`: the int16 quantization launch, then the head reducing its logits inside its tiles) and as
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
def _read_kernel(
    x_ptr, y_ptr, N, BLOCK: tl.constexpr, ITERS: tl.constexpr, EVICT: tl.constexpr, CACHE: tl.constexpr
):
    """Sum ITERS contiguous blocks of int32 words (the sum is stored so that the loads are not dead code)."""
    pid = tl.program_id(0)
    acc = tl.zeros([1024], tl.int32)
    base = pid.to(tl.int64) * BLOCK * ITERS
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs, mask=offs < N, other=0, eviction_policy=EVICT, cache_modifier=CACHE)
        acc += tl.sum(tl.reshape(v, [BLOCK // 1024, 1024]), axis=0)  # [BLOCK] -> [BLOCK/1024, 1024]
    tl.store(y_ptr + pid * 1024 + tl.arange(0, 1024), acc)


@triton.jit
def _read_tma_kernel(desc, y_ptr, BR: tl.constexpr, BC: tl.constexpr, ITERS: tl.constexpr):
    """The same sum over [BR, BC]-word tiles fetched by the tensor memory accelerator (a descriptor's loads,
    pipelined by the compiler through shared memory); rows past the tensor read as zeros."""
    pid = tl.program_id(0)
    acc = tl.zeros([BR, BC], tl.int32)
    for i in range(ITERS):
        acc += desc.load([(pid * ITERS + i) * BR, 0])
    tl.store(y_ptr + pid * BC + tl.arange(0, BC), tl.sum(acc, axis=0))


# (words a block, blocks a program, warps, eviction policy, cache modifier); TMA: (rows, 256-word columns,
# tiles a program, warps, pipeline stages)
READS = (
    (4096, 4, 4, "", ""),
    (8192, 4, 8, "", ""),
    (16384, 2, 8, "", ""),
    (2048, 16, 4, "", ""),
    (8192, 4, 8, "evict_first", ""),
    (8192, 4, 8, "", ".cg"),
    (16384, 4, 16, "evict_first", ""),
)
TMA_READS = ((16, 4, 4, 3), (32, 4, 4, 3), (32, 8, 4, 4), (64, 4, 8, 3))


def read_roofs_us(w: torch.Tensor) -> list[tuple[float, str]]:
    """Streaming reads of w's bytes, every variant: [(us, variant)], fastest first."""
    x = w.view(torch.int32).view(-1)  # [V*K/4] words
    n = x.numel()
    res = []
    for block, iters, warps, evict, cache in READS:
        grid = triton.cdiv(n, block * iters)
        y = torch.empty(grid * 1024, dtype=torch.int32, device=w.device)
        us = _graph_us(
            lambda g=grid, y=y, b=block, i=iters, nw=warps, e=evict, c=cache: _read_kernel[(g,)](
                x, y, n, BLOCK=b, ITERS=i, EVICT=e, CACHE=c, num_warps=nw
            ),
            REPS,
            1,
        )
        tag = (
            f"{block} words x {iters}, {warps} warps"
            + (f", {evict}" if evict else "")
            + (f", {cache}" if cache else "")
        )
        res.append((us, tag))
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # an older Triton: no TMA variants
        TensorDescriptor = None
    for br, iters, warps, stages in TMA_READS if TensorDescriptor is not None else ():
        x2 = x[: n // 256 * 256].view(-1, 256)  # [rows, 256] words
        desc = TensorDescriptor.from_tensor(x2, [br, 256])
        grid = triton.cdiv(x2.shape[0], br * iters)
        y = torch.empty(grid * 256, dtype=torch.int32, device=w.device)
        us = _graph_us(
            lambda g=grid, d=desc, y=y, b=br, i=iters, nw=warps, st=stages: _read_tma_kernel[(g,)](
                d, y, BR=b, BC=256, ITERS=i, num_warps=nw, num_stages=st
            ),
            REPS,
            1,
        )
        res.append((us, f"TMA [{br}, 256] words x {iters}, {warps} warps, {stages} stages"))
    return sorted(res)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=2560)
    args = ap.parse_args()
    from bitnetlm.kernels.triton import head as L
    from bitnetlm.kernels.triton import tune
    from bitnetlm.runtime.cuda.bench import gpu_name

    v, k = args.vocab, args.hidden
    w = torch.randint(-127, 128, (v, k), dtype=torch.int8, device="cuda")
    s = torch.rand(v, device="cuda") / 64
    nw = torch.rand(k, device="cuda").to(torch.bfloat16)
    reads = read_roofs_us(w)
    roof, shape = reads[0]
    mb = w.numel() / 1e6
    print(f"GPU: {gpu_name()}; head {v} x {k} int8 ({mb:.0f} MB)\n")
    print("| streaming read | us | GB/s |\n| --- | ---: | ---: |")
    for us, tag in reads:
        print(f"| {tag} | {us:.1f} | {mb / us * 1e3:.0f} |")
    print(f"\nread roof {roof:.1f} us ({mb / roof * 1e3:.0f} GB/s, {shape})\n")
    print(
        "| batch | tile (BM, BN, BK, warps) | quantization + head us | GB/s | of roof "
        "| head kernel alone us | of roof |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for b in (int(x) for x in args.batches.split(",")):
        h = torch.randn(b, k, dtype=torch.bfloat16, device="cuda")
        both = _graph_us(lambda h=h: L.w8a16_argmax(h, nw, 1e-5, w, s), REPS, 1)  # tunes on its warm-up
        cfg = tune._choice[("w8a16_argmax", v, k, min(triton.next_power_of_2(b), 1024))]
        launch, _ = L._argmax_launcher(*L.quantize16(h, nw, 1e-5), s, v)
        alone = _graph_us(lambda f=launch, c=cfg: f(c, w), REPS, 1)
        tile = f"{cfg['BM']}, {cfg['BN']}, {cfg['BK']}, {cfg['num_warps']}"
        print(
            f"| {b} | {tile} | {both:.1f} | {mb / both * 1e3:.0f} | {roof / both:.2f} "
            f"| {alone:.1f} | {roof / alone:.2f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
