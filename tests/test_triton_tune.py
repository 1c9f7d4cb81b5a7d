"""The step-tuned tables (the user's from `bitnet tune`, the shipped kernels/triton/configs/): named per GPU model,
holding only candidates (each listed once), taken ahead of any timing on the GPU they name, the user's first;
`bitnet tune` itself; the tuner's settings (`tune.configure`)."""

from __future__ import annotations

import dataclasses
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
from bitnetlm.kernels.triton.attention import prefetch_candidates
from bitnetlm.kernels.triton.decode import qkv_rope_candidates
from bitnetlm.kernels.triton.launch import linear_candidates
assert not tune.INTERPRET
files = sorted(tune.CONFIG_DIR.glob("*.json"))
n = 0
for f in files:
    for skey, cfg in json.loads(f.read_text()).items():
        if skey == "plan":  # the DecodePlan overrides (test_triton_plan.py), not a tile
            continue
        key = ast.literal_eval(re.sub(r"torch\.(\w+)", r"'\1'", skey))
        kind = key[0]
        if kind == "qkv_rope":
            _, rows, k, m, _, _, _, preq = key
            cands = qkv_rope_candidates(m, rows, k, preq)
        elif kind == "attn_pf":
            cands = prefetch_candidates(key[1], key[3])
        elif kind.startswith("w8"):
            cands = tune._w8_candidates(key[3])
        else:
            path, out, k, m, gated = key[:5]
            cands = linear_candidates(m, out, k, gated, None if path == "auto" else path)
        assert cfg in cands, f"{f.name}: {skey}: {cfg} is not one of its {len(cands)} candidates"
        dup = [c for i, c in enumerate(cands) if c in cands[:i]]
        assert not dup, f"{f.name}: {skey}: candidates timed twice: {dup}"
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


@pytest.fixture
def tuner():
    """The tune module, its settings restored after the test."""
    from bitnetlm.kernels.triton import tune

    before = tune.settings()
    yield tune
    tune.configure(**dataclasses.asdict(before))


def _tables_in(monkeypatch, tune, tmp_path, user: dict, shipped: dict, name: str = "Test GPU 9"):
    monkeypatch.setattr(tune, "CONFIG_DIR", tmp_path / "shipped")
    tune.configure(user_tables=tmp_path / "user")
    for d, table in ((tmp_path / "shipped", shipped), (tmp_path / "user", user)):
        d.mkdir()
        if table is not None:
            (d / "Test_GPU_9.json").write_text(json.dumps(table))
    tune._tables.cache_clear()
    return tune


def test_user_table_first_then_shipped_and_stale_entries_skipped(monkeypatch, tmp_path, tuner):
    cands = [dict(BN=8), dict(BN=16), dict(BN=32)]
    k1, k2, k3 = ("a", 1), ("b", 2), ("c", 3)
    user = {str(k1): dict(BN=32), str(k2): dict(BN=64)}  # k2: a tile no longer among the candidates
    shipped = {str(k1): dict(BN=8), str(k2): dict(BN=16)}
    tune = _tables_in(monkeypatch, tuner, tmp_path, user, shipped)
    assert tune.table_choice(k1, cands, "Test GPU 9") == dict(BN=32)
    assert tune.table_choice(k2, cands, "Test GPU 9") == dict(BN=16)
    assert tune.table_choice(k3, cands, "Test GPU 9") is None
    assert tune.table_choice(k1, cands, "Other GPU") is None
    tune.configure(user_tables=None)  # the shipped table only
    assert tune.table_choice(k1, cands, "Test GPU 9") == dict(BN=8)


def test_attention_prefetch_count_is_a_step_only_key(monkeypatch, tmp_path, tuner):
    """The attention's prefetch count (`attention._prefetch_count`): a step table's count where it holds one that is
    still a candidate, else the first candidate, `prefetch_programs`' table; never timed on its own (no launch)."""
    from bitnetlm.kernels.triton import attention
    from bitnetlm.kernels.triton.plan import DecodePlan

    keys = [("attn_pf", 1, 5, True, (n,)) for n in (100, 200, 300)]
    user = {str(keys[0]): {"programs": 512}, str(keys[1]): {"programs": 999}}  # 999: no longer a candidate
    tune = _tables_in(monkeypatch, tuner, tmp_path, user, None)
    for mod in (tune, attention):  # the CPU suite runs Triton's interpreter, which never tunes
        monkeypatch.setattr(mod, "INTERPRET", False)
    tune.configure(mode="chain", step_tables=True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Test GPU 9")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(tune, "_disk_load", lambda: pytest.fail("a step-only key went on to the disk cache"))
    plan = DecodePlan()
    w = [torch.empty(n, dtype=torch.uint8) for n in (100, 200, 300)]
    try:
        first = attention.prefetch_programs(1, kv8=True)
        assert first > 0 and attention.prefetch_candidates(1, True)[0] == {"programs": first}
        assert attention._prefetch_count(1, 5, True, w[:1], plan) == 512
        assert attention._prefetch_count(1, 5, True, w[1:2], plan) == first
        assert attention._prefetch_count(1, 5, True, w[2:], plan) == first
        assert [len(tune._candidates[k]) for k in keys] == [
            len(plan.attn_pf_counts) + (first not in plan.attn_pf_counts)
        ] * 3
        override = DecodePlan(attn_pf_programs=7)  # the benchmarks' override skips the key
        assert attention._prefetch_count(2, 5, True, w[:1], override) == 7
        assert ("attn_pf", 2, 5, True, (100,)) not in tune._choice
    finally:
        for k in keys:
            tune._choice.pop(k, None)
            tune._candidates.pop(k, None)


def test_unreadable_user_table_falls_back_to_shipped(monkeypatch, tmp_path, tuner):
    tune = _tables_in(monkeypatch, tuner, tmp_path, None, {str(("a", 1)): dict(BN=16)})
    (tmp_path / "user" / "Test_GPU_9.json").write_text("{not json")
    assert tune.table_choice(("a", 1), [dict(BN=8), dict(BN=16)], "Test GPU 9") == dict(BN=16)


def test_tuner_settings_default_under_the_cache_folder_and_check_the_mode(monkeypatch, tuner):
    """The disk cache and the user's tables live under the cache folder, $BITNET_CACHE when set; a mode the tuner
    does not know is a one-line error that changes nothing."""
    monkeypatch.setenv("BITNET_CACHE", "/somewhere/cache")
    root = tuner.cache_root()
    assert str(root) == "/somewhere/cache"
    before = tuner.settings()
    assert before.cache.name == "triton_tune.json" and before.user_tables.name == "step_tune"
    with pytest.raises(ValueError, match="mode must be one of chain, graph, bench, off, found '0'"):
        tuner.configure(mode="0")
    assert tuner.settings() == before
    prev = tuner.configure(mode="off", cache=None)
    assert prev == before and tuner.settings().mode == "off" and tuner.settings().cache is None


def test_write_table_merges_and_never_clobbers_a_foreign_file(tmp_path):
    from bitnetlm.runtime.cuda.step_tune import write_table

    path = tmp_path / "t" / "GPU.json"
    write_table(path, {"k1": dict(BN=8), "k2": dict(BN=16)})
    write_table(path, {"k2": dict(BN=32), "k3": dict(BN=4)})
    assert json.loads(path.read_text()) == {"k1": dict(BN=8), "k2": dict(BN=32), "k3": dict(BN=4)}
    bad = tmp_path / "notes.json"
    bad.write_text("my notes, not a table")
    with pytest.raises(ValueError, match="notes.json: not a JSON table"):
        write_table(bad, {"k": dict(BN=8)})
    assert bad.read_text() == "my notes, not a table"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.json", "t"]  # no temporary file left


def test_tune_command_needs_a_gpu_and_one_shape(monkeypatch, capsys):
    from bitnetlm.cli import main

    assert main(["tune"]) == 2
    assert "exactly one of -m/--model or --shape" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["tune", "--shape", "2b4t"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_shipped_choice_is_taken_without_timing(monkeypatch, tmp_path, tuner):
    tune = tuner
    monkeypatch.setattr(tune, "CONFIG_DIR", tmp_path)
    tune.configure(user_tables=None, mode="chain", cache=None)
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
        for k in (("test-shipped", 1), ("test-stale", 1)):
            tune._choice.pop(k, None)
            tune._candidates.pop(k, None)


@pytest.mark.gpu
def test_tune_shape_writes_a_table_the_tuner_then_takes(tmp_path, tuner):
    """`bitnet tune`'s library function on a small shape: every key of the step gets one of its candidates into
    the table, which the tuner then takes."""
    from bitnetlm.models import ModelConfig
    from bitnetlm.runtime.cuda import step_tune

    tune = tuner
    tune.configure(user_tables=tmp_path, mode="chain", cache=None)
    cfg = ModelConfig(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    rows = step_tune.tune_shape(cfg, batches=(1, 4), context=64, reps=5, rounds=1)
    path = tune.config_file(torch.cuda.get_device_name(), tmp_path)
    assert [r["batch"] for r in rows] == [1, 4] and rows[0]["table"] == str(path)
    table = json.loads(path.read_text())
    assert len(table) == sum(r["keys"] for r in rows) > 0
    for key, cands in tune._candidates.items():  # the last batch's keys
        if len(cands) > 1:
            assert table[str(key)] in cands
            assert tune.table_choice(key, cands, torch.cuda.get_device_name()) == table[str(key)]
    tune._choice.clear()
    tune._tables.cache_clear()
