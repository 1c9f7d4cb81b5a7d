"""What one kernel boundary costs in a CUDA-graph chain of dependent kernels (device machine).

    python benchmarks/gpu_sync_chain.py [--grids 1,80,132,240,432] [--chain 180] [--k 2560] [--warps 4]

A batch-1 decode step is about 180 dependent kernels (six a layer), each doing little work, so the time from one
kernel's last store to the next kernel's first dependent load decides the step. Each kernel here has G programs;
every program reads the whole previous vector (K floats, what a GEMV reads of its input), sums it, and writes
its 1/G slice of the next vector (slice * 0.5 + sum * 1e-9), so every kernel depends on all of the previous one.
The chain runs in one CUDA graph; the table gives microseconds per kernel for each way of waiting:

- plain: ordinary launches; a kernel starts after the previous one has finished.
- pdl: programmatic dependent launch as the engine uses it (`common._pdl_wait`): the next kernel may launch once
  every program of this one has started, and `gdc_wait` holds it until this grid has finished and its writes
  are visible.
- flag: PDL launch, but the wait is a spin on a counter that each program of the previous kernel increments
  (release, GPU scope) after its stores; the consumer goes on (acquire) when the last producer program has
  stored, before the producer grid has drained. The next kernel may launch once this one's wait is over.
- flag-early: as flag, with the next kernel allowed to launch before the spin (as `pdl` does before its wait).
- persist: no chain of kernels but one persistent kernel of G programs (at most one wave) running the `chain`
  links in a loop, with a grid barrier between links: each program increments one counter (release, GPU scope)
  after its stores and spins (acquire) until every program has, so the cost is the barrier alone, no launch.
- persist-ld: as persist, the spin polling with `ld.acquire.gpu` instead of an atomic read-modify-write.

Every mode's final vector must equal plain's: a wrong wait shows up as a mismatch, printed in the table.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("plain", "pdl", "flag", "flag-early", "persist", "persist-ld")


@triton.jit
def _link(
    x_ptr, y_ptr, cin_ptr, cout_ptr, expect, K, SLICE: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr
):
    pid = tl.program_id(0)
    if MODE == 1:
        gdc_launch_dependents()
        gdc_wait()
    if MODE >= 2:
        if MODE == 3:
            gdc_launch_dependents()
        c = tl.atomic_add(cin_ptr, 0, sem="acquire")
        while c < expect:
            c = tl.atomic_add(cin_ptr, 0, sem="acquire")
        if MODE == 2:
            gdc_launch_dependents()
    offs = tl.arange(0, BK)
    # plain loads, as the engine's kernels make: if a flag wait let an SM read a stale L1 line left by an
    # earlier kernel of the chain (the two buffers alternate), the result check below shows it
    s = tl.sum(tl.load(x_ptr + offs, mask=offs < K, other=0.0), axis=0)
    so = pid * SLICE + tl.arange(0, SLICE)
    ms = so < K
    xs = tl.load(x_ptr + so, mask=ms, other=0.0)
    tl.store(y_ptr + so, xs * 0.5 + s * 1e-9, mask=ms)
    if MODE >= 2:
        tl.debug_barrier()  # every thread's stores before the one release
        tl.atomic_add(cout_ptr, 1, sem="release")


@triton.jit
def _ld_acquire(ptr):
    """The counter through `ld.acquire.gpu` (a load, not an atomic read-modify-write at L2)."""
    return tl.inline_asm_elementwise(
        "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _persist(x_ptr, ctr_ptr, K, CHAIN, SLICE: tl.constexpr, BK: tl.constexpr, LD: tl.constexpr):
    """`CHAIN` links of `_link` in one launch: x_ptr holds both vectors [2K]; a grid barrier between links."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    offs = tl.arange(0, BK)
    so = pid * SLICE + tl.arange(0, SLICE)
    ms = so < K
    for i in range(CHAIN):
        src = x_ptr + (i % 2) * K
        dst = x_ptr + ((i + 1) % 2) * K
        s = tl.sum(tl.load(src + offs, mask=offs < K, other=0.0), axis=0)
        xs = tl.load(src + so, mask=ms, other=0.0)
        tl.store(dst + so, xs * 0.5 + s * 1e-9, mask=ms)
        tl.debug_barrier()  # every thread's stores before the one release
        tl.atomic_add(ctr_ptr, 1, sem="release")
        target = (i + 1) * grid
        if LD:
            c = _ld_acquire(ctr_ptr)
            while c < target:
                c = _ld_acquire(ctr_ptr)
        else:
            c = tl.atomic_add(ctr_ptr, 0, sem="acquire")
            while c < target:
                c = tl.atomic_add(ctr_ptr, 0, sem="acquire")


def run_chain(
    mode: int, grid: int, chain: int, k: int, warps: int, reps: int = 100
) -> tuple[float, torch.Tensor]:
    """(us per kernel, the final vector) of a `chain`-kernel graph in `mode` with `grid` programs a kernel."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    bufs = [torch.randn(k, device="cuda", generator=gen), torch.empty(k, device="cuda")]
    x0 = bufs[0].clone()
    ctr = torch.zeros(chain + 1, dtype=torch.int32, device="cuda")
    ctr_start = torch.full((1,), grid, dtype=torch.int32, device="cuda")  # the first kernel's producer: done
    sl = triton.next_power_of_2(triton.cdiv(k, grid))
    kw = {"launch_pdl": True} if mode else {}

    if mode >= 4:  # one persistent launch: both vectors in one buffer
        buf = torch.empty(2 * k, device="cuda")
        bufs = [buf[:k], buf[k:]]

    def body():
        bufs[0].copy_(x0)
        if mode >= 4:
            ctr.zero_()
            _persist[(grid,)](
                buf, ctr, k, chain, SLICE=sl, BK=triton.next_power_of_2(k), LD=mode == 5, num_warps=warps
            )
            return
        if mode >= 2:
            ctr.zero_()
        for i in range(chain):
            cin = ctr_start if i == 0 else ctr[i - 1 :]
            _link[(grid,)](
                bufs[i % 2],
                bufs[(i + 1) % 2],
                cin,
                ctr[i:],
                grid,
                k,
                SLICE=sl,
                BK=triton.next_power_of_2(k),
                MODE=mode,
                num_warps=warps,
                **kw,
            )

    from bitnetlm.kernels.triton.tune import _replay_ms
    from bitnetlm.runtime.cuda.engine import capture

    g, _ = capture(body)  # compiled and warmed up eagerly first
    for _ in range(10):
        g.replay()
    return _replay_ms(g, reps) / reps / chain * 1e3, bufs[chain % 2].clone()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--grids", default="1,80,132,240,432", help="programs a kernel (the batch-1 engine's: 80-432)"
    )
    ap.add_argument(
        "--chain", type=int, default=180, help="kernels in the graph (a 30-layer batch-1 step: 180)"
    )
    ap.add_argument("--k", type=int, default=2560, help="floats each program reads")
    ap.add_argument("--warps", type=int, default=4)
    args = ap.parse_args()
    p = torch.cuda.get_device_properties(0)
    print(
        f"GPU: {p.name} ({p.multi_processor_count} SMs), torch {torch.__version__}, triton {triton.__version__}; "
        f"chain of {args.chain} kernels, each program reading {args.k} floats, {args.warps} warps\n"
    )
    print("| programs | " + " | ".join(f"{m} us/kernel" for m in MODES) + " | flag / pdl |")
    print("| ---: | " + " | ".join("---:" for _ in MODES) + " | ---: |")
    sms = p.multi_processor_count
    for grid in (int(g) for g in args.grids.split(",")):
        cells, ref, us = [], None, {}
        for mode, name in enumerate(MODES):
            if mode >= 4 and grid > sms:  # a grid barrier needs every program resident: one wave
                cells.append("-")
                continue
            t, y = run_chain(mode, grid, args.chain, args.k, args.warps)
            us[name] = t
            if ref is None:
                ref = y
            ok = torch.equal(y, ref)
            cells.append(f"{t:.2f}" + ("" if ok else " (WRONG RESULT)"))
        print(f"| {grid} | " + " | ".join(cells) + f" | {us['flag'] / us['pdl']:.2f}x |", flush=True)
    print("\npersist: one launch, grid barriers between the links (only grids up to the SM count)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
