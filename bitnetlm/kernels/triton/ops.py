"""torch.library custom ops over the Triton launchers, with fake (meta) implementations for torch.compile."""

from __future__ import annotations

import torch

from bitnetlm.kernels.triton import head, launch


@torch.library.custom_op("bitnetlm::ternary_linear", mutates_args=())
def ternary_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    out_features: int,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    gated: bool = False,
    act: str = "relu2",
    eps: float = 1e-5,
) -> torch.Tensor:
    return launch.ternary_linear(x, packed, scale, out_features, norm_weight, residual, gated, act, eps)


@ternary_linear.register_fake
def _(x, packed, scale, out_features, norm_weight=None, residual=None, gated=False, act="relu2", eps=1e-5):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("bitnetlm::w8_linear", mutates_args=())
def w8_linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return head.w8_linear(x, w, s)


@w8_linear.register_fake
def _(x, w, s):
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=torch.float32)
