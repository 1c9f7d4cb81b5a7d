"""Streaming detokenization on the real LLaMA-3 tokenizer: no U+FFFD mid-stream for split characters."""

from __future__ import annotations

import pytest
from assets import asset

from bitnetlm.generate import StreamDetokenizer, Tokenizer

TEXTS = [
    "A llama 🦙 on fire 🔥🔥 says 👋🏽 hi",
    "日本語のテキストと中文混合, 한국어 텍스트",
    "math: ∀x∈ℝ, x² ≥ 0; 𝔸𝔹ℂ; ‰",
    "plain ASCII text, nothing special.",
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(asset("llama3-tokenizer"))


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode_without_replacement_chars(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    d = StreamDetokenizer(tok)
    chunks = [d.add(i) for i in ids] + [d.finalize()]
    assert "".join(chunks) == text == tok.decode(ids)
    assert all("\ufffd" not in c for c in chunks)


def test_text_really_splits_characters(tok):
    # the test above is only meaningful if single tokens carry partial UTF-8 characters
    ids = tok.encode(TEXTS[0] + TEXTS[1], add_special_tokens=False)
    partial = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert len(partial) >= 2
    # and a naive per-token decode would have shown U+FFFD
    assert "\ufffd" in "".join(tok.decode([i]) for i in ids)


def test_held_back_until_complete_and_flushed_at_end(tok):
    ids = tok.encode("🦙", add_special_tokens=False)
    assert len(ids) >= 2
    d = StreamDetokenizer(tok)
    assert [d.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.pending
    # an incomplete character at the very end of a stream is flushed like a full decode would show it
    assert d.finalize() == tok.decode(ids[:-1])
    d2 = StreamDetokenizer(tok)
    assert "".join(d2.add(i) for i in ids) == "🦙"


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("Hi<|eot_id|>there", add_special_tokens=True)
    d = StreamDetokenizer(tok, skip_special_tokens=True)
    assert "".join([d.add(i) for i in ids] + [d.finalize()]) == "Hithere"
    d = StreamDetokenizer(tok, skip_special_tokens=False)
    assert "".join([d.add(i) for i in ids] + [d.finalize()]) == "<|begin_of_text|>Hi<|eot_id|>there"


def test_context_ids_not_emitted(tok):
    prompt = tok.encode("Once upon", add_special_tokens=False)
    cont = tok.encode(" a time 🦙", add_special_tokens=False)
    d = StreamDetokenizer(tok, context_ids=prompt)
    assert "".join([d.add(i) for i in cont] + [d.finalize()]) == " a time 🦙"
