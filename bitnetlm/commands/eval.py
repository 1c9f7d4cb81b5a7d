"""bitnet eval -m MODEL [--text FILE] [--mc FILE] [--json]  (perplexity, multiple-choice accuracy)"""

from __future__ import annotations

import json

from bitnetlm import progress
from bitnetlm.runtime.args import add_runtime_arguments, runtime_from_args

RUNTIME = ("device", "dtype", "backend", "threads", "head_dtype", "max_seq_len")


def add_arguments(p) -> None:
    p.add_argument("-m", "--model", required=True, help="model directory, .gguf file or zoo name")
    p.add_argument("--text", help="held-out text file: perplexity (sliding window beyond the context)")
    p.add_argument(
        "--mc",
        "--mmlu",
        dest="mc",
        help="multiple-choice JSONL in MMLU format: accuracy (letter scoring, see --shots)",
    )
    p.add_argument("--stride", type=int, help="window stride in tokens (default: ctx / 2)")
    p.add_argument(
        "-b", "--batch-size", type=int, default=4, help="windows / questions per forward (default: 4)"
    )
    p.add_argument("--limit", type=int, help="evaluate only the first N questions")
    p.add_argument(
        "--shots", type=int, default=0, help="few-shot examples per question, same topic (default: 0)"
    )
    p.add_argument("--subjects", nargs="+", help="only these MMLU topics")
    add_runtime_arguments(p, RUNTIME)
    p.add_argument(
        "--json", action="store_true", help="print machine-readable JSON (key 'perplexity', 'accuracy')"
    )
    progress.add_argument(p)


def run(args) -> int:
    from bitnetlm.train.eval import evaluate

    res = evaluate(
        args.model,
        text=args.text,
        mc=args.mc,
        runtime=runtime_from_args(args, RUNTIME),
        stride=args.stride,
        batch_size=args.batch_size,
        limit=args.limit,
        shots=args.shots,
        subjects=args.subjects,
    )
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    if "perplexity" in res:
        print(
            f"perplexity {res['perplexity']:.4f}  ({res['tokens']:,} tokens, ctx {res['ctx']}, stride {res['stride']})"
        )
    if "multiple_choice" in res:
        mc = res["multiple_choice"]
        print(f"accuracy {mc['accuracy']:.4f}  ({mc['correct']}/{mc['n']}, {mc['shots']}-shot)")
    return 0
