"""Sentence embeddings from decoders (`bitnetlm.embed` on a BitNet / LLaMA model) against transformers: the last
layer of `output_hidden_states` (after the final norm) for each text alone, pooled the same way."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from oracle import embedder_tokenizer, make_checkpoint, oracle_model
from oracle_bert import write_sentence_files

import bitnetlm
from bitnetlm.embedding import EmbedSpec, spec_for
from bitnetlm.models.bert import pool

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TEXTS = [
    "It is a truth universally acknowledged.",
    "A single man in possession of a good fortune must be in want of a wife, however little known.",
    "views",
    "the minds of the surrounding families",
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """variant -> (our directory with a tokenizer, the transformers oracle directory)."""
    base = tmp_path_factory.mktemp("embed")
    out = {}
    for i, variant in enumerate(("packed-autobitlinear", "llama")):
        ours = base / variant
        oracle = make_checkpoint(ours, variant, seed=7 + i)
        embedder_tokenizer().save(ours)
        out[variant] = (ours, oracle)
    return out


def _reference(oracle_dir, tok, texts, modes=("lasttoken",), normalize=True) -> torch.Tensor:
    """transformers' final hidden states of each text alone, pooled and normalised."""
    ref = oracle_model(oracle_dir)
    rows = []
    for ids in tok.encode_batch(texts):
        x = torch.tensor([ids])
        with torch.no_grad():
            h = ref(input_ids=x, output_hidden_states=True).hidden_states[-1]
        rows.append(pool(h, torch.ones_like(x), modes)[0])
    out = torch.stack(rows)
    return F.normalize(out, dim=-1) if normalize else out


@pytest.mark.parametrize("variant", ["packed-autobitlinear", "llama"])
def test_decoder_embedding_matches_transformers_last_token(checkpoints, variant):
    ours, oracle = checkpoints[variant]
    model, tok = bitnetlm.load(ours)
    assert spec_for(model) == EmbedSpec(("lasttoken",), True, False)
    got = bitnetlm.embed(model, tok, TEXTS, batch_size=3)  # batches of mixed lengths: right padding
    want = _reference(oracle, tok, TEXTS)
    assert got.shape == (len(TEXTS), model.config.hidden_size)
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)
    assert torch.allclose(got, want, atol=2e-4, rtol=0), (got - want).abs().max()
    alone = torch.cat([bitnetlm.embed(model, tok, t) for t in TEXTS])
    assert torch.allclose(got, alone, atol=1e-5, rtol=0)  # a batch gives each text's vector alone


def test_decoder_pools_as_its_sentence_transformers_files_say(checkpoints, tmp_path):
    ours, oracle = checkpoints["llama"]
    import shutil

    path = tmp_path / "st"
    shutil.copytree(ours, path)
    write_sentence_files(path, ("mean",), False, 64)
    model, tok = bitnetlm.load(path)
    assert spec_for(model) == EmbedSpec(("mean",), False, False)
    got = bitnetlm.embed(model, tok, TEXTS)
    want = _reference(oracle, tok, TEXTS, ("mean",), normalize=False)
    assert torch.allclose(got, want, atol=2e-4, rtol=1e-4), (got - want).abs().max()


def test_left_and_right_padding_give_the_text_alone(checkpoints):
    model, tok = bitnetlm.load(checkpoints["packed-autobitlinear"][0])
    ids = tok.encode_batch(TEXTS)
    width = max(map(len, ids))
    for left in (False, True):
        x = torch.zeros(len(ids), width, dtype=torch.long)
        mask = torch.zeros(len(ids), width, dtype=torch.bool)
        for r, row in enumerate(ids):
            cols = slice(width - len(row), width) if left else slice(0, len(row))
            x[r, cols], mask[r, cols] = torch.tensor(row), True
        positions = (mask.long().cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            batch = pool(model.hidden_states(x, positions, mask), mask.long(), ("lasttoken", "mean"))
            alone = torch.cat(
                [pool(model.hidden_states(torch.tensor([r])), torch.ones(1, len(r)), ("lasttoken", "mean"))
                 for r in ids]
            )  # fmt: skip
        assert torch.allclose(batch, alone, atol=1e-5, rtol=0), (left, (batch - alone).abs().max())


def test_matryoshka_sizes_and_bad_sentence_files(checkpoints, tmp_path):
    import shutil

    src = checkpoints["llama"][0]
    for extra, want in (
        ({"is_matryoshka": True}, True),
        ({"matryoshka_dimensions": [32, 16, 64]}, (16, 32, 64)),
        ({}, False),
    ):
        path = tmp_path / f"m{len(str(extra))}"
        shutil.copytree(src, path)
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, **extra}))
        assert spec_for(bitnetlm.load(path)[0]).matryoshka == want
    # a decoder whose sentence-transformers files we cannot follow still generates; embed names the file
    path = tmp_path / "dense"
    shutil.copytree(src, path)
    (path / "modules.json").write_text(json.dumps([{"idx": 0, "path": "2_Dense", "type": "x.models.Dense"}]))
    model, tok = bitnetlm.load(path)
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 512)
    with pytest.raises(ValueError, match=r"modules\.json: module type 'x\.models\.Dense' is not supported"):
        bitnetlm.embed(model, tok, "hello")
