"""Tensor parallelism over NCCL: `torchrun --nproc-per-node N ... generate --tp N` on N GPUs prints the greedy
text of one process running the model's own forward (GPU only; N = 2 and 4 where the GPUs exist)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

ARGS = [
    "generate",
    "-p",
    "Elizabeth was",
    "-n",
    "24",
    "--temp",
    "0",
    "--device",
    "cuda",
    "--dtype",
    "float32",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(args, launcher=None):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = (launcher or [sys.executable, "-m", "bitnetlm.cli"]) + args
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout


@pytest.mark.parametrize("n", [2, 4])
def test_nccl_tp_greedy_text_equals_one_process(n):
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs")
    args = [*ARGS, "-m", "bitnet-tiny"]  # 8 heads, 4 KV heads
    one = _cli([*args, "--enforce-eager"])
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
                f"--master-port={_free_port()}", "-m", "bitnetlm.cli"]  # fmt: skip
    assert _cli([*args, "--tp", str(n)], launcher=launcher) == one
