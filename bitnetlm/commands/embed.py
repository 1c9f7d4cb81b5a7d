"""bitnet embed -m MODEL [FILE|-] [--json]  (sentence embeddings, one text per line)"""

from __future__ import annotations

import json
import sys

from bitnetlm import progress
from bitnetlm.commands import add_torch_threads, apply_torch_threads


def add_arguments(p) -> None:
    p.add_argument(
        "-m", "--model", required=True, help="model directory (encoder or decoder), .gguf file or zoo name"
    )
    p.add_argument("input", nargs="?", default="-", help="text file, one text per line ('-' or none: stdin)")
    p.add_argument("-b", "--batch-size", type=int, default=32, help="texts per forward (default: 32)")
    p.add_argument(
        "--normalize",
        choices=("auto", "yes", "no"),
        default="auto",
        help="L2-normalise the vectors (auto: as the model's Normalize module says)",
    )
    p.add_argument("--json", action="store_true", help='print JSON: {"model", "dimensions", "vectors"}')
    add_torch_threads(p)
    progress.add_argument(p)  # a zoo model assembled at first use


def read_texts(source: str) -> list[str]:
    """The lines of `source` (a file, or stdin for '-') as texts; a trailing newline ends the last one."""
    if source == "-":
        data, name = sys.stdin.buffer.read(), "<stdin>"
    else:
        with open(source, "rb") as f:
            data, name = f.read(), source
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{name}: not UTF-8 text (byte {e.start})") from None
    lines = text.splitlines()
    if not lines:
        raise ValueError(f"{name}: no text to embed (expected one text per line)")
    return lines


def run(args) -> int:
    from bitnetlm.embedding import embed
    from bitnetlm.loading import load

    apply_torch_threads(args)
    texts = read_texts(args.input)
    model, tok = load(args.model)
    normalize = None if args.normalize == "auto" else args.normalize == "yes"
    vectors = embed(model, tok, texts, batch_size=args.batch_size, normalize=normalize)
    if args.json:
        doc = {"model": str(args.model), "dimensions": vectors.shape[1], "vectors": vectors.tolist()}
        print(json.dumps(doc))
    else:
        for row in vectors.tolist():
            print(" ".join(f"{v:.7g}" for v in row))
    return 0
