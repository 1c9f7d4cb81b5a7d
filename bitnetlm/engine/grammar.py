"""Structured output enforced token by token with llguidance (a maintained grammar engine, imported lazily).

A request's `StructuredOutput` becomes an llguidance grammar (`compile_grammar`, which also rejects what the engine
cannot enforce, naming it); each of its sequences gets a `Constraint`: an LLMatcher that gives the bitmask of the
tokens allowed next and advances on every accepted token. End-of-sequence tokens are allowed only where the
grammar accepts. llguidance was chosen over xgrammar by measurement (benchmarks/grammar_overhead.py,
docs/performance.md): it compiles a schema 20-100 times faster on the CPU, its masks are computed beside the
forward, and it needs no transformers import.
"""

from __future__ import annotations

import re
import threading
import weakref
from typing import Any

import torch

from bitnetlm.deps import require
from bitnetlm.sampling.structured import StructuredOutput

# Compact JSON with the separators models write (json.dumps's): without whitespace freedom an output cannot pad
# itself with blanks forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_REGEX_META = set("\\.+*?()|[]{}^$-&~#")

_lock = threading.Lock()
_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_executor = None


def _llg():
    return require("llguidance", "structured output")


def grammar_of(so: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) of `so`."""
    M = _llg().LLMatcher
    if so.json is not None:
        schema = {"type": "object"} if so.json is True else so.json
        return M.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if so.regex is not None:
        return M.grammar_from_regex(so.regex)
    if so.choice is not None:
        return M.grammar_from_regex("|".join(_escape(c) for c in so.choice))
    from llguidance.gbnf_to_lark import any_to_lark  # GBNF, as llama.cpp and vLLM's xgrammar backend take it

    return M.grammar_from_lark(any_to_lark(so.grammar))


def _escape(s: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in s)


def ll_tokenizer(tokenizer, end_ids, vocab_size: int):
    """llguidance's view of `tokenizer` whose sequences end with `end_ids` (none given: the tokenizer's end of
    sequence, which then ends the grammar too). Built once per tokenizer, end ids and vocabulary size: a 128k
    vocabulary takes about a second."""
    key = (tuple(sorted(end_ids)), vocab_size)
    with _lock:
        per = _tokenizers.setdefault(tokenizer, {})
        if key not in per:
            backend = tokenizer.backend
            n = max(vocab_size, backend.get_vocab_size())
            ends = list(key[0]) or list(tokenizer.eos_token_ids) or None
            per[key] = _llg().LLTokenizer(backend.to_str(), n_vocab=n, eos_token=ends)
        return per[key]


def compile_grammar(so: StructuredOutput, tokenizer, end_ids, vocab_size: int) -> tuple[Any, str]:
    """(llguidance tokenizer, grammar) for `so` over sequences that end with `end_ids` (allowed only where the
    grammar accepts); ValueError naming what the engine cannot enforce."""
    tok = ll_tokenizer(tokenizer, end_ids, vocab_size)
    kind = next(k for k in ("json", "regex", "grammar", "choice") if getattr(so, k) not in (None, False))
    try:
        grammar = grammar_of(so)
    except Exception as e:  # noqa: BLE001 - the GBNF converter raises whatever its parser meets: the caller's text
        raise ValueError(f"structured output: invalid {kind}: {_first_line(e)}") from None
    failed, messages = _llg().LLMatcher.validate_grammar_with_warnings(grammar, tok)
    if failed:
        raise ValueError(
            f"structured output: unsupported or invalid {kind}: {_first_line('; '.join(messages))}"
        )
    return tok, grammar


def _first_line(e) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return re.sub(r"\s+", " ", lines[0]) if lines else type(e).__name__


class Constraint:
    """One sequence's grammar state: the tokens allowed next (`fill`), advanced by `consume`."""

    def __init__(self, compiled: tuple[Any, str]):
        tok, grammar = compiled
        self.matcher = _llg().LLMatcher(tok, grammar)
        self.words = (tok.vocab_size + 31) // 32
        self.failed = False

    def consume(self, token: int) -> None:
        """Advance on a sampled token (one the mask allowed; anything else marks the constraint failed)."""
        if not self.failed and not self.matcher.consume_token(token):
            self.failed = True

    @property
    def stopped(self) -> bool:
        """The grammar is complete: nothing may follow (end-of-sequence aside)."""
        return self.failed or self.matcher.is_stopped()


def masks(constraints: list[Constraint]) -> list[torch.Tensor]:
    """Each constraint's allowed-token bitmask (int32 [ceil(V/32)]), computed by llguidance's thread pool with
    the GIL released (so a forward running beside it keeps going)."""
    global _executor
    words = max(c.words for c in constraints)
    out = torch.zeros(len(constraints), words, dtype=torch.int32)
    if _executor is None:
        _executor = _llg().LLExecutor()
    # what llguidance.torch.fill_next_token_bitmask_par does, without importing that module: its torch.compile
    # decorator imports torch's compiler stack, seconds on the first constrained request
    pairs = [(c.matcher, i) for i, c in enumerate(constraints)]
    _executor.unsafe_compute_mask_ptr(pairs, out.data_ptr(), words * 4, len(constraints))
    return list(out)
