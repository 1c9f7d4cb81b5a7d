#!/usr/bin/env python3
"""Where a CPU decode step spends its time: LM head kernel alone, one full step, torch ops by profiler,
under different torch / kernel thread settings. Random 2B4T-shaped weights.

    python benchmarks/cpu_profile.py --layers 30 --threads 2
    python benchmarks/cpu_profile.py --phases 2b4t,large --heads bf16,int8 --threads 2

--phases: a decoded token's time split into the fused C layers, the LM head and the rest (embedding, RoPE
tables, the final norm, argmax: Python and torch ops), each against the read bandwidth measured before the row;
then the fused layers' own phases (the C step's timers: norms, each projection with its GB/s, RoPE + cache
write, attention, the MLP middle); then the SiLU middle's kernel time per call on each instruction-set path.
--profile-prefill: one prefill of --pp tokens under the torch profiler, then the fused C layers' phase timers
over it (norms, each projection, RoPE, attention, the MLP middle).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bitnetlm import bench  # noqa: E402
from bitnetlm.kernels import cpu  # noqa: E402
from bitnetlm.kernels.cpu import ops  # noqa: E402


def step_time(model, torch_threads: int, n: int = 16) -> float:
    torch.set_num_threads(torch_threads)
    cache = model.new_cache(1, n + 4)
    tok = torch.tensor([[7]])
    with torch.inference_mode():
        for pos in range(2):
            model(tok, positions=torch.tensor([[pos]]), cache=cache)
        t0 = time.perf_counter()
        for pos in range(2, n + 2):
            model(tok, positions=torch.tensor([[pos]]), cache=cache)
    return (time.perf_counter() - t0) / n


@contextlib.contextmanager
def _timed(acc: dict):
    """Accumulate the wall time of the fused layers' C call and of the LM head into acc."""
    from bitnetlm.kernels.cpu.decode import FusedDecode
    from bitnetlm.kernels.cpu.head import CompactHead

    saved = FusedDecode.__call__, CompactHead.forward

    def wrap(fn, key):
        def timed(*args):
            t0 = time.perf_counter()
            out = fn(*args)
            acc[key] += time.perf_counter() - t0
            return out

        return timed

    FusedDecode.__call__, CompactHead.forward = wrap(saved[0], "layers"), wrap(saved[1], "head")
    try:
        yield
    finally:
        FusedDecode.__call__, CompactHead.forward = saved


def phases(shapes: list[str], heads: list[str], threads: int, n: int = 64, reps: int = 3) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cpu_decode import read_bandwidth, weight_bytes_per_token

    from bitnetlm.kernels import configure_threads
    from bitnetlm.kernels.cpu.decode import PHASES, phase_timers

    dev = torch.device("cpu")
    inside = []
    print(f"machine: {bench.machine_name()}; {threads} threads; tg{n} from an empty cache, best of {reps}\n")
    print(
        "| shape | head | read GB/s | ms/token | fused layers ms | their GB/s | LM head ms | its GB/s | rest ms |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for shape in shapes:
        for hd in heads:
            model = bench.random_model(shape, head_dtype=hd)
            tern, headb = weight_bytes_per_token(model)
            # torch at 1 thread beside the kernels' pool, as the CLI sets it
            configure_threads(model, threads)
            gen = torch.Generator().manual_seed(0)
            bench.time_decode(model, 8, dev, model.config.vocab_size, gen)
            best = None
            read = read_bandwidth(threads)
            for _ in range(reps):
                acc = {"layers": 0.0, "head": 0.0}
                phase_timers(True)
                with _timed(acc):
                    total = bench.time_decode(model, n, dev, model.config.vocab_size, gen)
                inner = phase_timers(False)
                row = (total / n, acc["layers"] / n, acc["head"] / n, inner)
                best = row if best is None or row[0] < best[0] else best
            step, lay, head, inner = best
            print(
                f"| {shape} | {hd} | {read:.1f} | {step * 1e3:.2f} | {lay * 1e3:.2f} | {tern / lay / 1e9:.1f} | "
                f"{head * 1e3:.2f} | {headb / head / 1e9:.1f} | {(step - lay - head) * 1e3:.2f} |",
                flush=True,
            )
            inside.append((shape, hd, lay, inner, _proj_bytes(model)))
            del model
    # inside the fused layers: the C step's own phase timers (the calling thread's wall time, all layers)
    print("\n| shape | head | fused layers ms | " + " | ".join(f"{p} ms" for p in PHASES) + " | untimed ms |")
    print("| --- | --- | ---: | " + " | ".join("---:" for _ in PHASES) + " | ---: |")
    for shape, hd, lay, inner, pb in inside:
        cells = []
        for p in PHASES:
            ms = inner[p] / n * 1e3
            gbs = f" ({pb[p] / (inner[p] / n) / 1e9:.1f} GB/s)" if p in pb and inner[p] > 0 else ""
            cells.append(f"{ms:.2f}{gbs}")
        rest = (lay - sum(inner.values()) / n) * 1e3
        print(f"| {shape} | {hd} | {lay * 1e3:.2f} | " + " | ".join(cells) + f" | {rest:.2f} |", flush=True)


def _proj_bytes(model) -> dict[str, int]:
    """Packed weight bytes each projection phase reads per token, all layers."""
    out = dict.fromkeys(("qkv", "o", "gate_up", "down"), 0)
    for blk in model.layers:
        a, f = blk.self_attn, blk.mlp
        out["qkv"] += sum(getattr(a, p).packed.numel() for p in ("q_proj", "k_proj", "v_proj"))
        out["o"] += a.o_proj.packed.numel()
        out["gate_up"] += f.gate_proj.packed.numel() + f.up_proj.packed.numel()
        out["down"] += f.down_proj.packed.numel()
    return out


def silu_table(sizes=(4096, 6912), reps: int = 2000) -> None:
    """The SiLU MLP middle of the fused step (bn_silu_mul_f32) on one token's intermediate row, per ISA path."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cpu_decode import _best_seconds

    from bitnetlm.kernels.cpu import _lib

    lib = _lib.load()
    print("\n| SiLU middle, silu(g) * u | elements | isa | us / call |")
    print("| --- | ---: | --- | ---: |")
    for n in sizes:
        g, u, y = torch.randn(n) * 4, torch.randn(n), torch.empty(n)
        for isa in (None, "scalar"):

            def calls(args=(g.data_ptr(), u.data_ptr(), y.data_ptr(), n)):
                for _ in range(reps):
                    lib.bn_silu_mul_f32(*args)

            with cpu.use_isa(isa):
                best = _best_seconds(calls, 3) / reps
            print(f"| bn_silu_mul_f32 | {n} | {isa or cpu.get_isa()} | {best * 1e6:.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--pp", type=int, default=128)
    ap.add_argument("--profile-prefill", action="store_true")
    ap.add_argument("--phases", default="", help="comma-separated shapes (2b4t, large): the phase table only")
    ap.add_argument("--heads", default="bf16,int8", help="LM heads for --phases")
    a = ap.parse_args()
    if a.phases:
        phases(a.phases.split(","), a.heads.split(","), a.threads)
        silu_table()
        return 0
    print(f"machine: {bench.machine_name()}; {a.threads} kernel threads")
    cfg = dict(arch="bitnet", num_hidden_layers=a.layers)
    model = bench.random_model(cfg, "bf16")
    cpu.set_num_threads(a.threads)
    w = model.compact_head.weight
    x = torch.randn(1, w.shape[1])
    from bitnetlm.kernels.cpu.head import quantize_rows_int8

    q, s = quantize_rows_int8(w)
    for name, f in (
        ("bf16 head", lambda: ops.gemm_float(x, w)),
        ("int8 head", lambda: ops.gemm_i8row(x, q, s)),
    ):
        f()
        t0 = time.perf_counter()
        for _ in range(5):
            f()
        dt = (time.perf_counter() - t0) / 5
        nb = w.numel() * (2 if "bf16" in name else 1)
        print(f"{name}: {dt * 1e3:.1f} ms, {nb / dt / 1e9:.1f} GB/s")
    for tt in (1, a.threads):
        print(
            f"decode step, torch threads {tt}, kernel threads {a.threads}: {step_time(model, tt) * 1e3:.1f} ms"
        )
    for tt in (1, a.threads):
        torch.set_num_threads(tt)
        gen = torch.Generator().manual_seed(0)
        dev = torch.device("cpu")
        bench.time_prefill(model, 16, dev, model.config.vocab_size, gen)
        dt = min(bench.time_prefill(model, a.pp, dev, model.config.vocab_size, gen) for _ in range(2))
        print(f"prefill {a.pp} tokens, torch threads {tt}: {dt * 1e3:.0f} ms = {a.pp / dt:.1f} tok/s")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        torch.set_num_threads(1)
        cache = model.new_cache(1, 16)
        tok = torch.tensor([[7]])
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
            for pos in range(4):
                model(tok, positions=torch.tensor([[pos]]), cache=cache)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    if a.profile_prefill:
        from torch.profiler import ProfilerActivity, profile

        torch.set_num_threads(1)
        ids = torch.randint(0, model.config.vocab_size, (1, a.pp))
        cache = model.new_cache(1, a.pp)
        from bitnetlm.kernels.cpu.decode import PHASES, phase_timers

        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
            phase_timers(True)
            t0 = time.perf_counter()
            model(ids, cache=cache, last_only=True)
            wall = time.perf_counter() - t0
            inner = phase_timers(False)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        print(f"prefill wall {wall * 1e3:.0f} ms (C kernel time is the part the profiler does not list)")
        # the fused C layers' own phase timers over that prefill (the calling thread's wall time, all layers)
        print("| " + " | ".join(f"{ph} ms" for ph in PHASES) + " | outside the phases ms |")
        print("| " + " | ".join("---:" for _ in PHASES) + " | ---: |")
        cells = " | ".join(f"{inner[ph] * 1e3:.0f}" for ph in PHASES)
        print(f"| {cells} | {(wall - sum(inner.values())) * 1e3:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
