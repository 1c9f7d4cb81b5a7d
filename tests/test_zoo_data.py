"""Corpus split helpers of scripts/fetch_corpora.py and scripts/zoo_common.py (no downloads)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

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


def _src():
    return {"a": np.arange(0, 200, dtype=np.uint16), "b": np.arange(100, 256, dtype=np.uint16)}


def test_batches_split_one_global_batch_over_ranks_and_resume():
    w = {"a": 1.0, "b": 2.0}
    whole = zoo_common.Batches(_src(), w, 16, seed=5).next(8)
    ranks = [zoo_common.Batches(_src(), w, 16, 5, 8, rank=r, world_size=2, micro_batch=2) for r in range(2)]
    steps = [b.next_step() for b in ranks]  # per rank: 2 micro-batches of 2 rows
    assert [len(s) for s in steps] == [2, 2]
    rows = torch.cat([steps[r][m][0] for m in range(2) for r in range(2)])  # micro-batch-major, then rank
    assert torch.equal(rows, whole[:, :-1])
    assert torch.equal(steps[0][0][1], whole[:2, 1:])  # labels: the inputs shifted by one
    one = zoo_common.Batches(_src(), w, 16, 5, 8)
    one.next_step()
    state = json.loads(json.dumps(one.state_dict()))  # what a checkpoint holds
    again = zoo_common.Batches(_src(), w, 16, 99, 8)
    again.load_state_dict(state)
    assert torch.equal(again.next_step()[0][0], one.next_step()[0][0])
    with pytest.raises(ValueError, match="batch_size 8 must be a multiple of 3 x 2 processes"):
        zoo_common.Batches(_src(), w, 16, 5, 8, rank=0, world_size=2, micro_batch=3)
    with pytest.raises(ValueError, match="checkpoint used batch_size 8, this run 4"):
        zoo_common.Batches(_src(), w, 16, 5, 4).load_state_dict(state)


def test_library_trainer_on_zoo_batches_resumes_exactly(tmp_path):
    """The zoo scripts' setup: a given model and batch source in bitnetlm.train's loop; stop + resume = one run."""
    from safetensors.torch import load_file

    from bitnetlm.models import ModelConfig, build_model
    from bitnetlm.train import TrainConfig, train
    from bitnetlm.train.checkpoint import latest_checkpoint

    mc = ModelConfig(
        arch="bitnet", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, quant="ternary",
    )  # fmt: skip

    def run(out, steps):
        torch.manual_seed(0)
        cfg = TrainConfig(
            seq_len=16, batch_size=4, max_steps=steps, warmup_steps=2, lr=1e-2, schedule="constant",
            out_dir=str(out), save_every=2, progress=False, tensorboard=False, export=False,
            log_every=1,
        )  # fmt: skip
        # same weights every call: a resumed run overwrites them with the checkpoint's
        return train(
            cfg,
            model=build_model(mc, mode="train"),
            batches=lambda rank, world: zoo_common.Batches(
                _src(), {"a": 1.0, "b": 1.0}, 16, 3, 4, rank, world
            ),
        )

    ref, cut = tmp_path / "ref", tmp_path / "cut"
    assert run(ref, 6)["step"] == 6
    run(cut, 4)
    summary = run(cut, 6)
    assert summary["resumed_from"] == 4 and summary["step"] == 6
    a = load_file(str(latest_checkpoint(ref / "checkpoints") / "model.safetensors"))
    b = load_file(str(latest_checkpoint(cut / "checkpoints") / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["loss"] > rows[5]["loss"]  # it learns
