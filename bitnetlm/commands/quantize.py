"""bitnet quantize IN OUT [--to hf|gguf] [--type ...] [--force]: post-training absmean ternarization."""

from __future__ import annotations


def add_arguments(p) -> None:
    p.add_argument(
        "input", help="full-precision model: LLaMA-family HF directory or GGUF (F16, Q8_0, Q4_K, ...)"
    )
    p.add_argument("output", help="output path (directory for hf, file for gguf)")
    p.add_argument("--to", default="hf", choices=["hf", "gguf"], help="output format (default hf)")
    p.add_argument(
        "--type",
        default="tq2_0",
        choices=["tq1_0", "tq2_0", "i2_s"],
        help="GGUF type of the ternary projections (with --to gguf)",
    )
    p.add_argument("-f", "--force", action="store_true", help="overwrite OUTPUT if it exists")
    p.add_argument("-q", "--quiet", action="store_true", help="do not print the quality warning")


def run(args) -> int:
    import sys

    from bitnetlm.convert import quantize

    out = quantize(args.input, args.output, to=args.to, qtype=args.type, force=args.force, quiet=args.quiet)
    print(f"wrote {out}", file=sys.stderr)
    return 0
