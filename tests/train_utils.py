"""Shared helpers for the training tests: a small real-text data set (Jane Austen) and tiny configs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from assets import asset

ROOT = Path(__file__).resolve().parent.parent

TINY_BITNET = {
    "arch": "bitnet",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rope_theta": 10000.0,
}


def austen_data(out: Path, chars: int = 300_000, vocab: int = 384) -> Path:
    """~chars of Pride and Prejudice (+ the start of Persuasion) tokenized with a BPE trained on it."""
    from bitnetlm.train.data import PrepareConfig, prepare_data, train_tokenizer

    src = asset("austen")
    text_dir = out / "text"
    text_dir.mkdir(parents=True, exist_ok=True)
    (text_dir / "pp.txt").write_text((src / "prideprejudice.txt").read_text()[:chars])
    (text_dir / "persuasion.txt").write_text((src / "persuasion.txt").read_text()[: chars // 4])
    data = out / "data"
    train_tokenizer([text_dir / "pp.txt"], vocab, data)
    prepare_data([text_dir], data, data, PrepareConfig(val_fraction=0.05), progress=False)
    return data


def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    return n


def run_cli(args: list[str], env_extra: dict | None = None, launcher: list[str] | None = None, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env_extra or {})}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = (launcher or [sys.executable, "-m", "bitnetlm.cli"]) + args
    return subprocess.Popen(cmd, env=env, cwd=ROOT, **kw)
