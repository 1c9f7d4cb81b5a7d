"""The tuner's shipped step-tuned tables (kernels/triton/configs/): named per GPU model, holding only candidates,
and taken ahead of any timing on the GPU they name."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

# Runs in a fresh interpreter without TRITON_INTERPRET: the candidate lists of compiled kernels (the interpreter's
# lists are one small tile each) for every key of every shipped table.
_CHECK = r"""
import ast, json, re
from bitnetlm.kernels.triton import tune
from bitnetlm.kernels.triton.decode import qkv_rope_candidates
from bitnetlm.kernels.triton.launch import linear_candidates
assert not tune.INTERPRET
files = sorted(tune.CONFIG_DIR.glob("*.json"))
n = 0
for f in files:
    for skey, cfg in json.loads(f.read_text()).items():
        key = ast.literal_eval(re.sub(r"torch\.(\w+)", r"'\1'", skey))
        kind = key[0]
        if kind == "qkv_rope":
            _, rows, k, m, _, _, _, preq = key
            cands = qkv_rope_candidates(m, rows, k, preq)
        elif kind.startswith("w8"):
            cands = tune._w8_candidates(key[3])
        else:
            path, out, k, m, gated = key[:5]
            cands = linear_candidates(m, out, k, gated, None if path == "auto" else path)
        assert cfg in cands, f"{f.name}: {skey}: {cfg} is not one of its {len(cands)} candidates"
        n += 1
print(len(files), n)
"""


def test_config_file_names_the_gpu_model():
    from bitnetlm.kernels.triton import tune

    assert tune.config_file("NVIDIA H200").name == "NVIDIA_H200.json"
    assert tune.config_file("NVIDIA H100 80GB HBM3").name == "NVIDIA_H100_80GB_HBM3.json"


def test_shipped_tables_hold_only_candidates():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    files, entries = map(int, r.stdout.split())
    assert files >= 1 and entries >= 30  # the H200's table: batch buckets 1-64 of the 2B4T shape


@pytest.mark.gpu
def test_shipped_choice_is_taken_without_timing(monkeypatch, tmp_path):
    from bitnetlm.kernels.triton import tune

    monkeypatch.setattr(tune, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(tune, "TUNE", True)
    monkeypatch.setattr(tune, "TUNE_CACHE", "")
    tune._shipped.cache_clear()
    cands = [dict(BN=8), dict(BN=16), dict(BN=32)]
    table = {str(("test-shipped", 1)): dict(BN=16), str(("test-stale", 1)): dict(BN=64)}
    tune.config_file(torch.cuda.get_device_name()).write_text(json.dumps(table))
    timed = []
    w = torch.zeros(16, device="cuda")
    try:
        assert tune._tune(("test-shipped", 1), lambda: cands, lambda c, w: timed.append(c), w) == dict(BN=16)
        assert timed == []  # taken from the table: nothing was timed
        # an entry that is no longer a candidate is ignored: the candidates are timed as without a table
        assert tune._tune(("test-stale", 1), lambda: cands, lambda c, w: timed.append(c), w) in cands
        assert {c["BN"] for c in timed} == {8, 16, 32}
    finally:
        tune._shipped.cache_clear()
        for k in (("test-shipped", 1), ("test-stale", 1)):
            tune._choice.pop(k, None)
            tune._candidates.pop(k, None)
