"""bitnet data prepare INPUT... -o OUT --tokenizer PATH  (text / JSONL / directories -> token shards)"""

from __future__ import annotations

import json

from bitnetlm import progress


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    q = sub.add_parser("prepare", help="tokenize text/JSONL files or directories into training shards")
    q.add_argument(
        "inputs", nargs="+", help="text files, JSONL files (one {'text': ...} per line) or directories"
    )
    q.add_argument("-o", "--out", required=True, help="output data directory")
    q.add_argument(
        "--tokenizer",
        help="tokenizer.json or a model/tokenizer directory (omit with --train-tokenizer)",
    )
    q.add_argument(
        "--train-tokenizer",
        type=int,
        metavar="VOCAB",
        help="train a byte-level BPE tokenizer of this vocabulary size on the inputs first (saved in OUT)",
    )
    q.add_argument(
        "--val-fraction", type=float, default=0.01, help="share of tokens held out (default: 0.01)"
    )
    q.add_argument("--text-field", default="text", help="JSONL field holding the text (default: text)")
    q.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file (default: 2^28)")
    q.add_argument("--no-eos", action="store_true", help="do not put an EOS token between documents")
    progress.add_argument(q)
    q.add_argument("--json", action="store_true", help="print the resulting meta.json")


def run(args) -> int:
    from pathlib import Path

    from bitnetlm.train.data import PrepareConfig, iter_files, prepare_data, train_tokenizer

    if args.action != "prepare":
        raise ValueError(f"unknown data action {args.action!r}")
    tok = args.tokenizer
    if args.train_tokenizer:
        tok = train_tokenizer(iter_files(args.inputs), args.train_tokenizer, args.out)
    if tok is None:
        raise ValueError(
            "give --tokenizer PATH (tokenizer.json or a model directory) or --train-tokenizer VOCAB"
        )
    cfg = PrepareConfig(
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
        text_field=args.text_field,
        append_eos=not args.no_eos,
    )
    meta = prepare_data(args.inputs, tok, args.out, cfg)
    if args.json:
        print(json.dumps(meta, indent=2))
    else:
        n = {s: sum(x["tokens"] for x in v) for s, v in meta["splits"].items()}
        print(
            f"{Path(args.out)}: {n['train']:,} train + {n['val']:,} held-out tokens ({meta['dtype']}, vocab {meta['vocab_size']})"
        )
    return 0
