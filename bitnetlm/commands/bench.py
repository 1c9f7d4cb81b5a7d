"""bitnet bench: prefill/decode speed, llama-bench style (implementation: bitnetlm.bench)."""

from bitnetlm.bench import add_arguments, run

__all__ = ["add_arguments", "run"]
