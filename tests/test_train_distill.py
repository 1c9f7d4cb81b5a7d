"""From full precision: gradual quantization warm-up + distillation beats naive ternarization + QAT."""

from __future__ import annotations

import copy

import pytest
import torch
from train_utils import austen_data, one_thread

from bitnetlm.models import ModelConfig, build_model
from bitnetlm.train import TrainConfig, train
from bitnetlm.train.data import TokenShards
from bitnetlm.train.loop import init_weights

TINY_LLAMA = dict(
    arch="llama",
    hidden_size=64,
    intermediate_size=172,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rope_theta=10000.0,
    hidden_act="silu",
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    quant="none",
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    n = one_thread()
    root = tmp_path_factory.mktemp("distill")
    data = austen_data(root)
    torch.manual_seed(0)
    teacher = build_model(ModelConfig(**TINY_LLAMA, vocab_size=TokenShards(data).vocab_size), mode="fp")
    init_weights(teacher)
    common = dict(
        data=str(data), seq_len=64, progress=False, tensorboard=False, export=False,
        eval_tokens=8192, log_every=10, resume="never",
    )  # fmt: skip
    # "pretrain" the full-precision teacher (a stand-in for a real pretrained LLaMA checkpoint)
    s = train(
        TrainConfig(**common, batch_size=16, quantize=False, max_steps=300, lr=1e-2, schedule="cosine",
                    warmup_steps=10, out_dir=str(root / "teacher")),
        model=teacher,
    )  # fmt: skip
    yield data, teacher, s["val_loss"], common, root
    torch.set_num_threads(n)


def test_warmup_and_distillation_beat_naive_ternarization(setup):
    data, teacher, teacher_val, common, root = setup
    # a short conversion budget: the same 30 steps for both
    steps = dict(batch_size=8, max_steps=30, lr=3e-3, schedule="cosine", warmup_steps=3)
    naive = train(
        TrainConfig(**common, **steps, out_dir=str(root / "naive")),
        model=copy.deepcopy(teacher),
    )
    ours = train(
        TrainConfig(
            **common, **steps, out_dir=str(root / "kd"),
            quant_warmup_steps=15, teacher="initial", kd_weight=0.9, kd_temperature=1.0,
        ),
        model=copy.deepcopy(teacher),
    )  # fmt: skip
    print(f"teacher {teacher_val:.4f}  naive+QAT {naive['val_loss']:.4f}  warm-up+KD {ours['val_loss']:.4f}")
    assert ours["val_loss"] < naive["val_loss"] - 0.02
    assert teacher_val < ours["val_loss"]  # sanity: ternary is not better than its full-precision teacher
