"""Data preparation (text / JSONL / directories -> memmap shards) and resumable packed batches."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from assets import asset
from train_utils import ROOT

from bitnetlm.train.data import (
    PackedBatches,
    PrepareConfig,
    TokenShards,
    load_tokenizer,
    prepare_data,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    src = asset("austen")
    docs = root / "docs"
    docs.mkdir()
    (docs / "pp.txt").write_text((src / "prideprejudice.txt").read_text()[:60_000])
    (docs / "sub").mkdir()
    (docs / "sub" / "emma.md").write_text((src / "emma.txt").read_text()[:30_000])
    (docs / "ignored.bin").write_bytes(b"\x00\x01")
    tok = train_tokenizer([docs / "pp.txt"], 300, root / "tok")
    return root, docs, tok


def test_prepare_text_dir_tail_split_round_trips(corpus, tmp_path):
    root, docs, tok_dir = corpus
    meta = prepare_data([docs], tok_dir, tmp_path, PrepareConfig(val_fraction=0.1), progress=False)
    assert meta["dtype"] == "uint16" and meta["split"] == "tail" and meta["documents"] == 2
    tok = load_tokenizer(tok_dir)
    eos = tok.token_to_id("<|endoftext|>")
    want = []
    for f in (docs / "pp.txt", docs / "sub" / "emma.md"):  # sorted order of the directory walk
        want.append(tok.encode(f.read_text(), add_special_tokens=False).ids + [eos])
    train = np.concatenate([np.asarray(a) for a in TokenShards(tmp_path, "train").arrays])
    val = np.concatenate([np.asarray(a) for a in TokenShards(tmp_path, "val").arrays])
    n_val = [int(round(len(w) * 0.1)) for w in want]
    assert train.tolist() == [t for w, k in zip(want, n_val, strict=True) for t in w[: len(w) - k]]
    assert val.tolist() == [t for w, k in zip(want, n_val, strict=True) for t in w[len(w) - k :]]
    assert (tmp_path / "tokenizer.json").is_file()


def test_prepare_jsonl_document_split(tmp_path, corpus):
    _, _, tok_dir = corpus
    lines = [json.dumps({"body": f"Document number {i}. " * (1 + i % 5)}) for i in range(300)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    meta = prepare_data(
        [tmp_path / "d.jsonl"],
        tok_dir,
        tmp_path / "out",
        PrepareConfig(val_fraction=0.2, text_field="body"),
        False,
    )
    assert meta["split"] == "documents" and meta["documents"] == 300
    tok = load_tokenizer(tok_dir)
    eos = tok.token_to_id("<|endoftext|>")
    val = np.asarray(TokenShards(tmp_path / "out", "val").arrays[0]).tolist()
    val_docs = val.count(eos)
    assert 30 <= val_docs <= 90  # ~20% of 300 documents, whole documents only
    assert val[-1] == eos
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"nope": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        prepare_data([tmp_path / "bad.jsonl"], tok_dir, tmp_path / "out", progress=False)
    # the failed run left the existing data set as it was
    assert np.asarray(TokenShards(tmp_path / "out", "val").arrays[0]).tolist() == val
    assert not [p for p in (tmp_path / "out").iterdir() if ".tmp" in p.name]


def test_large_vocab_uses_uint32(tmp_path, corpus):
    _, docs, _ = corpus
    llama3 = asset("llama3-tokenizer")
    (tmp_path / "short.txt").write_text((docs / "pp.txt").read_text()[:5000])
    meta = prepare_data(
        [tmp_path / "short.txt"], llama3, tmp_path, PrepareConfig(val_fraction=0.0), progress=False
    )
    assert meta["dtype"] == "uint32" and meta["vocab_size"] > 65536
    ids = np.asarray(TokenShards(tmp_path, "train").arrays[0])
    tok = load_tokenizer(llama3)
    assert ids[:-1].tolist() == tok.encode((tmp_path / "short.txt").read_text(), add_special_tokens=False).ids
    assert ids.max() > 65535  # the EOS id (128001) survives: it would wrap around in uint16


def test_packed_batches_cover_resume_and_split_across_ranks(corpus, tmp_path):
    _, docs, tok_dir = corpus
    prepare_data(
        [docs], tok_dir, tmp_path, PrepareConfig(val_fraction=0.0, shard_tokens=4000), progress=False
    )
    shards = TokenShards(tmp_path, "train")
    assert len(shards.arrays) > 3  # several shards
    b = PackedBatches(shards, 16, global_batch=8, seed=3)
    steps = len(b)
    seen = []
    for _ in range(steps):
        ((x, y),) = b.next_step()
        assert torch.equal(x[:, 1:], y[:, :-1])  # labels are the inputs shifted by one
        seen.extend(map(tuple, x[:, :1].tolist()))
    assert len(seen) == steps * 8
    # resume: a fresh iterator loaded with the state continues identically (also across the epoch edge)
    state = b.state_dict()
    more = [b.next_step()[0][0] for _ in range(3)]
    c = PackedBatches(shards, 16, global_batch=8, seed=3)
    c.load_state_dict(state)
    assert all(torch.equal(m, c.next_step()[0][0]) for m in more)
    assert c.epoch == 1
    # two ranks x 2 micro-batches of 2 = the same global batch of 8 rows as one process
    one = PackedBatches(shards, 16, global_batch=8, seed=3).next_step()[0][0]
    parts = {
        r: PackedBatches(shards, 16, 8, micro_batch=2, rank=r, world_size=2, seed=3).next_step()
        for r in (0, 1)
    }
    rows = [parts[r][m][0] for m in range(2) for r in (0, 1)]
    assert torch.equal(torch.cat(rows), one)
    with pytest.raises(ValueError, match="multiple"):
        PackedBatches(shards, 16, global_batch=6, micro_batch=4)


def test_cli_data_prepare(tmp_path, corpus):
    _, docs, _ = corpus
    p = subprocess.run(
        [sys.executable, "-m", "bitnetlm.cli", "data", "prepare", str(docs), "-o", str(tmp_path / "d"),
         "--train-tokenizer", "280", "--val-fraction", "0.05", "--json", "--no-progress"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    meta = json.loads(p.stdout)
    assert meta["vocab_size"] == 280 and sum(s["tokens"] for s in meta["splits"]["val"]) > 0
    assert TokenShards(tmp_path / "d", "val").num_tokens == sum(s["tokens"] for s in meta["splits"]["val"])
