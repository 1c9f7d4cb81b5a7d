"""TrainConfig: every option of `bitnet train`, readable from YAML and overridable by flags.

Each dataclass field is also a CLI flag (`lr` -> `--lr`, `save_every` -> `--save-every`); a flag
given on the command line wins over the YAML file, which wins over the defaults here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _f(default, help: str, default_factory=None):
    if default_factory is not None:
        return field(default_factory=default_factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    # ---- what to train ---------------------------------------------------------------------------
    model: str | None = _f(None, "start from this checkpoint (HF dir / GGUF / zoo name); None = from scratch")
    model_config: dict[str, Any] = _f(
        None,
        "ModelConfig fields for a model trained from scratch (YAML mapping or JSON string), e.g. "
        '{"arch": "bitnet", "hidden_size": 256, "num_hidden_layers": 4, ...}; vocab_size defaults to the data\'s',
        default_factory=dict,
    )
    init_std: float = _f(0.02, "from scratch: std of the normal init of matrices and embeddings")
    quantize: bool = _f(True, "train ternary (QAT); false = plain full-precision training (the baseline)")
    quantize_input: bool = _f(True, "per-token int8 activation fake quantization (W1.58A8)")
    quant_exclude: list[str] = _f(None, "module-name globs kept in full precision", default_factory=list)
    # ---- data ------------------------------------------------------------------------------------
    data: str | None = _f(None, "prepared data directory (`bitnet data prepare`)")
    seq_len: int = _f(256, "tokens per training sequence")
    batch_size: int = _f(32, "sequences per optimizer step, all processes and micro-batches together")
    micro_batch_size: int | None = _f(
        None, "sequences per forward pass per process (default: batch_size / world size; rest is accumulated)"
    )
    # ---- optimization ----------------------------------------------------------------------------
    optimizer: str = _f(
        "adamw", "adamw | adam | lion | sgd (Lion: ~3-10x smaller lr and larger weight_decay than AdamW)"
    )
    lr: float = _f(1.5e-3, "peak learning rate (BitNet b1.58 uses ~6x the usual fp16 rate)")
    min_lr_ratio: float = _f(
        0.0, "final learning rate as a fraction of the peak (cosine / linear / wsd decays)"
    )
    betas: list[float] = _f(None, "Adam / AdamW / Lion betas", default_factory=lambda: [0.9, 0.95])
    eps: float = _f(1e-8, "Adam epsilon")
    momentum: float = _f(0.9, "SGD momentum")
    weight_decay: float = _f(0.1, "weight decay (matrices only; norms, biases and embeddings get none)")
    schedule: str = _f(
        "two_stage",
        "two_stage (BitNet b1.58: lr cut and weight decay 0 at stage2_at) | cosine | linear | constant | "
        "wsd (warm-up, stable, linear decay from stage2_at)",
    )
    warmup_steps: int = _f(100, "linear learning-rate warm-up steps")
    stage2_at: float = _f(0.5, "two_stage / wsd: fraction of max_steps where stage 2 (the decay) starts")
    stage2_lr_ratio: float = _f(
        0.4, "two_stage: stage-2 peak learning rate as a fraction of the stage-1 peak"
    )
    max_steps: int = _f(1000, "optimizer steps")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0 = off)")
    # ---- from full precision ---------------------------------------------------------------------
    quant_warmup_steps: int = _f(0, "gradual quantization: lambda goes 0 -> 1 over this many steps")
    teacher: str | None = _f(
        None, "distillation teacher: a checkpoint path, or 'initial' = the starting full-precision model"
    )
    kd_weight: float = _f(0.0, "weight of the KL(teacher || student) logit loss (CE gets 1 - kd_weight)")
    kd_temperature: float = _f(1.0, "distillation temperature")
    hidden_weight: float = _f(0.0, "weight of the hidden-state MSE to the teacher (every layer output)")
    # ---- run -------------------------------------------------------------------------------------
    out_dir: str = _f("runs/train", "run directory: checkpoints, metrics.jsonl, tensorboard, final model")
    device: str = _f("auto", "auto | cpu | cuda | cuda:N (under torchrun: the local rank's GPU)")
    precision: str = _f("auto", "auto (bf16 autocast on CUDA, fp32 on CPU) | bf16 | fp32")
    distributed: str = _f("auto", "auto (ddp under torchrun) | ddp | fsdp | none")
    seed: int = _f(0, "random seed (model init, data order)")
    deterministic: bool = _f(False, "torch.use_deterministic_algorithms (bitwise reproducible runs)")
    compile: bool = _f(False, "torch.compile the model")
    save_every: int = _f(0, "checkpoint every N steps (0 = only at the end)")
    keep_last: int = _f(3, "checkpoints kept (older ones are deleted)")
    resume: str = _f("auto", "auto (latest checkpoint in out_dir, if any) | never | PATH to a checkpoint")
    eval_every: int = _f(0, "held-out evaluation every N steps (0 = only at the end)")
    eval_tokens: int = _f(65536, "held-out tokens per evaluation")
    early_stopping: int = _f(0, "stop after N evaluations without a held-out loss improvement (0 = off)")
    log_every: int = _f(10, "steps between metric log lines")
    tensorboard: bool = _f(True, "also log to TensorBoard (out_dir/tensorboard) if it is installed")
    progress: bool = _f(True, "progress bar on stderr")
    export: bool = _f(True, "save the final model in the packed inference format to out_dir/final")

    # ---- helpers ---------------------------------------------------------------------------------
    def validate(
        self, model_given: bool = False, data_given: bool = False, teacher_given: bool = False
    ) -> TrainConfig:
        """Check the options; model_given / teacher_given: the caller passes the nn.Module (no model /
        model_config / teacher path needed); data_given: the caller passes its own batches (no data directory)."""
        if self.data is None and not data_given:
            raise ValueError("train config: 'data' (a prepared data directory) is required")
        if not model_given and self.model is None and not self.model_config:
            raise ValueError(
                "train config: give 'model' (start from a checkpoint) or 'model_config' (from scratch)"
            )
        for name in ("seq_len", "batch_size", "max_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"train config: {name!r} must be positive, found {getattr(self, name)}")
        from bitnetlm.train.optim import OPTIMIZERS

        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"train config: optimizer must be one of {', '.join(OPTIMIZERS)}, found {self.optimizer!r}"
            )
        from bitnetlm.train.schedule import SCHEDULES

        if self.schedule not in SCHEDULES:
            raise ValueError(f"train config: schedule must be {'|'.join(SCHEDULES)}, found {self.schedule!r}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"train config: precision must be auto|bf16|fp32, found {self.precision!r}")
        if self.distributed not in ("auto", "ddp", "fsdp", "none"):
            raise ValueError(
                f"train config: distributed must be auto|ddp|fsdp|none, found {self.distributed!r}"
            )
        if not 0 <= self.kd_weight <= 1:
            raise ValueError(f"train config: kd_weight must be in [0, 1], found {self.kd_weight}")
        if (self.kd_weight > 0 or self.hidden_weight > 0) and not (self.teacher or teacher_given):
            raise ValueError("train config: kd_weight/hidden_weight need a 'teacher' (a path or 'initial')")
        if len(self.betas) != 2:
            raise ValueError(f"train config: betas must be two numbers, found {self.betas}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{source}: unknown option(s) {unknown}; known: {sorted(names)}")
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, **overrides) -> TrainConfig:
        from bitnetlm.deps import require

        yaml = require("yaml", "a YAML training config")
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"train config {p} not found")
        d = yaml.safe_load(p.read_text()) or {}
        if not isinstance(d, dict):
            raise ValueError(f"{p}: expected a YAML mapping of options, found {type(d).__name__}")
        d.update(overrides)
        return cls.from_dict(d, str(p))


def _base_type(tp) -> type:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args and typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return _base_type(args[0])
    return typing.get_origin(tp) or tp


def _parse_bool(s: str) -> bool:
    v = s.lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, found {s!r}")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, defaulting to None so that only given flags override the YAML."""
    hints = typing.get_type_hints(TrainConfig)
    short = {"model": ["-m"], "seq_len": ["-c"]}  # llama.cpp-style aliases for the common ones
    for f in dataclasses.fields(TrainConfig):
        flags = [*short.get(f.name, []), "--" + f.name.replace("_", "-")]
        tp = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = f"{f.metadata.get('help', '')} (default: {default})"
        if tp is bool:
            parser.add_argument(*flags, type=_parse_bool, default=None, metavar="BOOL", help=help_text)
        elif tp is list:
            parser.add_argument(*flags, nargs="+", default=None, help=help_text)
        elif tp is dict:
            parser.add_argument(*flags, type=json.loads, default=None, metavar="JSON", help=help_text)
        else:
            parser.add_argument(*flags, type=tp, default=None, help=help_text)


def config_from_args(args: argparse.Namespace, config_path: str | None = None) -> TrainConfig:
    overrides = {}
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        v = getattr(args, f.name, None)
        if v is None:
            continue
        if f.name == "betas":
            v = [float(x) for x in v]
        elif _base_type(hints[f.name]) is list:
            v = list(v)
        overrides[f.name] = v
    if config_path:
        return TrainConfig.from_yaml(config_path, **overrides)
    return TrainConfig(**overrides)
