#!/usr/bin/env python3
"""File size, bits per weight, write and load time of every format `bitnet convert` writes.

Model: BitNet b1.58 2B4T layer shapes (hidden 2560, ffn 6912, 20/5 heads, vocab 128256) with RANDOM ternary weights
and --layers layers (the real weights are not available here; sizes and times scale linearly with layers).
Prints a markdown table naming the machine.  Usage: python benchmarks/formats.py [--layers 2] [--vocab 128256]
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import torch


def build(layers: int, vocab: int):
    from bitnetlm.models import ModelConfig, build_model
    from bitnetlm.quant.bitlinear import BitLinear

    cfg = ModelConfig(arch="bitnet", num_hidden_layers=layers, vocab_size=vocab)
    g = torch.Generator().manual_seed(0)
    m = build_model(cfg, "infer")
    with torch.no_grad():
        m.embed_tokens.weight.copy_(torch.randn(m.embed_tokens.weight.shape, generator=g).bfloat16().float())
        for mod in m.modules():
            if isinstance(mod, BitLinear):
                t = torch.randint(-1, 2, (mod.out_features, mod.in_features), generator=g, dtype=torch.int8)
                mod.load_ternary(t, 0.02 + 0.01 * torch.rand(1, generator=g))
    return m.eval()


def size(p: Path) -> int:
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    data = p.with_name(p.name + ".data")  # ONNX external weights
    return p.stat().st_size + (data.stat().st_size if data.is_file() else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--skip-onnx", action="store_true")
    args = ap.parse_args()
    from bitnetlm.convert import lossless_dtype
    from bitnetlm.formats.gguf import load_gguf_model, save_gguf
    from bitnetlm.formats.native import load_native, save_native
    from bitnetlm.formats.onnx_export import export_onnx, onnx_session
    from bitnetlm.inspect import inspect_path

    model = build(args.layers, args.vocab)
    dt = lossless_dtype(model)  # what `bitnet convert --to hf` writes (bf16 here)
    rows = []
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        jobs = [
            (
                "HF packed 2-bit (transformers)",
                td / "hf",
                lambda p: save_native(model, p, dtype=dt),
                lambda p: load_native(p),
            ),
            (
                "native base3 (1.6-bit)",
                td / "b3",
                lambda p: save_native(model, p, storage="base3", dtype=dt),
                lambda p: load_native(p),
            ),
        ]
        for q in ("tq1_0", "tq2_0", "i2_s"):
            jobs.append(
                (
                    f"GGUF {q.upper()}",
                    td / f"m.{q}.gguf",
                    lambda p, q=q: save_gguf(model, p, q),
                    lambda p: load_gguf_model(p),
                )
            )
        if not args.skip_onnx:
            jobs.append(
                ("ONNX INT2", td / "m.onnx", lambda p: export_onnx(model, p), lambda p: onnx_session(p))
            )
        for name, path, save, load in jobs:
            t0 = time.perf_counter()
            save(path)
            t1 = time.perf_counter()
            load(path)
            t2 = time.perf_counter()
            info = inspect_path(path) if "base3" not in name else {}
            bpw = info.get("bits_per_ternary_weight")
            rows.append((name, size(path), bpw, t1 - t0, t2 - t1))
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus, torch {torch.__version__}; "
        f"model: 2B4T shapes, {args.layers} layers, vocab {args.vocab}, random ternary weights\n"
    )
    print("| format | file MB | bits / ternary weight | write s | load s |")
    print("|---|---:|---:|---:|---:|")
    for name, nbytes, bpw, w, lo in rows:
        b = f"{bpw:.4f}" if bpw else "1.6 (base3)" if "base3" in name else "-"
        print(f"| {name} | {nbytes / 1e6:.1f} | {b} | {w:.2f} | {lo:.2f} |")


if __name__ == "__main__":
    main()
