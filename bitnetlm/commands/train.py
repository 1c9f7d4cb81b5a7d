"""bitnet train [CONFIG.yaml] [--option value ...]  (every config option is also a flag)"""

from __future__ import annotations

import json
import os

from bitnetlm import progress
from bitnetlm.commands import add_torch_threads, apply_torch_threads


def add_arguments(p) -> None:
    from bitnetlm.train.config import add_config_flags

    p.add_argument("config", nargs="?", help="YAML file of training options (flags override it)")
    p.add_argument("--json", action="store_true", help="print the run summary as JSON")
    add_config_flags(p)
    add_torch_threads(p)
    progress.add_argument(p)  # the same as --progress false


def run(args) -> int:
    from bitnetlm.runtime.config import resolve_device
    from bitnetlm.train.config import config_from_args
    from bitnetlm.train.loop import train

    if args.no_progress:
        args.progress = False
    cfg = config_from_args(args, args.config)
    resolve_device(cfg.device)  # an absent device (mps, cuda on a CPU machine) is one line before any work
    apply_torch_threads(args)
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
