"""GPU benchmark (device machine): per-kernel W2A8 timings at the 2B4T shapes, then the engine table.

    python benchmarks/gpu_bench.py [--out DIR] [--kernels] [--engine] [--n-gen 128] [--batches 1,8,64] [--depths 0,512]

Prints markdown tables naming the GPU; writes gpu_bench.json (+ .md) into --out. Random weights of the exact
BitNet b1.58 2B4T shapes in the real packed layout (the real checkpoint is not available offline).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kernel_table(ms=(1, 8, 16, 64, 512)) -> tuple[str, list[dict]]:
    import triton

    from bitnetlm.kernels.triton import launch as L
    from bitnetlm.kernels.triton import tune as T
    from bitnetlm.kernels.triton.layout import pack_triton

    # (name, N out, K in, gated, norm, residual, per-row scale) as the engine calls them
    shapes = [
        ("qkv", 3840, 2560, False, True, False, True),
        ("o", 2560, 2560, False, True, True, False),
        ("gate|up", 6912, 2560, True, True, False, True),
        ("down", 2560, 6912, False, True, True, False),
    ]
    rows = []
    for name, n, k, gated, norm, res, per_row in shapes:
        rows_w = n * (2 if gated else 1)
        p = pack_triton(torch.randint(-1, 2, (rows_w, k), dtype=torch.int8, device="cuda"))
        s = torch.rand(rows_w if per_row else 1, device="cuda")
        nw = torch.rand(k, device="cuda") if norm else None
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) if res else None
            fn = lambda x=x, p=p, s=s, n=n, nw=nw, r=r, g=gated: L.ternary_linear(
                x, p, s, n, norm_weight=nw, residual=r, gated=g
            )  # noqa: E731
            fn()
            t = statistics.median(
                [triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") for _ in range(3)]
            )
            cfg = [v for kk, v in T._choice.items() if kk[1] == n and kk[2] == k and kk[4] == gated]
            rows.append(
                dict(
                    op=name,
                    m=m,
                    n=n,
                    k=k,
                    us=t * 1e3,
                    gb_s=p.numel() / t / 1e6,
                    tops=2 * m * rows_w * k / t / 1e9,
                    cfg=str(cfg[-1] if cfg else ""),
                )
            )
    md = [
        "| op | M | N x K | us | weight GB/s | int8 TOPS | config |",
        "| --- | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        md.append(
            f"| {r['op']} | {r['m']} | {r['n']}x{r['k']} | {r['us']:.1f} | {r['gb_s']:.0f} | {r['tops']:.1f} | {r['cfg']} |"
        )
    return "\n".join(md), rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="directory for gpu_bench.json / gpu_bench.md")
    ap.add_argument("--kernels", action="store_true", help="per-kernel table")
    ap.add_argument("--engine", action="store_true", help="engine prefill/decode table (ternary vs bf16)")
    ap.add_argument("--batches", default="1,8,64", help="decode batch sizes")
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument(
        "--depths",
        default="0",
        help="tokens already in each row's KV cache before each test, comma-separated (llama-bench's -d)",
    )
    ap.add_argument(
        "--max-seq-len",
        type=int,
        default=0,
        help="KV-cache positions (default prompt + decode + 1; a server's: 4096)",
    )
    ap.add_argument("--heads", default="fp,int8", help="ternary head options to run (fp = bf16)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kv", default="auto", help="KV-cache types of the ternary rows: auto (bf16), fp8")
    args = ap.parse_args()
    from bitnetlm.runtime.cuda.bench import bench_cuda, gpu_name, markdown

    out = {"gpu": gpu_name()}
    md = [f"GPU: {out['gpu']}"]
    if args.kernels:
        t, rows = kernel_table()
        out["kernels"] = rows
        md += ["", t]
        print(t, flush=True)
    if args.engine:
        res = bench_cuda(
            None,
            tuple(int(b) for b in args.batches.split(",")),
            args.n_prompt,
            args.n_gen,
            heads=tuple(args.heads.split(",")),
            reps=args.reps,
            kv=tuple(args.kv.split(",")),
            max_seq_len=args.max_seq_len or None,
            depths=tuple(int(d) for d in args.depths.split(",")),
        )
        out["engine"] = res
        md += ["", markdown(res)]
        print(markdown(res), flush=True)
    from bitnetlm.kernels.triton import tune

    out["tuned"] = {str(k): v for k, v in tune._choice.items()}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
        json.dump(out, f, indent=2)
    with open(os.path.join(args.out, "gpu_bench.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
