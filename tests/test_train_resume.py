"""Resuming from damaged checkpoints: fall back to the newest one that verifies, or one line naming the file."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from train_utils import TINY_BITNET, austen_data, one_thread

from bitnetlm.cli import main
from bitnetlm.train import TrainConfig, train
from bitnetlm.train.checkpoint import latest_checkpoint, list_checkpoints, verify_checkpoint


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return austen_data(tmp_path_factory.mktemp("austen"), chars=60_000, vocab=256)


def _cfg(data, out, steps, **kw) -> TrainConfig:
    return TrainConfig(
        data=str(data), model_config=TINY_BITNET, seq_len=32, batch_size=4, max_steps=steps, warmup_steps=1,
        lr=1e-2, schedule="constant", save_every=2, keep_last=3, out_dir=str(out), progress=False, tensorboard=False, export=False,
        deterministic=True, log_every=1, **kw,
    )  # fmt: skip


def _train(cfg):
    n = one_thread()
    try:
        return train(cfg)
    finally:
        torch.set_num_threads(n)


def _flip_a_byte(path):
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # same size: only the checksum can tell
    path.write_bytes(bytes(raw))


def test_damaged_latest_checkpoint_falls_back_to_the_newest_that_verifies(data, tmp_path, capsys):
    out = tmp_path / "run"
    _train(_cfg(data, out, 6))
    root = out / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == ["step_00000002", "step_00000004", "step_00000006"]
    _flip_a_byte(root / "step_00000006" / "model.safetensors")
    assert "CRC-32 differs" in verify_checkpoint(root / "step_00000006")
    capsys.readouterr()
    summary = _train(_cfg(data, out, 8))
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("checkpoint ")]
    assert "step_00000006" in line and "model.safetensors" in line and "resuming from step_00000004" in line
    assert summary["resumed_from"] == 4 and summary["step"] == 8
    assert (root / "step_00000006.corrupt").is_dir()  # kept aside, out of keep_last's way
    assert latest_checkpoint(root).name == "step_00000008"
    # the fallback resume is exact: the same weights as a run that never stopped
    ref = tmp_path / "ref"
    _train(_cfg(data, ref, 8))
    a = load_file(str(latest_checkpoint(ref / "checkpoints") / "model.safetensors"))
    b = load_file(str(latest_checkpoint(root) / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_no_checkpoint_verifies_is_one_line_naming_the_file(data, tmp_path, capsys):
    out = tmp_path / "run"
    _train(_cfg(data, out, 4))
    root = out / "checkpoints"
    for ck in list_checkpoints(root):  # torn copies: every file cut short
        f = ck / "optim.pt"
        f.write_bytes(f.read_bytes()[:100])
    args = ["train", "--data", str(data), "--model-config", json.dumps(TINY_BITNET), "--out-dir", str(out)]
    args += ["--seq-len", "32", "--batch-size", "4", "--max-steps", "6", "--progress", "false"]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert str(root / "step_00000004" / "optim.pt") in line and "100 bytes" in line, line
    # an explicit resume path that does not verify: one line too
    trainer = json.loads((root / "step_00000002" / "trainer.json").read_text())
    assert trainer["files"]["optim.pt"]["bytes"] > 100
    assert main([*args, "--resume", str(root / "step_00000002")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert str(root / "step_00000002" / "optim.pt") in line


def test_damaged_record_and_older_checkpoints(data, tmp_path):
    out = tmp_path / "run"
    _train(_cfg(data, out, 4))
    root = out / "checkpoints"
    meta = root / "step_00000004" / "trainer.json"
    meta.write_text(meta.read_text()[:50])  # the record itself torn
    assert "trainer.json: unreadable" in verify_checkpoint(root / "step_00000004")
    state = json.loads((root / "step_00000002" / "trainer.json").read_text())
    del state["files"]  # written before sizes and hashes were recorded: the files need only be there
    (root / "step_00000002" / "trainer.json").write_text(json.dumps(state))
    assert verify_checkpoint(root / "step_00000002") is None
    assert _train(_cfg(data, out, 5))["resumed_from"] == 2
