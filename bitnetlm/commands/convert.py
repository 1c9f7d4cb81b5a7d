"""bitnet convert IN OUT [--to {hf,gguf,onnx}] [--type auto|tq1_0|tq2_0|i2_s] [--force]"""

from __future__ import annotations

from bitnetlm import progress
from bitnetlm.commands import add_torch_threads, apply_torch_threads


def add_arguments(p) -> None:
    p.add_argument("input", help="source model: HF directory, .gguf file, zoo name or Hub id")
    p.add_argument("output", help="output path (a directory for hf, a file for gguf/onnx)")
    p.add_argument(
        "--to",
        default=None,
        choices=["hf", "gguf", "onnx"],
        help="target format (default: from OUTPUT's extension, .gguf -> gguf, .onnx -> onnx, else hf)",
    )
    p.add_argument(
        "--type",
        default=None,
        choices=["auto", "tq1_0", "tq2_0", "i2_s"],
        help="GGUF type of the ternary projections (tq1_0 1.69 bpw, tq2_0 2.06 bpw, i2_s 2 bpw + "
        "exact float32 scale; TQ types round each scale to fp16; a projection a type cannot hold is stored as "
        "F16 with exact ternary values). Default for ternary models: auto = tq2_0 if every projection's rows "
        "are multiples of 256, else i2_s",
    )
    p.add_argument(
        "--storage",
        default="2bit",
        choices=["2bit", "base3"],
        help="hf only: 2bit = transformers-loadable packed layout (default); base3 = 1.6 bits/weight "
        "distribution encoding, decoded at load by bitnet-lm only",
    )
    p.add_argument(
        "--embed-type",
        default="auto",
        choices=["auto", "f32", "f16", "bf16"],
        help="gguf only: type of token_embd/output (auto = smallest lossless of bf16/f16/f32)",
    )
    p.add_argument(
        "--gguf-arch",
        default=None,
        choices=["bitnet", "bitnet-b1.58", "bitnet-25", "llama"],
        help="gguf only: general.architecture to write, which also fixes the MLP activation llama.cpp runs "
        "(default from the model: bitnet-b1.58 for ReLU^2 BitNet, bitnet for SiLU BitNet / 1bitLLM, llama for "
        "LLaMA)",
    )
    p.add_argument("-f", "--force", action="store_true", help="overwrite OUTPUT if it exists")
    add_torch_threads(p)
    progress.add_argument(p)
    p.add_argument("--json", action="store_true", help="print what was written as JSON (path, format, bytes)")


def run(args) -> int:
    import json
    import sys

    from bitnetlm.convert import convert, describe, infer_target

    apply_torch_threads(args)
    out = convert(
        args.input,
        args.output,
        to=args.to,
        qtype=args.type,
        force=args.force,
        storage=args.storage,
        embed_type=args.embed_type,
        gguf_arch=args.gguf_arch,
    )
    if args.json:
        print(json.dumps(describe(out, infer_target(out, to=args.to))))
    else:
        print(f"wrote {out}", file=sys.stderr)
    return 0
