"""bitnet inspect PATH [--json] [--no-tensors]"""

from __future__ import annotations

import json

from bitnetlm import progress


def add_arguments(p) -> None:
    p.add_argument("path", help="model directory, .gguf or .onnx file, zoo name or Hub id")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--no-tensors", action="store_true", help="omit the tensor table")
    progress.add_argument(p)  # a zoo model assembled at first use


def run(args) -> int:
    from bitnetlm.inspect import format_report, inspect_path

    info = inspect_path(args.path)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        print(format_report(info, show_tensors=not args.no_tensors))
    return 0
