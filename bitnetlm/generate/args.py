"""The generation flags of `bitnet generate`, `chat`, `serve` (and `bench`): speculative decoding
(SpeculativeConfig's) and the context shift (ContextShift's)."""

from __future__ import annotations

import argparse

from bitnetlm.runtime.args import parse_bool

# (flags, dest, type, default, help); `bitnet serve` reads them from BITNET_<FLAG> too
SPECULATIVE_FLAGS = [
    (
        ("-md", "--draft-model", "--model-draft"),
        "draft_model",
        str,
        None,
        "speculative decoding with this draft model (same tokenizer as the model; with --lookup, where lookup "
        "finds no match); outputs are unchanged",
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


# (flags, dest, type, default, help); `bitnet serve` reads them from BITNET_<FLAG> too
CONTEXT_FLAGS = [
    (
        ("--context-shift",),
        "context_shift",
        parse_bool,
        False,
        "at the end of the context window keep the first --keep tokens, drop the oldest half of the rest and go "
        "on (llama.cpp's context shift); without it generation ends there with finish reason 'length'",
    ),
    (
        ("--keep", "--n-keep"),
        "n_keep",
        int,
        0,
        "context shift: prompt tokens kept at the start after BOS (-1: the whole prompt)",
    ),
]


def add_context_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("context window")
    for flags, dest, typ, default, text in CONTEXT_FLAGS:
        extra = dict(nargs="?", const=True) if typ is parse_bool else {}  # `--context-shift` alone means true
        g.add_argument(
            *flags, dest=dest, type=typ, default=default, help=f"{text} (default: {default})", **extra
        )


def context_shift_from_args(args):
    """The ContextShift the flags ask for, or None."""
    from bitnetlm.engine.scheduler import ContextShift

    return ContextShift(args.n_keep) if args.context_shift else None


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    for flags, dest, typ, default, text in SPECULATIVE_FLAGS:
        g.add_argument(*flags, dest=dest, type=typ, default=default, help=f"{text} (default: {default})")


def speculative_from_args(args):
    """The SpeculativeConfig the flags ask for (its draft model named, not loaded: `load_speculative`), or None."""
    from bitnetlm.engine.speculative import SpeculativeConfig

    spec = SpeculativeConfig(args.draft_max, args.lookup, args.lookup_min, args.draft_model)
    return spec if spec.enabled else None
