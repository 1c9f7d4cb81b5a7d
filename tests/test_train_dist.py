"""Distributed: `torchrun` with 2 CPU processes (gloo) gives the loss curve of 1 process, same global batch."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from train_utils import TINY_BITNET, austen_data, run_cli


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return austen_data(tmp_path_factory.mktemp("dist"), chars=120_000)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(data: Path, out: Path) -> list[str]:
    return [
        "train", "--data", str(data), "--model-config", json.dumps(TINY_BITNET), "--out-dir", str(out),
        "--seq-len", "32", "--batch-size", "8", "--max-steps", "6", "--warmup-steps", "2", "--lr", "1e-2",
        "--log-every", "1", "--progress", "false", "--tensorboard", "false", "--resume", "never",
    ]  # fmt: skip


def _curve(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r] + [r["val_loss"] for r in rows if "val_loss" in r]


def _torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", f"--master-port={_free_port()}",
            "-m", "bitnetlm.cli"]  # fmt: skip


def _run(args, launcher=None):
    p = run_cli(args, launcher=launcher, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=600)
    # torchrun's own report takes the last ~2,500 characters; the workers' lines (a rare gloo teardown abort,
    # "terminate called without an active exception", seen once on 2026-12-04) come before it
    assert p.returncode == 0, err[-12000:]
    return out


def test_ddp_two_processes_match_one(data, tmp_path):
    _run(_args(data, tmp_path / "one") + ["--export", "false"])
    _run(_args(data, tmp_path / "ddp") + ["--export", "false"], launcher=_torchrun(2))
    one, two = _curve(tmp_path / "one"), _curve(tmp_path / "ddp")
    assert len(one) == len(two) == 7
    assert two == pytest.approx(one, rel=1e-4, abs=1e-5)


@pytest.mark.slow
def test_fsdp2_two_processes_match_one_and_export(data, tmp_path):
    import bitnetlm

    _run(_args(data, tmp_path / "one") + ["--export", "false"])
    _run(
        _args(data, tmp_path / "fsdp") + ["--distributed", "fsdp", "--save-every", "3"], launcher=_torchrun(2)
    )
    assert _curve(tmp_path / "fsdp") == pytest.approx(_curve(tmp_path / "one"), rel=1e-3, abs=1e-4)
    model, tok = bitnetlm.load(tmp_path / "fsdp" / "final")
    assert tok is not None and model.config.vocab_size == tok.vocab_size
