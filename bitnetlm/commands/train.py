"""bitnet train [CONFIG.yaml] [--option value ...]  (every config option is also a flag)"""

from __future__ import annotations

import json
import os


def add_arguments(p) -> None:
    from bitnetlm.train.config import add_config_flags

    p.add_argument("config", nargs="?", help="YAML file of training options (flags override it)")
    p.add_argument("--json", action="store_true", help="print the run summary as JSON")
    add_config_flags(p)


def run(args) -> int:
    from bitnetlm.train.config import config_from_args
    from bitnetlm.train.loop import train

    cfg = config_from_args(args, args.config)
    summary = train(cfg)
    if os.environ.get("RANK", "0") != "0":
        return 0  # under torchrun only rank 0 reports
    if args.json:
        print(json.dumps(summary, indent=2))
    elif summary is not None:
        val = summary.get("val_loss")
        print(
            f"step {summary['step']}: train loss {summary['loss']:.4f}"
            + (f", held-out loss {val:.4f}" if val is not None else "")
            + (f"; model saved to {summary['export']}" if summary.get("export") else "")
        )
    return 0
