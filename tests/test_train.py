"""Training on real text (Jane Austen): loss below the unigram baseline, export, exact kill-and-resume."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from train_utils import TINY_BITNET, austen_data, one_thread, run_cli

from bitnetlm.train import TrainConfig, train
from bitnetlm.train.checkpoint import latest_checkpoint, load_checkpoint
from bitnetlm.train.data import TokenShards, eval_batches, unigram_cross_entropy


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return austen_data(tmp_path_factory.mktemp("austen"))


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    n = one_thread()
    out = tmp_path_factory.mktemp("run")
    cfg = TrainConfig(
        data=str(data),
        model_config=TINY_BITNET,
        seq_len=64,
        batch_size=8,
        max_steps=400,
        warmup_steps=20,
        lr=2e-2,
        schedule="cosine",
        out_dir=str(out),
        progress=False,
        log_every=10,
        eval_every=200,
        eval_tokens=8192,
        tensorboard=False,
    )
    summary = train(cfg)
    torch.set_num_threads(n)
    return out, summary


def test_tiny_model_beats_unigram_on_real_text(data, trained):
    out, summary = trained
    baseline = unigram_cross_entropy(TokenShards(data, "train"), TokenShards(data, "val"))
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(r["loss"] for r in rows if "loss" in r)
    assert summary["step"] == 400
    # a model that learned only token frequencies would sit at the baseline; demand a clear margin
    assert summary["val_loss"] < baseline - 0.25, (summary["val_loss"], baseline)
    assert first > baseline  # it started above (random init) and trained its way below
    assert any("val_loss" in r for r in rows if r["step"] == 200)


def test_export_loads_with_identical_outputs(data, trained):
    import bitnetlm
    from bitnetlm.models import ModelConfig, build_model

    out, summary = trained
    model, tok = bitnetlm.load(out / "final")
    assert tok is not None and tok.vocab_size == TokenShards(data).vocab_size
    sd, _, state = load_checkpoint(latest_checkpoint(out / "checkpoints"))
    mc = ModelConfig(
        **{
            **TINY_BITNET,
            "vocab_size": TokenShards(data).vocab_size,
            "bos_token_id": None,
            "eos_token_id": None,
        }
    )
    ref = build_model(mc, mode="train")
    ref.load_state_dict(sd)
    ref.eval()
    # the export is exact: every projection's ternary codes and scale, every other tensor
    from bitnetlm.quant.bitlinear import BitLinear

    rm = dict(ref.named_modules())
    bit = [n for n, mod in model.named_modules() if isinstance(mod, BitLinear)]
    assert len(bit) == 7 * TINY_BITNET["num_hidden_layers"]
    for name in bit:
        mod, r = model.get_submodule(name), rm[name]
        assert torch.equal(mod.ternary_weight(), r.ternary_weight()), name
        assert torch.equal(mod.scale(), r.scale()), name
    rsd = ref.state_dict()
    shared = [n for n in model.state_dict() if n in rsd]  # (not the projections' latent float weights)
    assert len(shared) >= 2 * TINY_BITNET["num_hidden_layers"] + 2  # embedding, norms
    for name in shared:
        assert torch.equal(model.state_dict()[name].float(), rsd[name].float()), name
    x, _ = next(eval_batches(TokenShards(data, "val"), 64, 4))
    with torch.no_grad():
        want = ref(x)
        got = model(x)
    # The float rounding order differs (CPU kernels vary by machine; even in float64 an activation can sit on an
    # int8 rounding tie), so now and then one activation code moves and the logits of a position or a few move by
    # ~1e-3 (seen on Zen 5 and Xeon CPUs). Such flips are rare and small; a wrong export is neither.
    for got_, want_, tol in ((got, want, 1e-4), (None, None, 1e-5)):
        if got_ is None:  # float64, the reference backend
            m64, _ = bitnetlm.load(out / "final", dtype=torch.float64, backend="reference")
            with torch.no_grad():
                got_, want_ = m64(x), ref.double()(x)
        d = (got_ - want_).abs()
        moved = (d > tol).any(-1).float().mean()  # positions [4, 64] with any logit beyond tol
        assert moved < 0.05 and d.max() < 0.05, (tol, moved, d.max())
        assert (got_.argmax(-1) == want_.argmax(-1)).float().mean() > 0.99


def _small_run_args(data: Path, out: Path, max_steps: int) -> list[str]:
    mc = json.dumps(TINY_BITNET)
    return [
        "train",
        "--data", str(data), "--model-config", mc, "--out-dir", str(out),
        "--seq-len", "32", "--batch-size", "4", "--max-steps", str(max_steps), "--warmup-steps", "5",
        "--lr", "1e-2", "--save-every", "4", "--keep-last", "2", "--eval-every", "0", "--log-every", "1",
        "--progress", "false", "--tensorboard", "false", "--export", "false", "--deterministic", "true",
    ]  # fmt: skip


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_sigkill_and_resume_is_bitwise_identical(data, tmp_path):
    steps = 24
    ref = run_cli(_small_run_args(data, tmp_path / "ref", steps))
    victim = run_cli(_small_run_args(data, tmp_path / "victim", steps))
    ckroot = tmp_path / "victim" / "checkpoints"
    deadline = time.time() + 120
    while time.time() < deadline and victim.poll() is None:
        c = latest_checkpoint(ckroot)
        if c is not None and int(c.name.split("_")[1]) >= 8:
            victim.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    assert victim.wait(60) == -signal.SIGKILL, "the run ended before it could be killed mid-way"
    killed_at = int(latest_checkpoint(ckroot).name.split("_")[1])
    assert killed_at < steps
    resumed = run_cli(
        _small_run_args(data, tmp_path / "victim", steps) + ["--json"], stdout=subprocess.PIPE, text=True
    )
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0
    assert json.loads(out)["resumed_from"] == killed_at  # it really resumed instead of starting over
    assert ref.wait(300) == 0
    a = _tensors(latest_checkpoint(tmp_path / "ref" / "checkpoints"))
    b = _tensors(latest_checkpoint(ckroot))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the logged loss curve after the resume point matches too (bitwise: same floats)
    la = [json.loads(x) for x in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x) for x in (tmp_path / "victim" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("loss") for r in la] == [r.get("loss") for r in lb]


CRASH_IN_SAVE = r"""
import os, signal, sys, torch
torch.set_num_threads(1)
import safetensors.torch as st
from bitnetlm.train import TrainConfig
from bitnetlm.train.loop import Trainer
cfg = TrainConfig(**__import__("json").loads(sys.argv[1]))
tr = Trainer(cfg)
for _ in range(4):
    tr.train_step()
tr.save()                      # step 4: a good checkpoint
for _ in range(2):
    tr.train_step()
real = st.save_file
def dying_save(tensors, path, metadata=None):
    real(tensors, path, metadata=metadata)
    with open(path, "r+b") as f:  # leave a torn file behind, as a power cut would
        f.truncate(os.path.getsize(path) // 2)
    os.kill(os.getpid(), signal.SIGKILL)
st.save_file = dying_save
tr.save()                      # step 6: dies half way
"""


def test_checkpoint_interrupted_mid_write_leaves_previous_intact(data, tmp_path):
    out = tmp_path / "run"
    cfg = dict(
        data=str(data), model_config=TINY_BITNET, seq_len=32, batch_size=4, max_steps=10, warmup_steps=2,
        out_dir=str(out), progress=False, tensorboard=False, export=False,
    )  # fmt: skip
    p = subprocess.run([sys.executable, "-c", CRASH_IN_SAVE, json.dumps(cfg)], capture_output=True, text=True)
    assert p.returncode == -signal.SIGKILL, p.stderr
    root = out / "checkpoints"
    stale = [q for q in root.iterdir() if ".tmp-" in q.name]
    assert stale, "the crash should have left a partial temporary checkpoint"
    good = latest_checkpoint(root)
    assert good.name == "step_00000004"
    sd, _, state = load_checkpoint(good)  # loads cleanly: not torn
    assert state["step"] == 4 and sd
    # resuming picks the intact checkpoint and cleans the debris
    one = one_thread()
    try:
        summary = train(TrainConfig(**cfg))
    finally:
        torch.set_num_threads(one)
    assert summary["step"] == 10
    assert not [q for q in root.iterdir() if ".tmp-" in q.name]


def test_early_stopping_keep_last_and_logs(data, tmp_path):
    n = one_thread()
    try:
        # lr 0: the held-out loss can never improve, so the run stops after `early_stopping` evaluations
        s = train(
            TrainConfig(
                data=str(data), model_config=TINY_BITNET, seq_len=32, batch_size=4, max_steps=50, lr=0.0,
                warmup_steps=0, eval_every=2, early_stopping=2, save_every=2, keep_last=2, eval_tokens=1024,
                out_dir=str(tmp_path), progress=False, tensorboard=True, export=False,
            )
        )  # fmt: skip
    finally:
        torch.set_num_threads(n)
    assert s["stopped_early"] and s["step"] == 6  # evals at 2 (best), 4 (no gain), 6 (no gain) -> stop
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert ckpts == ["step_00000004", "step_00000006"]  # keep_last=2
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4, 6, 6]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_yaml_config_and_flags(tmp_path):
    import argparse

    from bitnetlm.train.config import add_config_flags, config_from_args

    example = Path(__file__).resolve().parent.parent / "examples" / "train_tiny_austen.yaml"
    p = argparse.ArgumentParser()
    add_config_flags(p)
    args = p.parse_args(["--max-steps", "7", "--betas", "0.8", "0.99", "--quantize", "false"])
    cfg = config_from_args(args, str(example)).validate()
    assert cfg.max_steps == 7 and cfg.betas == [0.8, 0.99] and cfg.quantize is False
    assert cfg.schedule == "two_stage" and cfg.model_config["arch"] == "bitnet"  # the rest from the YAML
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: x\nlearning_rate: 1\n")
    with pytest.raises(ValueError, match="learning_rate"):
        TrainConfig.from_yaml(bad)
    with pytest.raises(ValueError, match="teacher"):
        TrainConfig(data="x", model_config={"arch": "bitnet"}, kd_weight=0.5).validate()


def test_two_stage_schedule_cuts_lr_and_weight_decay():
    from bitnetlm.train.schedule import LRSchedule, apply_weight_decay, param_groups

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    groups = param_groups(model, 0.1)
    assert [len(g["params"]) for g in groups] == [1, 4]  # only the Linear weight decays
    opt = torch.optim.AdamW(groups, lr=1.0, betas=(0.9, 0.95))
    sched = LRSchedule("two_stage", max_steps=100, warmup_steps=10, stage2_at=0.5, stage2_ratio=0.4)
    lam = torch.optim.lr_scheduler.LambdaLR(opt, sched)
    lrs, wds = [], []
    for step in range(100):
        apply_weight_decay(opt, sched, step)
        lrs.append(opt.param_groups[0]["lr"])
        wds.append(opt.param_groups[0]["weight_decay"])
        opt.step()
        lam.step()
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)  # linear warm-up
    assert lrs[49] == pytest.approx(1.0) and lrs[50] == pytest.approx(0.4)  # the cut at the midpoint
    assert lrs[99] < 0.01 and all(a >= b for a, b in zip(lrs[50:], lrs[51:], strict=False))
    assert set(wds[:50]) == {0.1} and set(wds[50:]) == {0.0}  # weight decay off in stage 2


def test_resume_with_more_steps_continues_training(data, tmp_path):
    n = one_thread()
    common = dict(
        data=str(data), model_config=TINY_BITNET, seq_len=32, batch_size=4, warmup_steps=1, lr=1e-2,
        schedule="cosine", out_dir=str(tmp_path), progress=False, tensorboard=False, export=False, log_every=1,
    )  # fmt: skip
    try:
        train(TrainConfig(**common, max_steps=3))
        s = train(TrainConfig(**common, max_steps=6))  # the schedule follows the new max_steps
    finally:
        torch.set_num_threads(n)
    assert s["resumed_from"] == 3 and s["step"] == 6
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"lr"' in x]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[3]["lr"] > 0.5e-2  # not the old run's decayed-to-zero rate


def test_wsd_schedule_warms_up_holds_then_decays_linearly_to_its_floor():
    from bitnetlm.train.schedule import LRSchedule

    s = LRSchedule("wsd", max_steps=100, warmup_steps=10, min_ratio=0.05, stage2_at=0.8)
    assert [s(k) for k in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])  # linear warm-up
    assert s(10) == s(50) == s(80) == 1.0  # stable until 80% of training
    # then (steps left) / (20 steps of decay), never under 5%
    assert [s(k) for k in (81, 90, 98, 99)] == pytest.approx([0.95, 0.5, 0.1, 0.05])
    assert s.weight_decay_on(99)
    with pytest.raises(ValueError, match="known: two_stage, cosine, linear, constant, wsd"):
        LRSchedule("wds", max_steps=10)
