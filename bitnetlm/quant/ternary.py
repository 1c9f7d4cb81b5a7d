"""The ternary math shared by every implementation (see DESIGN.md, "The math").

weights, per matrix:  s = max(mean|W|, 1e-5),  T = clamp(round(W / s), -1, 1)   (dequantized T * s)
activations, per token (last dim):  a = 127 / max(max|x|, 1e-5),  X = clamp(round(x * a), -128, 127)
y = (X @ T^T) * s / a   -- the integer product is exact, fast paths must match it bit for bit.
"""

from __future__ import annotations

import torch

WEIGHT_EPS = 1e-5
ACT_EPS = 1e-5
QMAX = 127
QMIN = -128


def weight_scale(w: torch.Tensor) -> torch.Tensor:
    """Absmean scale s of one matrix, as a 0-d float32 tensor (clamped so all-zero layers survive)."""
    return w.detach().float().abs().mean().clamp(min=WEIGHT_EPS)


def ternarize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Absmean ternarization: returns (T int8 in {-1,0,1}, s float32 0-d) with W ~= T * s."""
    s = weight_scale(w)
    t = (w.detach().float() / s).round().clamp(-1, 1).to(torch.int8)
    return t, s


def quantize_activations(
    x: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token int8 quantization over the last dim: returns (X int8, a float32 [..., 1]), x ~= X / a.

    amax [..., 1]: the tokens' max |x| when x is a slice of the quantized vector (tensor parallelism), else
    taken from x."""
    xf = x.float()
    if amax is None:
        amax = xf.abs().amax(dim=-1, keepdim=True)
    a = QMAX / amax.float().clamp(min=ACT_EPS)
    q = (xf * a).round().clamp(QMIN, QMAX).to(torch.int8)
    return q, a


def int_matmul(xq: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Exact integer product X @ T^T in int32 (the oracle every kernel is compared with).

    xq: int8 [..., K], t: int8 [N, K] -> int32 [..., N]. Computed in int64 so no overflow is possible.
    """
    if xq.shape[-1] != t.shape[-1]:
        raise ValueError(f"int_matmul: activations have K={xq.shape[-1]} but weights have K={t.shape[-1]}")
    lead = xq.shape[:-1]
    out = xq.reshape(-1, xq.shape[-1]).to(torch.int64) @ t.to(torch.int64).T  # [M, N]
    return out.to(torch.int32).reshape(*lead, t.shape[0])


def int_matmul_f32(xq: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The same exact product through a float32 GEMM.

    Exact because every partial sum is an integer of magnitude <= 127*K < 2**24 for K < 132,000,
    so fp32 accumulation never rounds, whatever the summation order. Returns float32 holding integers.
    """
    if xq.shape[-1] >= 132_000:
        raise ValueError(f"int_matmul_f32 is exact only for K < 132000, got K={xq.shape[-1]}")
    return xq.float() @ t.float().T


def bitlinear_reference(x: torch.Tensor, t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Reference W1.58A8 linear: y = (X @ T^T) * s / a, in float32, cast back to x's dtype."""
    xq, a = quantize_activations(x)
    y = int_matmul_f32(xq, t) * (s.float() / a)
    return y.to(x.dtype)


def fake_quant_weight(w: torch.Tensor) -> torch.Tensor:
    """Dequantized ternary weights T * s, differentiable input not implied (use STE helpers)."""
    s = weight_scale(w)
    return (w / s).round().clamp(-1, 1) * s


def fake_quant_activations(x: torch.Tensor) -> torch.Tensor:
    """Dequantized int8 activations X / a (same dtype as x)."""
    a = QMAX / x.abs().amax(dim=-1, keepdim=True).clamp(min=ACT_EPS)
    return (x * a).round().clamp(QMIN, QMAX) / a


def ste(x: torch.Tensor, q: torch.Tensor, lam: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Straight-through estimator: forward value x + lam*(q - x), gradient of identity."""
    return x + lam * (q - x).detach()
