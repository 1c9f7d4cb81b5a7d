"""What the decode attention compiles to, without a GPU: `_attn_gqa_kernel` built for sm_90 by the installed
Triton at the 2B4T batch-64 shape (4 query heads a KV head, head dim 128, 64-key blocks, float8 or bf16 cache),
then disassembled with Triton's own cuobjdump: registers, shared memory, spills and the instructions of the K/V block
loop.

    python benchmarks/triton_sass.py [--cache fp8|bf16] [--warps W] [--stages S] [--constexpr NAME=VALUE ...]

Counts depend on the Triton version (the device machine has 3.6: `pip install triton==3.6.0` in a venv).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def loop_ops(sass: str) -> list[tuple[int, str]]:
    """(address, instruction) of the body of the first backward branch's loop."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    for a, t in ins:
        m = re.search(r"BRA\s+.*?0x([0-9a-f]+)", t)
        if "BRA" in t and m and int(m.group(1), 16) < a:
            return [x for x in ins if int(m.group(1), 16) <= x[0] <= a]
    return []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", default="fp8", choices=["fp8", "bf16"])
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=0, help="software-pipeline stages (0: Triton's default)")
    ap.add_argument(
        "--constexpr", nargs="*", default=[], help="extra kernel constexprs, NAME=INT (a branch's)"
    )
    a = ap.parse_args()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bitnetlm.kernels.triton.attention import _attn_gqa_kernel

    kv = "*fp8e4nv" if a.cache == "fp8" else "*bf16"
    sig = {
        "q_ptr": "*bf16",
        "k_ptr": kv,
        "v_ptr": kv,
        "pos_ptr": "*i32",
        "o_ptr": "*bf16",
        "pacc_ptr": "*fp32",
    }
    sig.update(
        {"pml_ptr": "*fp32", "cnt_ptr": "*i32", "sm_scale": "fp32", "H": "i32", "HKV": "i32", "S": "i32"}
    )
    sig["NSPLIT"] = "i32"
    const = dict(G=4, GP=16, GM=4, D=128, BS=64, NS2=1, IEEE=False, PDL=True, KV8=a.cache == "fp8", LATE=True)
    const.update({k: int(v) for k, v in (c.split("=") for c in a.constexpr)})
    sig.update({k: "constexpr" for k in const})
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
    src = ASTSource(
        _attn_gqa_kernel, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs
    )
    k = triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=a.warps, **({"num_stages": a.stages} if a.stages else {})),
    )
    path = "/tmp/bitnetlm_attn.cubin"
    with open(path, "wb") as f:
        f.write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    res = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", res).group(1)
    body = loop_ops(sass)
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for _, t in body)
    print(
        f"_attn_gqa_kernel for sm_90, Triton {triton.__version__}, {a.cache} cache, {a.warps} warps, "
        f"constexprs {const}\n"
    )
    stack = re.search(r"STACK:(\d+)", res)
    print(
        f"registers a thread: {regs}; shared memory a program: {k.metadata.shared} bytes; "
        f"stack (spills) a thread: {stack.group(1) if stack else '?'} bytes"
    )
    print(f"instructions a warp in the K/V block loop (one {const['BS']}-key block): {len(body)}\n")
    print("| instruction | count |\n| --- | ---: |")
    for op, n in ops.most_common(16):
        print(f"| {op} | {n} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
