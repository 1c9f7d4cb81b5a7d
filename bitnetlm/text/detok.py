"""Streaming detokenizer: turn a growing list of token ids into text deltas.

Byte-level BPE (LLaMA-3) splits one multi-byte UTF-8 character over several tokens; decoding the tokens seen
so far then ends in U+FFFD until the rest arrives. SentencePiece-style decoders change a token's text with
its neighbours (a leading "▁" becomes a space except at the start). Both are handled by decoding a small
window: `prefix` tokens already emitted plus the new ones, and emitting only what the new tokens add, and only
once it no longer ends in an incomplete character. `finalize()` flushes whatever is left (a genuinely
invalid byte sequence is then emitted as U+FFFD, as a full decode would).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class StreamDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, context_ids=None):
        """`context_ids`: tokens that precede the stream (e.g. the prompt's tail), decoded only as context."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = [int(i) for i in (context_ids or [])]
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = len(self.tokens)  # tokens before this are emitted (or context)
        self.text = ""  # everything emitted so far

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def add(self, token_id: int) -> str:
        """Append one token; return the newly complete text (may be "")."""
        self.tokens.append(int(token_id))
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            self.text += delta
            return delta
        return ""

    def finalize(self) -> str:
        """Emit whatever is still held back (an incomplete character at the very end becomes U+FFFD)."""
        if self.read_offset >= len(self.tokens):
            return ""
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset :])
        delta = new_text[len(prefix_text) :] if new_text.startswith(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.tokens)
        self.text += delta
        return delta

    @property
    def pending(self) -> bool:
        return self.read_offset < len(self.tokens)
