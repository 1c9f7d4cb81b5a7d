"""RMSNorm and the gated activation (act(gate) * up) as launches of their own: the bf16 (dense) engine's norms and
MLP middle, and the LM head's input where no quantization launch folds the final norm in (runtime/cuda/engine.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bitnetlm.kernels.triton.common import ACT_CODES, INTERPRET, _activate, _pdl_wait, pdl_kw
from bitnetlm.kernels.triton.plan import DecodePlan


@triton.jit
def _rmsnorm_kernel(
    x_ptr, w_ptr, y_ptr, K, stride_x, stride_y, eps, BK: tl.constexpr, PDL: tl.constexpr = False
):
    m = tl.program_id(0)
    _pdl_wait(PDL)
    offs = tl.arange(0, BK)
    mk = offs < K
    x = tl.load(x_ptr + m * stride_x + offs, mask=mk, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mk, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / K + eps)
    tl.store(y_ptr + m * stride_y + offs, ((x * rstd) * w).to(y_ptr.dtype.element_ty), mask=mk)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, plan: DecodePlan | None = None) -> torch.Tensor:
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    y = torch.empty_like(x2)
    _rmsnorm_kernel[(x2.shape[0],)](
        x2,
        w,
        y,
        k,
        x2.stride(0),
        y.stride(0),
        eps,
        BK=triton.next_power_of_2(k),
        num_warps=1 if INTERPRET else (8 if k > 4096 else 4),
        **pdl_kw(plan),
    )
    return y.reshape(x.shape)


@triton.jit
def _gated_act_kernel(x_ptr, y_ptr, N, stride_x, stride_y, ACT: tl.constexpr, BN: tl.constexpr):
    m = tl.program_id(0)
    offs = tl.program_id(1) * BN + tl.arange(0, BN)
    mk = offs < N
    g = tl.load(x_ptr + m * stride_x + offs, mask=mk, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + m * stride_x + N + offs, mask=mk, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_y + offs, (_activate(g, ACT) * u).to(y_ptr.dtype.element_ty), mask=mk)


def gated_act(x: torch.Tensor, act: str = "relu2") -> torch.Tensor:
    """x [M, 2N] = gate | up -> act(gate) * up [M, N] (the bf16 path's MLP middle)."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    bn = 1024
    _gated_act_kernel[(x2.shape[0], triton.cdiv(n, bn))](
        x2, y, n, x2.stride(0), y.stride(0), ACT=ACT_CODES[act], BN=bn
    )
    return y.reshape(*x.shape[:-1], n)
