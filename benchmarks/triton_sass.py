"""What the decode kernels compile to, without a GPU: a kernel built for sm_90 by the installed Triton at its
2B4T configuration, disassembled with Triton's own cuobjdump: registers, shared memory, spills, and what runs
after the kernel's programmatic-dependent-launch wait (`griddepcontrol.wait`, SASS `ACQBULK`), where a small-batch
step's latency is: barriers (each block-wide reduction or layout conversion through shared memory costs one or
two), shuffles, shared-memory and global traffic.

    python benchmarks/triton_sass.py [--kernel attn|o_row|down_row|gateup_rowq|qkv_row|quant|o_splitk8|gateup_pair8
        |finish_o|finish_gateup|head ...]
        [--cache fp8|bf16] [--warps W] [--stages S] [--maxnreg R] [--constexpr NAME=VALUE ...]

`attn` (the default) also prints the instructions of the K/V block loop (one 64-key block, batch 64's shape). The
row kernels are batch 1's shipped tiles on the H200 (`kernels/triton/configs/`), the split-K GEMMs batch 8's
(o: 5 splits; gate|up: paired, 2 splits; down is o's kernel); `--constexpr` overrides a
kernel's constexprs (a branch's switch), `--warps` its warps. Counts depend on the Triton version (the H200
measurements in docs/PERF_LOG.md used 3.6: `pip install triton==3.6.0` in a venv).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROW_PTRS = dict(
    x_ptr="*bf16",
    nw_ptr="*bf16",
    q_ptr="*i32",
    a_ptr="*fp32",
    rs_ptr="*i32",
    w_ptr="*i32",
    s_ptr="*fp32",
    r_ptr="*bf16",
    y_ptr="*bf16",
)
ROW_DIV = ("N", "K", "KW", "stride_xm", "stride_qw", "stride_rm", "stride_ym")
ROW = dict(PER_ROW=True, PTX=True, PDL=True, ACT=0)


def kernels(cache: str) -> dict[str, tuple]:
    """name -> (module, kernel name, pointer types, ints divisible by 16, constexprs, default warps)."""
    kv = "*fp8e4nv" if cache == "fp8" else "*bf16"
    attn_ptrs = dict(q_ptr="*bf16", k_ptr=kv, v_ptr=kv, pos_ptr="*i32", o_ptr="*bf16", pacc_ptr="*fp32")
    attn_ptrs.update(pml_ptr="*fp32", cnt_ptr="*i32", pf_ptr="*u8")
    attn = dict(
        G=4, GP=16, GM=4, D=128, BS=64, NS2=1, IEEE=False, PTX=True, PDL=True, KV8=cache == "fp8", LATE=True
    )
    quant_ptrs = dict(x_ptr="*bf16", nw_ptr="*bf16", q_ptr="*i8", a_ptr="*fp32", rs_ptr="*i32")
    qkv_ptrs = dict(ROW_PTRS, qo_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i32")
    qkv_ptrs.update(kc_ptr=kv, vc_ptr=kv)
    qkv = dict(PER_ROW=True, PTX=True, D=128, BN=16, KWP=256, PDL=True, KV_SAME=False, PREQ=False)
    qkv.update(HAS_NORM=True, EARLY_NORM=True)
    row = dict(ROW, PREQ=False, HAS_NORM=True, HAS_RES=True, GATED=False, BN=32)
    mma_ptrs = dict(q_ptr="*i8", a_ptr="*fp32", rs_ptr="*i32", w_ptr="*u8", s_ptr="*fp32", r_ptr="*bf16")
    mma_ptrs.update(y_ptr="*bf16", ws_ptr="*i32", cnt_ptr="*i32")
    mma_div = ("N", "KP", "stride_qm", "stride_rm", "stride_ym")
    mma = dict(
        ROW, BM=16, BN=64, BKB=128, GROUP_M=0, SWAP=True, PAIR=False, GATED=False, HAS_RES=True, SPLIT=5
    )
    # a deferred projection's finishing quantization launch (deferred.py): batch 8's o (5 splits) and gate|up
    finish_ptrs = dict(acc_ptr="*i32", ain_ptr="*fp32", rsin_ptr="*i32", s_ptr="*fp32", r_ptr="*bf16")
    finish_ptrs.update(y_ptr="*bf16", nw_ptr="*bf16", q_ptr="*i8", a_ptr="*fp32", rs_ptr="*i32")
    finish_div = ("N", "KPAD", "stride_acc", "stride_rm", "stride_ym", "stride_qm")
    finish = dict(ROW, GATED=False, HAS_RES=True, HAS_NORM=True, QUANT=True, BK=4096)
    # the int8 head at batch 1's tile, reducing its logits in its tiles (ARGMAX); FOLD=1: the greedy step folded in
    head_ptrs = dict(hi_ptr="*i8", lo_ptr="*i8", a_ptr="*fp32", w_ptr="*i8", s_ptr="*fp32", y_ptr="*fp32")
    head_ptrs.update(yi_ptr="*i32", best_ptr="*u64", cnt_ptr="*i32", tok_ptr="*i64", out_ptr="*i64")
    head_ptrs.update(step_ptr="*i64", pos_ptr="*i32")
    head = dict(BM=16, BN=64, BK=128, PDL=True, ARGMAX=True)
    return {
        "attn": ("attention", "_attn_gqa_kernel", attn_ptrs, (), attn, 4),
        "head": ("gemm", "_w8a16_kernel", head_ptrs, ("N", "K", "stride_qm"), head, 4),
        "o_splitk8": ("gemm", "_gemm_kernel", mma_ptrs, mma_div, mma, 4),
        "gateup_pair8": (
            "gemm",
            "_gemm_kernel",
            mma_ptrs,
            mma_div,
            dict(mma, GATED=True, PAIR=True, HAS_RES=False, SPLIT=2),
            4,
        ),
        "o_row": ("gemv", "_gemv_row_kernel", ROW_PTRS, ROW_DIV, dict(row, KWP=256, EARLY_NORM=True), 8),
        # down: 16 + 4 rows a program (`launch._row_tiles` on 132 SMs)
        "down_row": (
            "gemv",
            "_gemv_row_kernel",
            ROW_PTRS,
            ROW_DIV,
            dict(row, BN=16, BN2=4, KWP=512, EARLY_NORM=False),
            8,
        ),
        "gateup_rowq": (
            "gemv",
            "_gemv_row_kernel",
            ROW_PTRS,
            ROW_DIV,
            dict(
                ROW,
                PREQ=True,
                HAS_NORM=True,
                HAS_RES=False,
                GATED=True,
                BN=8,
                KWP=128,
                KWB=32,
                EARLY_NORM=False,
            ),
            4,
        ),
        "qkv_row": (
            "decode",
            "_qkv_rope_kernel",
            qkv_ptrs,
            ("N", "KW", "K", "stride_xm", "stride_qw", "S"),
            qkv,
            8,
        ),
        "finish_o": ("quant", "_finish_quant_kernel", finish_ptrs, finish_div, finish, 8),
        "finish_gateup": (
            "quant",
            "_finish_quant_kernel",
            finish_ptrs,
            finish_div,
            dict(finish, GATED=True, HAS_RES=False, BK=8192),
            16,
        ),
        "quant": (
            "quant",
            "_quant_kernel",
            quant_ptrs,
            ("K", "KPAD", "stride_xm", "stride_qm"),
            dict(HAS_NORM=True, PTX=True, BK=4096, PDL=True),
            16,
        ),
    }


def loop_ops(ins: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(address, instruction) of the body of the first backward branch's loop."""
    for a, t in ins:
        m = re.search(r"BRA\s+.*?0x([0-9a-f]+)", t)
        if "BRA" in t and m and int(m.group(1), 16) < a:
            return [x for x in ins if int(m.group(1), 16) <= x[0] <= a]
    return []


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def build(name: str, spec: tuple, warps: int, stages: int, overrides: dict, maxnreg: int = 0) -> None:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, fn_name, ptrs, div, const, default_warps = spec
    fn = getattr(importlib.import_module(f"bitnetlm.kernels.triton.{module}"), fn_name)
    params = inspect.signature(fn.fn).parameters
    names = list(params)
    const = dict(const, **{k: v for k, v in overrides.items() if k in names})
    for n, p in params.items():  # the other constexprs at their defaults
        if n not in const and "constexpr" in str(p.annotation) and p.default is not inspect.Parameter.empty:
            const[n] = p.default.value if hasattr(p.default, "value") else p.default
    sig = {
        n: "constexpr" if n in const else ptrs.get(n, "fp32" if n in ("eps", "sm_scale") else "i32")
        for n in names
    }
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*") or n in div
    }
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    opts = dict(num_warps=warps or default_warps, **({"num_stages": stages} if stages else {}))
    if maxnreg:
        opts["maxnreg"] = maxnreg
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    path = f"/tmp/bitnetlm_{name}.cubin"
    with open(path, "wb") as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    res = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    ins = [
        (int(m.group(1), 16), m.group(2).strip())
        for m in (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?);", line) for line in sass.splitlines())
        if m
    ]
    ops = [opcode(t) for _, t in ins]
    wait = next((i for i, o in enumerate(ops) if o.startswith("ACQBULK")), 0)
    post = collections.Counter(o.split(".")[0] for o in ops[wait:])
    stack = re.search(r"STACK:(\d+)", res)
    regs = re.search(r"REG:(\d+)", res).group(1)
    print(
        f"## {name}: {fn_name} for sm_90, Triton {triton.__version__}, {opts['num_warps']} warps, constexprs {const}\n"
    )
    print(
        f"registers a thread: {regs}; shared memory a program: "
        f"{k.metadata.shared} bytes; stack (spills) a thread: {stack.group(1) if stack else '?'} bytes; "
        f"{len(ops)} instructions, {len(ops) - wait} after the PDL wait\n"
    )
    print("| after the wait | count |\n| --- | ---: |")
    for op in ("BAR", "SHFL", "STS", "LDS", "LDG", "STG", "ATOMG", "RED"):
        print(f"| {op} | {post[op]} |")
    if name == "attn":
        body = loop_ops(ins)
        print(f"\ninstructions a warp in the K/V block loop (one {const['BS']}-key block): {len(body)}\n")
        print("| instruction | count |\n| --- | ---: |")
        for op, n in collections.Counter(opcode(t) for _, t in body).most_common(16):
            print(f"| {op} | {n} |")
    print()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--kernel",
        nargs="*",
        default=["attn"],
        help="attn, o_row, down_row, gateup_rowq, qkv_row, quant, o_splitk8, gateup_pair8, finish_o, finish_gateup; all",
    )
    ap.add_argument("--cache", default="fp8", choices=["fp8", "bf16"])
    ap.add_argument("--warps", type=int, default=0, help="0: the kernel's shipped warps")
    ap.add_argument("--stages", type=int, default=0, help="software-pipeline stages (0: Triton's default)")
    ap.add_argument(
        "--maxnreg", type=int, default=0, help="registers a thread at most (0: the compiler's choice)"
    )
    ap.add_argument(
        "--constexpr", nargs="*", default=[], help="kernel constexprs, NAME=INT (a branch's switch)"
    )
    a = ap.parse_args()
    table = kernels(a.cache)
    names = list(table) if a.kernel == ["all"] else a.kernel
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"--kernel: unknown {unknown}; expected some of {list(table)} or all")
    overrides = {k: int(v) for k, v in (c.split("=") for c in a.constexpr)}
    for n in names:
        build(n, table[n], a.warps, a.stages, overrides, a.maxnreg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
