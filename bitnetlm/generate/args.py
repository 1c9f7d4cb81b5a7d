"""The speculative-decoding flags of `bitnet generate`, `chat`, `serve` and `bench` (SpeculativeConfig's)."""

from __future__ import annotations

import argparse

# (flags, dest, type, default, help); `bitnet serve` reads them from BITNET_<FLAG> too
SPECULATIVE_FLAGS = [
    (
        ("-md", "--draft-model", "--model-draft"),
        "draft_model",
        str,
        None,
        "speculative decoding with this draft model (same tokenizer as the model); outputs are unchanged",
    ),
    (
        ("--lookup", "--prompt-lookup-max"),
        "lookup",
        int,
        0,
        "speculative decoding by prompt lookup: draft what followed the last N tokens earlier in the text "
        "(N from this down to --lookup-min; 0 = off); outputs are unchanged",
    ),
    (("--lookup-min", "--prompt-lookup-min"), "lookup_min", int, 1, "shortest n-gram prompt lookup matches"),
    (
        ("--draft-max", "--num-draft-tokens"),
        "draft_max",
        int,
        4,
        "most tokens drafted per step (speculative decoding)",
    ),
]


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    for flags, dest, typ, default, text in SPECULATIVE_FLAGS:
        g.add_argument(*flags, dest=dest, type=typ, default=default, help=f"{text} (default: {default})")


def speculative_from_args(args):
    """The SpeculativeConfig the flags ask for (its draft model named, not loaded: `load_speculative`), or None."""
    from bitnetlm.engine.speculative import SpeculativeConfig

    spec = SpeculativeConfig(args.draft_max, args.lookup, args.lookup_min, args.draft_model)
    return spec if spec.enabled else None
