"""Distillation losses: KL to the teacher's logits (with temperature) and hidden-state MSE."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn


def logits_of(out) -> torch.Tensor:
    """Logits from our CausalLM (a tensor), a transformers ModelOutput (.logits) or a tuple."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    raise TypeError(f"cannot find logits in a model output of type {type(out).__name__}")


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(teacher || student) of the softened distributions, x T^2 (Hinton et al.), mean over tokens."""
    t = temperature
    v = student.shape[-1]
    s_logp = F.log_softmax(student.float().reshape(-1, v) / t, dim=-1)  # [N, V]
    t_logp = F.log_softmax(teacher.float().reshape(-1, v) / t, dim=-1)
    return F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean") * (t * t)


def find_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer block list of our CausalLM (.layers) or a transformers model (.model.layers, .h ...)."""
    for attr in ("layers", "model.layers", "transformer.h", "gpt_neox.layers", "h", "blocks"):
        m = model
        try:
            for part in attr.split("."):
                m = getattr(m, part)
        except AttributeError:
            continue
        if isinstance(m, nn.ModuleList):
            return m
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) and name.split(".")[-1] in ("layers", "h", "blocks"):
            return m
    raise ValueError(f"hidden-state distillation: no block list found in {type(model).__name__}")


@contextlib.contextmanager
def capture_hidden(model: nn.Module):
    """Collects the output hidden state of every block during the forward passes inside the context."""
    store: list[torch.Tensor] = []

    def hook(_mod, _inp, out):
        store.append(out[0] if isinstance(out, (tuple, list)) else out)

    handles = [layer.register_forward_hook(hook) for layer in find_layers(model)]
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


def hidden_loss(student: list[torch.Tensor], teacher: list[torch.Tensor]) -> torch.Tensor:
    """Mean over layers of the MSE between the student's and the teacher's block outputs."""
    if len(student) != len(teacher):
        raise ValueError(
            f"hidden-state distillation: student has {len(student)} blocks, teacher {len(teacher)}"
        )
    losses = []
    for i, (s, t) in enumerate(zip(student, teacher, strict=True)):
        if s.shape != t.shape:
            raise ValueError(
                f"hidden-state distillation: block {i} shapes differ: {tuple(s.shape)} vs {tuple(t.shape)}"
            )
        losses.append(F.mse_loss(s.float(), t.float()))
    return torch.stack(losses).mean()
