"""bitnet inspect PATH [--json] [--no-tensors]"""

from __future__ import annotations

import json


def add_arguments(p) -> None:
    p.add_argument("path", help="model directory, .gguf or .onnx file")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--no-tensors", action="store_true", help="omit the tensor table")


def run(args) -> int:
    from bitnetlm.inspect import format_report, inspect_path

    info = inspect_path(args.path)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        print(format_report(info, show_tensors=not args.no_tensors))
    return 0
