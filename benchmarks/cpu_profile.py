"""Where a CPU step's time goes: the fused C layer step's phases, and the C kernels alone. Random weights of real
shapes; one markdown table each, naming the CPU, its kernels and the date.

    python benchmarks/cpu_profile.py                                 # both
    python benchmarks/cpu_profile.py --phases --shapes 2b4t,large --heads bf16,int8 --threads 2
    python benchmarks/cpu_profile.py --kernels --threads 1,2 [--m 1,128] [--layouts 2bit,base3 --layers 1]

--phases: a decoded token's time (tgN from an empty KV row, best of --reps runs, through the CPU runner with
torch's own ops on one thread, as `generate` runs them) split into the fused C layers, the LM head and the rest
(embedding, RoPE tables, the final norm, the argmax: Python and torch ops), each against the read bandwidth
measured before the row; then the fused layers' own phases (the C step's timers: norms, each projection with its
GB/s, RoPE + cache write, attention, the MLP middle) for that decode, a token, and for one ppN prefill, the whole
prompt; then the SiLU MLP middle's kernel alone on each instruction set.
--kernels: the ternary GEMV (decode, --m 1) and GEMM (prefill) on --layers distinct copies of the 2B4T layer's
seven projections (larger than the caches), on each instruction set and each of --layouts (the weights in 2 or
1.6 bits): ms a pass, GB/s of the weights, GMAC/s, next to the copy bandwidth at the same threads. --layers 1 keeps
the weights in the caches: the kernels' own speed, memory aside.

Speed of whole requests, and against another checkout: benchmarks/cpu.py.
"""

from __future__ import annotations

import argparse
import time

import common

# one 2B4T layer's projections (out, in): q, k, v, o, gate, up, down
LAYER = [(2560, 2560), (640, 2560), (640, 2560), (2560, 2560), (6912, 2560), (6912, 2560), (2560, 6912)]


class Timed:
    """A callable whose wall time adds up in acc[key]; other attributes are the callable's (the runner reads the
    fused step's shape and layer count)."""

    def __init__(self, fn, acc: dict, key: str):
        self.fn, self.acc, self.key = fn, acc, key

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.acc[self.key] += time.perf_counter() - t0
        return out

    def __getattr__(self, name):
        return getattr(self.fn, name)


# ---- --phases ---------------------------------------------------------------------------------------------------
def measure(model, test: str, n: int, gen) -> tuple[float, float, float, dict[str, float]]:
    """(seconds in all, in the fused layers, in the LM head, the C step's phases) of one ppN prefill or N greedy
    decode steps from an empty row, on the model's CPU runner."""
    import torch

    from bitnetlm.kernels.cpu.decode import phase_timers
    from bitnetlm.runtime import make_runner
    from bitnetlm.runtime.config import RuntimeConfig

    acc = {"layers": 0.0, "head": 0.0}
    runner = make_runner(model, RuntimeConfig(device="cpu"), 1, n)
    if runner.fused is None:
        raise SystemExit(f"cpu_profile.py: the fused step cannot run this model: {runner.why_not}")
    runner.fused = Timed(runner.fused, acc, "layers")
    head = model.lm_head
    head.forward = Timed(head.forward, acc, "head")
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()
    phase_timers(True)
    try:
        t0 = time.perf_counter()
        if test == "pp":
            runner.prefill(0, ids)
        else:
            tok = ids[0]
            for pos in range(n):
                tok = int(runner.decode([0], [tok], [pos])[0].argmax())
        total = time.perf_counter() - t0
    finally:
        inner = phase_timers(False)
        del head.forward
    return total, acc["layers"], acc["head"], inner


def proj_bytes(model) -> dict[str, int]:
    """Packed weight bytes each projection phase reads a token, all layers."""
    out = dict.fromkeys(("qkv", "o", "gate_up", "down"), 0)
    for blk in model.layers:
        a, f = blk.self_attn, blk.mlp
        out["qkv"] += sum(getattr(a, p).packed.numel() for p in ("q_proj", "k_proj", "v_proj"))
        out["o"] += a.o_proj.packed.numel()
        out["gate_up"] += f.gate_proj.packed.numel() + f.up_proj.packed.numel()
        out["down"] += f.down_proj.packed.numel()
    return out


def inner_row(label: list, per: int, lay: float, inner: dict, pb: dict | None) -> list:
    """A row of the phases table: ms of each phase over `per` (tokens), a projection's also as GB/s of its packed
    weights `pb` (decode: each token reads them all once)."""
    from bitnetlm.kernels.cpu.decode import PHASES

    cells = []
    for p in PHASES:
        s = inner[p] / per
        gbs = f" ({pb[p] / s / 1e9:.1f} GB/s)" if pb and p in pb and s > 0 else ""
        cells.append(f"{s * 1e3:.2f}{gbs}")
    return [*label, f"{lay / per * 1e3:.2f}", *cells, f"{(lay - sum(inner.values())) / per * 1e3:.2f}"]


def phase_rows(model, args, nt: int, label: list, gen) -> tuple[list, list]:
    """The split of a decoded token (one row) and the fused layers' phases for tgN and ppN (two rows)."""
    from bitnetlm.kernels import configure_threads
    from bitnetlm.quant.bitlinear import BitLinear

    configure_threads(model, nt)
    measure(model, "tg", 8, gen)  # warm-up
    read = common.read_bandwidth(nt)
    tg = min((measure(model, "tg", args.tg, gen) for _ in range(args.reps)), key=lambda r: r[0])
    pp = min((measure(model, "pp", args.pp, gen) for _ in range(args.reps)), key=lambda r: r[0])
    tern = sum(m.packed.numel() for m in model.modules() if isinstance(m, BitLinear))
    headb = model.lm_head.nbytes()
    step, lay, head = (v / args.tg for v in tg[:3])
    split = [*label, f"{read:.1f}", f"{step * 1e3:.2f}", f"{lay * 1e3:.2f}", f"{tern / lay / 1e9:.1f}"]
    split += [f"{head * 1e3:.2f}", f"{headb / head / 1e9:.1f}", f"{(step - lay - head) * 1e3:.2f}"]
    pb = proj_bytes(model)
    inner = [inner_row([*label, f"tg{args.tg}, a token"], args.tg, tg[1], tg[3], pb)]
    inner.append(inner_row([*label, f"pp{args.pp}, the prompt"], 1, pp[1], pp[3], None))
    return split, inner


def phases_tables(args) -> None:
    import torch
    from cpu import details, set_head  # benchmarks/cpu.py

    from bitnetlm import bench
    from bitnetlm.kernels.cpu.decode import PHASES

    gen = torch.Generator().manual_seed(0)
    la = details(",".join(map(str, args.threads)))
    split, inner = [], []
    for shape in args.shapes:
        model = bench.random_model(shape, head_dtype=args.heads[0])
        for head in args.heads:
            set_head(model, head)
            for nt in args.threads:
                a, b = phase_rows(model, args, nt, [shape, head, nt], gen)
                split.append(a)
                inner += b
        del model
    common.header(
        "Where a decoded token's time goes",
        details=f"{la} tg{args.tg} from an empty KV row, best of {args.reps} runs; ms a token.",
    )
    cols = ["shape", "head", "threads", "read GB/s", "ms / token", "fused layers ms", "their GB/s"]
    cols += ["LM head ms", "its GB/s", "rest ms"]
    print(common.table(cols, split, [False, False] + [True] * 8))
    common.header(
        "Inside the fused layers: the C step's phase timers",
        details="The same runs; the calling thread's wall time over every layer; a projection's time includes its "
        "input's quantization, and its GB/s (decode) are its packed weights over that time.",
    )
    cols = ["shape", "head", "threads", "test", "fused layers ms", *(f"{p} ms" for p in PHASES), "untimed ms"]
    print(common.table(cols, inner, [False, False, True, False] + [True] * (len(PHASES) + 2)), flush=True)


def silu_table(reps: int = 2000) -> None:
    """The SiLU MLP middle of the fused step (bn_silu_mul_f32) on one token's row, on each instruction set."""
    import torch

    from bitnetlm.kernels import cpu

    lib = cpu._lib.load()
    rows = []
    for n in (4096, 6912):
        g, u, y = torch.randn(n) * 4, torch.randn(n), torch.empty(n)
        for isa in cpu.supported_isas():

            def calls(args=(g.data_ptr(), u.data_ptr(), y.data_ptr(), n)):
                for _ in range(reps):
                    lib.bn_silu_mul_f32(*args)

            with cpu.use_isa(isa):
                rows.append([n, isa, f"{common.best_seconds(calls, 3) / reps * 1e6:.2f}"])
    common.header(
        "The SiLU MLP middle alone, silu(g) * u (bn_silu_mul_f32)", details=f"Best of 3 x {reps} calls."
    )
    print(common.table(["elements", "kernels", "us / call"], rows, [True, False, True]), flush=True)


# ---- --kernels --------------------------------------------------------------------------------------------------
def kernels_table(args) -> None:
    import torch

    from bitnetlm import bench
    from bitnetlm.kernels import cpu
    from bitnetlm.kernels.cpu import ops

    gen = torch.Generator().manual_seed(0)
    two = [(bench.random_packed(n, k, cpu.BACKEND, gen), n, k) for _ in range(args.layers) for n, k in LAYER]
    by_layout = {"2bit": two}
    if "base3" in args.layouts:
        b3 = cpu.BACKEND_BASE3
        by_layout["base3"] = [(b3.repack(p, cpu.BACKEND.layout, (n, k)), n, k) for p, n, k in two]
    macs = sum(n * k for _, n, k in two)
    s, rows = torch.tensor([1.0]), []
    for nt in args.threads:
        copy = common.copy_bandwidth(nt)
        cpu.set_num_threads(nt)
        for isa in reversed(cpu.supported_isas()):
            for m in args.m:
                if isa == "scalar" and m > 1:
                    continue  # minutes a pass
                xs = {k: torch.randn(m, k, generator=gen) for k in (2560, 6912)}
                for name in args.layouts:  # adjacent rows: the layouts one after the other
                    mats, code = by_layout[name], cpu.WEIGHTS_LAYOUTS[name].code

                    def one_pass(xs=xs, mats=mats, code=code):
                        for p, n, k in mats:
                            ops.ternary_linear(xs[k], p, s, n, code)

                    with cpu.use_isa(isa):
                        t = common.best_seconds(one_pass, args.reps)
                    nbytes = sum(p.numel() for p, _, _ in mats)
                    rows.append([isa, name, nt, m, f"{t * 1e3:.1f}", f"{nbytes / t / 1e9:.2f}"])
                    rows[-1] += [f"{m * macs / t / 1e9:.1f}", f"{copy:.1f}"]
    nbytes = ", ".join(f"{sum(p.numel() for p, _, _ in v) / 1e6:.0f} MB {k}" for k, v in by_layout.items())
    common.header(
        "Ternary GEMV / GEMM alone, 2B4T projections",
        details=f"{args.layers} x 7 matrices, {nbytes} packed; best of {args.reps} passes; "
        "tokens 1 is a decode's GEMV, more a prefill's GEMM.",
    )
    cols = ["kernels", "weights", "threads", "tokens", "ms / pass", "weight GB/s", "GMAC/s"]
    cols.append("copy GB/s (read + write)")
    print(common.table(cols, rows, [False, False] + [True] * 6), flush=True)


# ---- command line -----------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", action="store_true", help="the fused step's phases (default: both tables)")
    ap.add_argument("--kernels", action="store_true", help="the GEMV / GEMM alone (default: both tables)")
    ap.add_argument("--threads", type=common.int_list, default=None, help="kernel threads (default: cores)")
    ap.add_argument("--reps", type=int, default=3, help="runs a row (best)")
    ap.add_argument("--shapes", type=common.str_list, default=["2b4t", "large"], help="--phases: 2b4t, large")
    ap.add_argument("--heads", type=common.str_list, default=["bf16", "int8"], help="--phases: bf16, int8")
    ap.add_argument("--tg", type=int, default=64, help="--phases: decode steps a run (default 64)")
    ap.add_argument(
        "--pp", type=int, default=128, help="--phases: prompt tokens of the prefill (default 128)"
    )
    ap.add_argument("--m", type=common.int_list, default=[1, 128], help="--kernels: tokens a call")
    ap.add_argument("--layers", type=int, default=8, help="--kernels: copies of the layer (8 x 17 MB)")
    ap.add_argument(
        "--layouts", type=common.str_list, default=["2bit"], help="--kernels: weights 2bit, base3 (1.6 bits)"
    )
    args = ap.parse_args(argv)
    for flag, have, known in (
        ("--shapes", args.shapes, ("2b4t", "large")),
        ("--heads", args.heads, ("bf16", "int8")),
        ("--layouts", args.layouts, ("2bit", "base3")),
    ):
        if not have or set(have) - set(known):
            ap.error(f"{flag} {','.join(have)}: choose from {', '.join(known)}")
    for flag, v in (("--threads", args.threads), ("--m", args.m)):
        if v is not None and (not v or min(v) < 1):
            ap.error(f"{flag} takes counts >= 1, found {v}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    common.use_checkout()
    from bitnetlm.kernels import cpu

    if not cpu.available():
        raise SystemExit(
            "cpu_profile.py: the C kernels are not built here (python setup.py build_ext --inplace)"
        )
    args.threads = args.threads or [cpu.physical_cores()]
    both = not (args.phases or args.kernels)
    if args.phases or both:
        phases_tables(args)
        silu_table()
    if args.kernels or both:
        kernels_table(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
