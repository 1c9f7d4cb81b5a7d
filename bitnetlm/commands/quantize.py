"""bitnet quantize IN OUT [--to hf|gguf] [--type auto|tq1_0|tq2_0|i2_s] [--force]: post-training absmean
ternarization."""

from __future__ import annotations

from bitnetlm import progress
from bitnetlm.commands import add_torch_threads, apply_torch_threads


def add_arguments(p) -> None:
    p.add_argument(
        "input",
        help="full-precision model: LLaMA-family HF directory or GGUF (F16, Q8_0, Q4_K, ...), or a Hub id",
    )
    p.add_argument("output", help="output path (a directory for hf, a file for gguf)")
    p.add_argument(
        "--to",
        default=None,
        choices=["hf", "gguf"],
        help="output format (default: from OUTPUT's extension, .gguf -> gguf, else an hf directory)",
    )
    p.add_argument(
        "--type",
        default="auto",
        choices=["auto", "tq1_0", "tq2_0", "i2_s"],
        help="GGUF type of the ternary projections (auto: tq2_0 if every projection's rows are multiples of "
        "256, else i2_s; a projection a type cannot hold is stored as F16 with exact ternary values)",
    )
    p.add_argument("-f", "--force", action="store_true", help="overwrite OUTPUT if it exists")
    p.add_argument("-q", "--quiet", action="store_true", help="do not print the quality warning")
    add_torch_threads(p)
    progress.add_argument(p)
    p.add_argument("--json", action="store_true", help="print what was written as JSON (path, format, bytes)")


def run(args) -> int:
    import json
    import sys

    from bitnetlm.convert import describe, infer_target, quantize

    apply_torch_threads(args)
    out = quantize(args.input, args.output, to=args.to, qtype=args.type, force=args.force, quiet=args.quiet)
    if args.json:
        print(json.dumps(describe(out, infer_target(out, ("hf", "gguf"), args.to))))
    else:
        print(f"wrote {out}", file=sys.stderr)
    return 0
