"""What a request's output must match (structured output): a JSON schema, any JSON object, a regular expression,
a grammar or one of a list of strings. Plain data; `engine/grammar.py` compiles it and enforces it token by token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "grammar", "choice")


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of: `json` (a JSON schema as a dict, or True for any JSON object), `regex` (the whole output
    matches it), `grammar` (a Lark grammar as llguidance reads it, or GBNF as llama.cpp writes it), `choice` (the
    output is one of these strings)."""

    json: dict[str, Any] | bool | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured output: give exactly one of {', '.join(KINDS)}, found {given or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(
                f"structured output: json must be a JSON schema object or true, found {self.json!r}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured output: choice must be a non-empty list of non-empty strings")

    @classmethod
    def of(cls, value: StructuredOutput | dict | None) -> StructuredOutput | None:
        """A StructuredOutput from itself or a dict such as {"json": schema} / {"regex": "[0-9]+"}."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(
                f"structured output: expected a dict such as {{'json': schema}}, found {value!r}"
            )
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise ValueError(
                f"structured output: unknown key(s) {unknown}; expected one of {', '.join(KINDS)}"
            )
        return cls(**value)
