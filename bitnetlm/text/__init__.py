"""Text: the tokenizer with its chat template, and the streaming detokenizer."""

from bitnetlm.text.detok import StreamDetokenizer
from bitnetlm.text.tokenizer import Tokenizer

__all__ = ["StreamDetokenizer", "Tokenizer"]
