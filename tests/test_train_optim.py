"""The optimizers the training config accepts: Lion against its update rule, and each one training a tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from train_utils import TINY_BITNET, austen_data, one_thread

from bitnetlm.cli import main
from bitnetlm.train import Lion, TrainConfig, train
from bitnetlm.train.optim import OPTIMIZERS


def _lion_by_hand(p, grads, lr, b1, b2, wd):
    """Chen et al. 2023, Algorithm 2, written out: c = b1 m + (1 - b1) g; p -= lr (sign(c) + wd p);
    m = b2 m + (1 - b2) g."""
    p, m = p.clone(), torch.zeros_like(p)
    for g in grads:
        c = b1 * m + (1 - b1) * g
        p = p - lr * (torch.sign(c) + wd * p)
        m = b2 * m + (1 - b2) * g
    return p, m


@pytest.mark.parametrize("wd", [0.0, 0.3])
def test_lion_follows_its_update_rule(wd):
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    grads = [torch.randn(5, 3, generator=gen, dtype=torch.float64) for _ in range(6)]
    grads[2][0, 0] = 0.0  # sign(0) = 0: a coordinate with no signal does not move (but decays)
    p = torch.nn.Parameter(p0.clone())
    opt = Lion([p], lr=0.01, betas=(0.9, 0.99), weight_decay=wd)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    want_p, want_m = _lion_by_hand(p0, grads, 0.01, 0.9, 0.99, wd)
    torch.testing.assert_close(p.detach(), want_p, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(opt.state[p]["exp_avg"], want_m, rtol=1e-14, atol=1e-15)
    # every coordinate moves by exactly lr (plus its decay) each step: the sign update
    q = torch.nn.Parameter(p0.clone())
    opt = Lion([q], lr=0.01, betas=(0.9, 0.99), weight_decay=wd)
    q.grad = grads[0].clone()
    opt.step()
    torch.testing.assert_close((p0 * (1 - 0.01 * wd) - q.detach()).abs(), torch.full_like(p0, 0.01))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return austen_data(tmp_path_factory.mktemp("austen"), chars=60_000, vocab=256)


@pytest.mark.parametrize("name,lr", [("adamw", 1e-2), ("adam", 1e-2), ("lion", 2e-3), ("sgd", 0.3)])
def test_each_optimizer_trains_a_tiny_model_through_the_config(data, tmp_path, name, lr):
    cfg = TrainConfig(
        data=str(data), model_config=TINY_BITNET, optimizer=name, lr=lr, seq_len=32, batch_size=8,
        max_steps=30, warmup_steps=3, schedule="constant", out_dir=str(tmp_path), progress=False, log_every=1,
        tensorboard=False, export=False, eval_every=0,
    )  # fmt: skip
    n = one_thread()
    try:
        summary = train(cfg)
    finally:
        torch.set_num_threads(n)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 30 and summary["step"] == 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, (name, first, last)


def test_unknown_optimizer_is_one_line_listing_the_choices(tmp_path, capsys):
    args = [
        "train",
        "--data",
        str(tmp_path),
        "--model-config",
        json.dumps(TINY_BITNET),
        "--optimizer",
        "adagrad",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert "adagrad" in line and all(o in line for o in OPTIMIZERS), line
