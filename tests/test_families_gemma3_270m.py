"""Gemma-3-270M (base, Q4_K_M GGUF as llama.cpp's converter and quantizer wrote it) read by our GGUF reader: the
same token ids and logits as transformers' `from_pretrained(gguf_file=...)`, and a sensible greedy answer.

The file is 238 MB, too large for CI: the test carries the marker `opt_in` (deselected by scripts/test.sh) and
runs after `python scripts/fetch_assets.py gemma3-270m`:

    python -m pytest -m opt_in tests/test_families_gemma3_270m.py
"""

from __future__ import annotations

import pytest
import torch
from assets import asset

import bitnetlm

pytestmark = [pytest.mark.opt_in, pytest.mark.usefixtures("one_torch_thread")]
NAME = "gemma-3-270m-q4_k_m.gguf"


@pytest.fixture(scope="module")
def models():
    import transformers

    path = asset("gemma3-270m") / NAME
    ref = transformers.Gemma3ForCausalLM.from_pretrained(
        path.parent, gguf_file=NAME, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ref_tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=NAME)
    model, tok = bitnetlm.load(path, backend="reference", dtype=torch.float32)
    return ref, ref_tok, model, tok


def test_config_tokens_and_logits_match_transformers(models):
    ref, ref_tok, model, tok = models
    cfg = model.config
    assert (cfg.arch, cfg.num_hidden_layers, cfg.sliding_window, cfg.query_pre_attn_scalar) == (
        "gemma3",
        18,
        512,
        256,
    )
    assert cfg.layer_types == ref.config.layer_types and cfg.rope_local_theta == 10000.0
    text = "The Eiffel Tower is in the city of"
    ids = tok.encode(text)
    assert ids == ref_tok(text).input_ids
    x = torch.tensor([ids])
    with torch.no_grad():
        want, got = ref(x).logits, model(x)
    assert (got - want).abs().max().item() <= 1e-4


def test_greedy_answer_is_sensible_and_matches_transformers(models):
    ref, _, model, tok = models
    ids = tok.encode("The Eiffel Tower is in the city of")
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :].tolist()
    got = bitnetlm.generate(model, tok, ids, max_tokens=8, temperature=0, ignore_eos=True)
    assert got.tokens == want
    assert "Paris" in tok.decode(got.tokens)


def test_tokenizer_writes_back_to_the_same_gguf_vocabulary(models):
    """Our GGUF writer on Gemma's tokenizer: llama.cpp's SentencePiece kind, the file's own pieces and types, and a
    tokenizer that reads back to the same ids (its whitespace-run pieces leave the merges to the scores)."""
    from bitnetlm.formats.gguf_file import read_gguf
    from bitnetlm.formats.gguf_tokenizer import tokenizer_from_gguf_metadata, tokenizer_metadata

    _, _, _, tok = models
    meta, _ = tokenizer_metadata(tok)
    with read_gguf(asset("gemma3-270m") / NAME) as f:
        original = f.metadata
    for key in ("model", "tokens", "token_type", "add_space_prefix", "bos_token_id", "eos_token_id"):
        assert meta[f"tokenizer.ggml.{key}"] == original[f"tokenizer.ggml.{key}"], key
    back, _ = tokenizer_from_gguf_metadata(meta)
    for text in ["The Eiffel Tower", "  two  spaces\tand\nnewlines", "Ünïcödé 日本語 🙂 1234567"]:
        assert back.encode(text).ids == tok.encode(text), text
