"""Learning-rate and weight-decay schedules (multipliers for torch.optim.lr_scheduler.LambdaLR).

two_stage is the BitNet b1.58 recipe: linear warm-up to the peak, stage 1 at the (high) peak rate,
then at `stage2_at` of training an abrupt cut to `stage2_lr_ratio` x peak followed by a cosine decay,
and weight decay switched off for stage 2 (`weight_decay_at`).

wsd (warm-up, stable, decay): linear warm-up, the peak until `stage2_at` of training, then a linear decay that
would reach 0 at max_steps, floored at `min_ratio` x peak (the recipe of the smollm2-135m-1.58 conversion).
"""

from __future__ import annotations

import math

import torch

SCHEDULES = ("two_stage", "cosine", "linear", "constant", "wsd")


class LRSchedule:
    """Multiplier of the peak learning rate at an optimizer step (a plain object so LambdaLR can save it)."""

    def __init__(
        self,
        kind: str,
        max_steps: int,
        warmup_steps: int = 0,
        min_ratio: float = 0.0,
        stage2_at: float = 0.5,
        stage2_ratio: float = 0.4,
    ):
        if kind not in SCHEDULES:
            raise ValueError(f"unknown schedule {kind!r}; known: {', '.join(SCHEDULES)}")
        self.kind, self.max_steps, self.warmup_steps = kind, max_steps, warmup_steps
        self.min_ratio, self.stage2_at, self.stage2_ratio = min_ratio, stage2_at, stage2_ratio

    def stage2_start(self) -> int:
        return int(self.stage2_at * self.max_steps)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        if self.kind == "two_stage":
            mid = self.stage2_start()
            if step < mid:
                return 1.0
            frac = (step - mid) / max(self.max_steps - mid, 1)
            lo = self.min_ratio * self.stage2_ratio
            return lo + (self.stage2_ratio - lo) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        if self.kind == "wsd":
            # steps left over the length of the decay phase (float: no rounding of its start)
            left = (self.max_steps - step) / max((1 - self.stage2_at) * self.max_steps, 1e-9)
            return min(1.0, max(self.min_ratio, left))
        frac = min((step - self.warmup_steps) / max(self.max_steps - self.warmup_steps, 1), 1.0)
        if self.kind == "linear":
            return 1.0 - (1.0 - self.min_ratio) * frac
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))

    def weight_decay_on(self, step: int) -> bool:
        """two_stage: weight decay only in stage 1."""
        return self.kind != "two_stage" or step < self.stage2_start()


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms, biases, embeddings (and anything 1-d) get no weight decay."""
    decay, no_decay, seen = [], [], set()
    emb_ids = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 and id(p) not in emb_ids else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "base_weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "base_weight_decay": 0.0})
    return groups


def apply_weight_decay(optimizer: torch.optim.Optimizer, schedule: LRSchedule, step: int) -> None:
    on = schedule.weight_decay_on(step)
    for g in optimizer.param_groups:
        g["weight_decay"] = g.get("base_weight_decay", g["weight_decay"]) if on else 0.0
