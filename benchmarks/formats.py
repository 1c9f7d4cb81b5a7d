#!/usr/bin/env python3
"""File size, bits per weight, write and load time of every format `bitnet convert` writes.

Model: BitNet b1.58 2B4T layer shapes (hidden 2560, ffn 6912, 20/5 heads, vocab 128256) with RANDOM ternary weights
and --layers layers (the real weights are not available here; sizes and times scale linearly with layers).
Prints a markdown table naming the machine and the date.  Usage: python benchmarks/formats.py [--layers 2] [--vocab 128256]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import common
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


def jobs(model, td: Path, skip_onnx: bool) -> list[tuple]:
    """(name, path, write, read) of every format `bitnet convert` writes."""
    from bitnetlm.convert import lossless_dtype
    from bitnetlm.formats.gguf import load_gguf_model, save_gguf
    from bitnetlm.formats.native import load_native, save_native
    from bitnetlm.formats.onnx_export import export_onnx, onnx_session

    dt = lossless_dtype(model)  # what `bitnet convert --to hf` writes (bf16 here)
    out = [
        ("HF packed 2-bit (transformers)", td / "hf", lambda p: save_native(model, p, dtype=dt), load_native),
        (
            "native base3 (1.6-bit)",
            td / "b3",
            lambda p: save_native(model, p, storage="base3", dtype=dt),
            load_native,
        ),
    ]
    for q in ("tq1_0", "tq2_0", "i2_s"):
        out.append(
            (f"GGUF {q.upper()}", td / f"m.{q}.gguf", lambda p, q=q: save_gguf(model, p, q), load_gguf_model)
        )
    if not skip_onnx:
        out.append(("ONNX INT2", td / "m.onnx", lambda p: export_onnx(model, p), onnx_session))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--skip-onnx", action="store_true")
    args = ap.parse_args()
    common.use_checkout()
    from bitnetlm.inspect import inspect_path

    model = build(args.layers, args.vocab)
    rows = []
    with tempfile.TemporaryDirectory() as td:
        for name, path, save, load in jobs(model, Path(td), args.skip_onnx):
            t0 = time.perf_counter()
            save(path)
            t1 = time.perf_counter()
            load(path)
            t2 = time.perf_counter()
            bpw = inspect_path(path).get("bits_per_ternary_weight") if "base3" not in name else None
            b = f"{bpw:.4f}" if bpw else "1.6 (base3)" if "base3" in name else "-"
            rows.append([name, f"{size(path) / 1e6:.1f}", b, f"{t1 - t0:.2f}", f"{t2 - t1:.2f}"])
    common.header(
        "Checkpoint formats: size, bits per weight, write and load time",
        details=f"2B4T shapes, {args.layers} layers, vocab {args.vocab}, random ternary weights",
    )
    print(common.table(["format", "file MB", "bits / ternary weight", "write s", "load s"], rows))


if __name__ == "__main__":
    main()
