"""The optimizers `TrainConfig.optimizer` names: torch's AdamW, Adam and SGD, and Lion (below).

Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2), per parameter with
gradient g and momentum m:

    c = b1 * m + (1 - b1) * g            (interpolate)
    p = p - lr * (sign(c) + wd * p)      (sign update, decoupled weight decay as in AdamW)
    m = b2 * m + (1 - b2) * g            (momentum with the second beta)

Every coordinate moves by exactly lr, so Lion wants a learning rate ~3-10x smaller than AdamW's and a weight
decay that much larger (lr * wd sets the decay's strength). One state tensor per parameter (AdamW keeps two).
"""

from __future__ import annotations

import torch

OPTIMIZERS = ("adamw", "adam", "lion", "sgd")


class Lion(torch.optim.Optimizer):
    def __init__(
        self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0
    ):
        if not lr >= 0:
            raise ValueError(f"Lion: lr must be >= 0, found {lr}")
        if not all(0 <= b < 1 for b in betas) or len(betas) != 2:
            raise ValueError(f"Lion: betas must be two numbers in [0, 1), found {betas}")
        if not weight_decay >= 0:
            raise ValueError(f"Lion: weight_decay must be >= 0, found {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m, g = state["exp_avg"], p.grad
                update = torch.lerp(g, m, b1).sign_()  # b1 * m + (1 - b1) * g
                if wd:
                    p.mul_(1 - lr * wd)
                p.add_(update, alpha=-lr)
                m.lerp_(g, 1 - b2)  # b2 * m + (1 - b2) * g
        return loss


def build_optimizer(name: str, groups: list[dict], lr: float, betas, eps: float, momentum: float):
    """The optimizer `name` (one of OPTIMIZERS) over param_groups `groups` (their own weight_decay each)."""
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps)
    if name == "adam":  # weight decay as an L2 term of the gradient (Adam's own), not decoupled
        return torch.optim.Adam(groups, lr=lr, betas=tuple(betas), eps=eps)
    if name == "lion":
        return Lion(groups, lr=lr, betas=tuple(betas))
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum)
    raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; found {name!r}")
