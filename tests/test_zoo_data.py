"""Corpus split helpers of scripts/fetch_corpora.py and scripts/zoo_common.py (no downloads)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import fetch_corpora  # noqa: E402
import zoo_common  # noqa: E402

sys.path.pop(0)
TOK = ROOT / "bitnetlm" / "zoo" / "bundled" / "bitnet-tiny" / "tokenizer.json"


def test_heldout_start_keeps_at_least_n_tokens_from_a_line_start():
    transformers = pytest.importorskip("transformers")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(TOK))
    text = "".join(f"Line {i}: it is a truth universally acknowledged.\n" for i in range(300))
    cut = fetch_corpora.heldout_start(text, tok, n_tokens=500)
    assert cut == 0 or text[cut - 1] == "\n"
    assert len(tok(text[cut:], add_special_tokens=False)["input_ids"]) >= 500
    # and not much more than that: the cut moves back by less than one line
    assert len(tok(text[cut + 60 :], add_special_tokens=False)["input_ids"]) < 500
    with pytest.raises(ValueError, match="too short"):
        fetch_corpora.heldout_start("short", tok, n_tokens=500)


def test_play_markdown_is_cleaned_to_speaker_lines():
    md = "# Hamlet\n\n## ACT I\n\n_Enter BERNARDO_\n\n**BERNARDO**  \nWho's there?\n"
    out = fetch_corpora._clean_play(md)
    assert out.splitlines()[0] == "Hamlet"
    assert "BERNARDO:\nWho's there?" in out and "**" not in out and "_" not in out


def test_encode_in_chunks_equals_encoding_at_once():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOK))
    text = "".join(f"And God said, Let there be light {i}.\n" for i in range(2000)) + "<|endoftext|>tail"
    ids = zoo_common.encode(tok, text, chunk=997)
    assert ids.dtype == np.uint16
    assert ids.tolist() == tok.encode(text, add_special_tokens=False).ids


def test_batches_are_deterministic_windows_of_the_sources():
    src = {"a": np.arange(1000, dtype=np.uint16), "b": np.arange(5000, 6000, dtype=np.uint16)}
    b1 = zoo_common.Batches(src, {"a": 1.0, "b": 1.0}, seq_len=16, seed=3).next(8)
    b2 = zoo_common.Batches(src, {"a": 1.0, "b": 1.0}, seq_len=16, seed=3).next(8)
    assert b1.shape == (8, 17) and (b1 == b2).all()
    assert ((b1[:, 1:] - b1[:, :-1]) == 1).all()  # contiguous windows
    assert zoo_common.lr_at(0, 100, 1.0, 10) == pytest.approx(0.1)
    assert zoo_common.lr_at(100, 100, 1.0, 10) == pytest.approx(0.1)  # decays to final_frac
