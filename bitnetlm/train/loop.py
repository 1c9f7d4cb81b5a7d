"""The training loop: QAT from scratch or from a full-precision model, distillation, checkpoint/resume.

    from bitnetlm.train import TrainConfig, train
    summary = train(TrainConfig(data="data/austen", model_config={...}, max_steps=1000, out_dir="runs/x"))

`train` also takes ready nn.Modules (`model=`, `teacher=`): any causal LM whose forward maps input_ids
[B, T] to logits (our CausalLM, a transformers model, your own). PyTorch optimizers and LambdaLR
schedules only; bf16 autocast on CUDA; gradient accumulation and clipping; exact resume.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bitnetlm.train import checkpoint as ckpt
from bitnetlm.train import distributed as D
from bitnetlm.train.config import TrainConfig
from bitnetlm.train.data import PackedBatches, TokenShards, eval_batches
from bitnetlm.train.distill import capture_hidden, find_layers, hidden_loss, kd_loss, logits_of
from bitnetlm.train.optim import build_optimizer
from bitnetlm.train.qat import QuantizeConfig, bitlinears, quant_lambda_at, quantize_, set_quant_lambda
from bitnetlm.train.schedule import LRSchedule, apply_weight_decay, param_groups


class _Metrics:
    """metrics.jsonl (+ TensorBoard) on the main process only."""

    def __init__(self, out: Path, enabled: bool, tensorboard: bool, resume_step: int | None):
        self.enabled = enabled
        self.path = out / "metrics.jsonl"
        self.tb = None
        if not enabled:
            return
        out.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.is_file():
            # drop rows logged after the checkpoint we resume from: they will be logged again
            keep = [
                ln
                for ln in self.path.read_text().splitlines()
                if ln and json.loads(ln).get("step", 0) <= resume_step
            ]
            self.path.write_text("".join(ln + "\n" for ln in keep))
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out / "tensorboard"))
            except ImportError:  # tensorboard not installed: JSONL only
                self.tb = None

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, row["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _build_model(cfg: TrainConfig, vocab_size: int) -> nn.Module:
    from bitnetlm.models import ModelConfig, build_model

    if cfg.model:
        from bitnetlm.loading import load_model

        # "train" mode: ternary checkpoints come back as latent BitLinears, full-precision ones as nn.Linear
        return load_model(cfg.model, mode="train", dtype=torch.float32)
    mc = dict(cfg.model_config)
    mc.setdefault("vocab_size", vocab_size)
    mc.setdefault("bos_token_id", None)
    mc.setdefault("eos_token_id", None)
    mc.setdefault("quant", "ternary" if cfg.quantize else "none")
    model = build_model(ModelConfig(**mc), mode="train" if mc["quant"] == "ternary" else "fp")
    init_weights(model, float(cfg.init_std))
    return model


@torch.no_grad()
def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """LLaMA-style init for a model trained from scratch: N(0, std) matrices and embeddings, unit norms.

    (nn.Embedding's default N(0, 1) makes the tied LM head's first logits huge: loss ~50 at step 0.)
    """
    for name, p in model.named_parameters():
        if p.ndim >= 2:
            nn.init.normal_(p, 0.0, std)
        elif name.endswith("bias"):
            nn.init.zeros_(p)


def _load_teacher(cfg: TrainConfig, initial: nn.Module) -> nn.Module | None:
    if not cfg.teacher:
        return None
    if cfg.teacher == "initial":
        teacher = copy.deepcopy(initial)
    else:
        from bitnetlm.loading import load_model

        teacher = load_model(cfg.teacher, mode="train", dtype=torch.float32)
    teacher.eval().requires_grad_(False)
    return teacher


def _forward(model: nn.Module, x: torch.Tensor, want_hidden: bool):
    if want_hidden:
        with capture_hidden(D.unwrap(model)) as hs:
            out = logits_of(model(x))
        return out, list(hs)
    return logits_of(model(x)), None


def _open_data(cfg: TrainConfig) -> tuple[TokenShards, TokenShards | None]:
    """The prepared data's train split and its val split (None when missing or not longer than seq_len)."""
    train_data = TokenShards(cfg.data, "train")
    try:
        val_data = TokenShards(cfg.data, "val")
        if val_data.num_tokens <= cfg.seq_len:
            val_data = None
    except ValueError:
        val_data = None
    return train_data, val_data


def _batch_source(cfg: TrainConfig, info, train_data, batches):
    """This rank's batch source: the caller's factory's, else packed sequences of the prepared data."""
    if batches is not None:
        return batches(info.rank, info.world_size)
    return PackedBatches(
        train_data,
        cfg.seq_len,
        cfg.batch_size,
        cfg.micro_batch_size,
        info.rank,
        info.world_size,
        cfg.seed,
    )


def _prepare_student(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """The model to train, in training mode: ternary QAT layers (unless it has some already), whose
    activation quantization follows the config."""
    if cfg.quantize and not bitlinears(model):
        quantize_(model, QuantizeConfig(exclude=list(cfg.quant_exclude), quantize_input=cfg.quantize_input))
    for m in bitlinears(model):
        m.quantize_input = cfg.quantize_input
    model.train()
    return model


def _lr_schedule(cfg: TrainConfig) -> LRSchedule:
    """The learning-rate multiplier by step (also the weight decay's, in two-stage schedules)."""
    return LRSchedule(
        cfg.schedule,
        cfg.max_steps,
        cfg.warmup_steps,
        cfg.min_lr_ratio,
        cfg.stage2_at,
        cfg.stage2_lr_ratio,
    )


def _wrap(model: nn.Module, info, compile_: bool) -> nn.Module:
    """The model as the step runs it: DDP, FSDP2 (each block of its block list sharded, then the root) or
    itself; torch.compile'd on request."""
    blocks = None
    with contextlib.suppress(ValueError):
        blocks = find_layers(model)
    wrapped = D.wrap(model, info, blocks)
    if compile_:
        wrapped = torch.compile(wrapped)
    return wrapped


def _autocast(precision: str, dev: torch.device):
    """A factory of the forward's autocast context: bf16 when asked, or by default on CUDA; else none."""
    use_bf16 = precision == "bf16" or (precision == "auto" and dev.type == "cuda")
    return (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext


class Trainer:
    """One training run. `batches`: None (the config's prepared `data`), or a function (rank, world_size) -> a
    batch source of this rank: `next_step()` (the step's micro-batches, (input_ids, labels) pairs),
    `state_dict()` (JSON-serializable: checkpoints hold it) and `load_state_dict(state)` (exact resume)."""

    def __init__(
        self,
        config: TrainConfig,
        model: nn.Module | None = None,
        teacher: nn.Module | None = None,
        batches=None,
    ):
        self.cfg = cfg = config.validate(
            model_given=model is not None, data_given=batches is not None, teacher_given=teacher is not None
        )
        self.info = D.setup(cfg.device, cfg.distributed)
        self.out = Path(cfg.out_dir)
        self.ckpt_root = self.out / "checkpoints"
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        torch.manual_seed(cfg.seed)  # same initial weights on every rank
        self.train_data, self.val_data = _open_data(cfg) if cfg.data is not None else (None, None)
        self.batches = _batch_source(cfg, self.info, self.train_data, batches)
        # ---- model (+ teacher) -----------------------------------------------------------------
        vocab = self.train_data.vocab_size if self.train_data is not None else None
        model = model if model is not None else _build_model(cfg, vocab)
        self.teacher = teacher if teacher is not None else _load_teacher(cfg, model)
        self.model = _prepare_student(model, cfg).to(self.info.device)
        if self.teacher is not None:
            self.teacher.to(self.info.device)
        self.schedule = _lr_schedule(cfg)
        self.want_hidden = cfg.hidden_weight > 0 and self.teacher is not None
        # ---- wrap, optimizer, scheduler ------------------------------------------------------
        # resume: the model weights go into the plain module before DDP/FSDP wrapping (FSDP2 then shards
        # exactly those tensors); the optimizer state is loaded after the optimizer exists
        self._resume = self._find_resume()
        if self._resume is not None:
            self.model.load_state_dict(self._resume[0], strict=True)
        self.wrapped = _wrap(self.model, self.info, cfg.compile)
        groups = param_groups(self.model, cfg.weight_decay)
        self.opt = build_optimizer(cfg.optimizer, groups, cfg.lr, cfg.betas, cfg.eps, cfg.momentum)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self.schedule)
        self.step = 0
        self.tokens_seen = 0
        self.best_val = math.inf
        self.bad_evals = 0
        self.last_val = None
        self.resumed_from = None
        self.autocast = _autocast(cfg.precision, self.info.device)
        resumed = self._maybe_resume()
        self.metrics = _Metrics(self.out, self.info.is_main, cfg.tensorboard, self.step if resumed else None)
        if self.info.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))

    # ---- checkpoints ---------------------------------------------------------------------------
    def _find_resume(self):
        """(model state, optimizer/scheduler state, trainer state, path) of the checkpoint to resume, or None."""
        cfg = self.cfg
        if cfg.resume == "never":
            return None
        if self.info.is_main:
            ckpt.clean_stale(self.ckpt_root)
            if cfg.resume == "auto":
                # damaged newer checkpoints are moved aside here, so the other ranks' latest is this one too
                ckpt.select_resume(self.ckpt_root)
        D.barrier(self.info)
        if cfg.resume != "auto":
            path = Path(cfg.resume)
            return (*ckpt.load_checkpoint(path), path)
        path = ckpt.latest_checkpoint(self.ckpt_root)
        if path is None:
            return None
        return (*ckpt.load_checkpoint(path, verify=False), path)

    def _maybe_resume(self) -> bool:
        if self._resume is None:
            return False
        cfg = self.cfg
        _, optim, state, path = self._resume
        self._resume = None  # free the host copy of the weights
        D.load_optimizer_state(self.wrapped, self.opt, optim["optimizer"], self.info)
        self.batches.load_state_dict(state["data"])
        self.step = int(state["step"])
        # The schedule is a pure function of the step: rebuild it from *this* run's options rather than
        # LambdaLR.load_state_dict, which would also restore the old run's max_steps / lr (a resumed run
        # may extend training). Same step -> same learning rate, so an unchanged run resumes exactly.
        for g in self.opt.param_groups:
            g["initial_lr"] = cfg.lr
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self.schedule, last_epoch=self.step - 1)
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.best_val = float(state.get("best_val", math.inf))
        self.bad_evals = int(state.get("bad_evals", 0))
        self.resumed_from = self.step
        if self.info.is_main:
            print(f"resumed from {path} (step {self.step})", file=sys.stderr, flush=True)
        return True

    def save(self) -> Path | None:
        model_sd, optim_sd = D.full_state_dicts(self.wrapped, self.opt, self.info)
        path = None
        if self.info.is_main:
            state = {
                "data": self.batches.state_dict(),
                "tokens_seen": self.tokens_seen,
                "best_val": self.best_val if math.isfinite(self.best_val) else None,
                "bad_evals": self.bad_evals,
                "config": self.cfg.to_dict(),
            }
            if state["best_val"] is None:
                state.pop("best_val")
            path = ckpt.save_checkpoint(
                self.ckpt_root,
                self.step,
                model_sd,
                {"optimizer": optim_sd, "scheduler": self.sched.state_dict()},
                state,
                keep_last=self.cfg.keep_last,
            )
        D.barrier(self.info)
        return path

    # ---- one step ------------------------------------------------------------------------------
    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
        cfg = self.cfg
        with self.autocast():
            logits, hs = _forward(self.wrapped, x, self.want_hidden)
            ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            parts = {"ce": ce.detach()}
            loss = ce
            if self.teacher is not None and (cfg.kd_weight > 0 or self.want_hidden):
                with torch.no_grad():
                    t_logits, t_hs = _forward(self.teacher, x, self.want_hidden)
                if cfg.kd_weight > 0:
                    kd = kd_loss(logits, t_logits, cfg.kd_temperature)
                    loss = (1 - cfg.kd_weight) * ce + cfg.kd_weight * kd
                    parts["kd"] = kd.detach()
                if self.want_hidden:
                    hl = hidden_loss(hs, t_hs)
                    loss = loss + cfg.hidden_weight * hl
                    parts["hidden"] = hl.detach()
        return loss, parts

    def train_step(self) -> dict:
        cfg = self.cfg
        lam = quant_lambda_at(self.step, cfg.quant_warmup_steps)
        set_quant_lambda(self.model, lam)
        apply_weight_decay(self.opt, self.schedule, self.step)
        micro = self.batches.next_step()
        sums: dict[str, torch.Tensor] = {}
        for i, (x, y) in enumerate(micro):
            x, y = x.to(self.info.device, non_blocking=True), y.to(self.info.device, non_blocking=True)
            last = i == len(micro) - 1
            # gradient accumulation: communicate gradients only on the last micro-batch of the step
            ctx = self.wrapped.no_sync() if self.info.mode == "ddp" and not last else contextlib.nullcontext()
            if self.info.mode == "fsdp" and len(micro) > 1:
                self.wrapped.set_requires_gradient_sync(last)
            with ctx:
                loss, parts = self._loss(x, y)
                (loss / len(micro)).backward()
            parts["loss"] = loss.detach()
            for k, v in parts.items():
                sums[k] = sums.get(k, 0) + v.float() / len(micro)
        gnorm = None
        if cfg.grad_clip > 0:
            gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += cfg.batch_size * cfg.seq_len
        keys = sorted(sums)
        vals = D.all_reduce_mean(torch.stack([sums[k] for k in keys]), self.info).tolist()
        row = {"step": self.step, **dict(zip(keys, vals, strict=True)), "lr": lr, "quant_lambda": lam}
        if gnorm is not None:
            row["grad_norm"] = float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm)
        return row

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean held-out cross-entropy (nats/token) over eval_tokens of the val split."""
        if self.val_data is None:
            return None
        was = self.wrapped.training
        self.wrapped.eval()
        # the held-out loss is that of the ternary model we would export, also during the quant warm-up
        set_quant_lambda(self.model, 1.0)
        bs = self.cfg.micro_batch_size or max(1, self.cfg.batch_size // self.info.world_size)
        fwd = self.wrapped if self.info.mode == "fsdp" else D.unwrap(self.wrapped)
        tot = torch.zeros(2, dtype=torch.float64, device=self.info.device)
        for i, (x, y) in enumerate(eval_batches(self.val_data, self.cfg.seq_len, bs, self.cfg.eval_tokens)):
            if self.info.mode != "fsdp" and i % self.info.world_size != self.info.rank:
                continue  # DDP / single: shard the batches; FSDP: every rank must run every forward
            x, y = x.to(self.info.device), y.to(self.info.device)
            with self.autocast():
                logits = logits_of(fwd(x))
            ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
            tot += torch.stack([ce.double(), torch.tensor(y.numel(), dtype=torch.float64, device=ce.device)])
        if self.info.mode != "fsdp":
            tot = D.all_reduce_sum(tot, self.info)
        self.wrapped.train(was)
        return float(tot[0] / tot[1]) if tot[1] > 0 else None

    # ---- the loop ------------------------------------------------------------------------------
    def fit(self) -> dict:
        from bitnetlm import progress

        cfg = self.cfg
        show = cfg.progress and self.info.is_main
        bar = progress.bar(total=cfg.max_steps, initial=self.step, desc="train", unit="step", show=show)
        stopped_early = False
        t0, tok0 = time.perf_counter(), self.tokens_seen
        last = {}
        while self.step < cfg.max_steps:
            row = self.train_step()
            now = time.perf_counter()
            row["tokens"] = self.tokens_seen
            row["tokens_per_s"] = (self.tokens_seen - tok0) / max(now - t0, 1e-9)
            last = row
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", refresh=False)
            if not math.isfinite(row["loss"]):
                raise FloatingPointError(f"training loss is {row['loss']} at step {self.step}; lower lr?")
            if cfg.log_every and (self.step % cfg.log_every == 0 or self.step == cfg.max_steps):
                self.metrics.log(row)
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.max_steps:
                if self._eval_and_check():
                    stopped_early = True
            if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.max_steps:
                self.save()
            if stopped_early:
                break
        bar.close()
        val = self.evaluate()
        if val is not None:
            self.last_val = val
            self.metrics.log({"step": self.step, "val_loss": val, "val_ppl": math.exp(min(val, 50))})
        final_ckpt = self.save()
        export_dir = self.export() if cfg.export else None
        self.metrics.close()
        return {
            "step": self.step,
            "loss": last.get("loss"),
            "val_loss": val,
            "stopped_early": stopped_early,
            "checkpoint": str(final_ckpt) if final_ckpt else None,
            "export": str(export_dir) if export_dir else None,
            "tokens": self.tokens_seen,
            "resumed_from": self.resumed_from,
        }

    def _eval_and_check(self) -> bool:
        val = self.evaluate()
        if val is None:
            return False
        self.last_val = val
        self.metrics.log({"step": self.step, "val_loss": val, "val_ppl": math.exp(min(val, 50))})
        if val < self.best_val - 1e-6:
            self.best_val, self.bad_evals = val, 0
        else:
            self.bad_evals += 1
        return bool(self.cfg.early_stopping and self.bad_evals >= self.cfg.early_stopping)

    def export(self) -> Path | None:
        """The final model in the packed inference format (OUT/final), loadable with bitnetlm.load."""
        from bitnetlm.models.transformer import CausalLM
        from bitnetlm.train.export import export_model

        if not self.info.is_main and self.info.mode != "fsdp":
            return None
        model_sd, _ = D.full_state_dicts(self.wrapped, self.opt, self.info)
        if not self.info.is_main or not isinstance(self.model, CausalLM):
            return None
        tok = Path(self.cfg.data) if self.cfg.data else None
        return export_model(self.model, self.out / "final", model_sd, tokenizer_dir=tok)


def train(
    config: TrainConfig, model: nn.Module | None = None, teacher: nn.Module | None = None, batches=None
) -> dict:
    """Run (or resume) a training run; returns a summary dict (final step, losses, paths). `batches`: see
    `Trainer` (None: the config's prepared data)."""
    trainer = Trainer(config, model=model, teacher=teacher, batches=batches)
    try:
        summary = trainer.fit()
        # every rank waits for the others (rank 0's export) before the group is torn down: a gloo rank that
        # destroyed its group while its peer was still busy aborted now and then ("terminate called ...")
        D.barrier(trainer.info)
        return summary
    finally:
        if os.environ.get("WORLD_SIZE", "1") != "1" or trainer.info.mode == "fsdp":
            D.teardown()
