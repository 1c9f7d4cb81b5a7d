"""The cpu-2bit-v1 layout (PackingFormat.CPU_2BIT) in torch, the definition the C kernels read.

T int8 [N, K] -> uint8 [N, Kp/4], Kp = K rounded up to 128. Each row is Kp/128 blocks of 32 bytes; in a
block, byte j holds the codes t+1 of elements j, j+32, j+64, j+96 in bits 0-1, 2-3, 4-5, 6-7. Padding
elements hold code 1 (t = 0). One 32-byte load, a shift and a mask give 32 consecutive codes, aligned
with 32 consecutive int8 activations (see csrc/bitnet_cpu.h).
"""

from __future__ import annotations

import torch

BLOCK = 128


def padded_k(k: int) -> int:
    return (k + BLOCK - 1) // BLOCK * BLOCK


def pack_cpu(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.int8 or t.dim() != 2:
        raise TypeError(f"pack_cpu: expected int8 ternary [N, K], found {t.dtype} {tuple(t.shape)}")
    n, k = t.shape
    kp = padded_k(k)
    codes = torch.ones((n, kp), dtype=torch.uint8, device=t.device)
    codes[:, :k] = (t + 1).to(torch.uint8)
    codes = codes.reshape(n, kp // BLOCK, 4, 32)  # [N, blocks, group i, byte j]: element 32*i + j
    out = codes[:, :, 0] | (codes[:, :, 1] << 2) | (codes[:, :, 2] << 4) | (codes[:, :, 3] << 6)
    return out.reshape(n, kp // 4).contiguous()  # [N, Kp/4]


def unpack_cpu(p: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    n, k = shape
    kp = padded_k(k)
    if p.dtype != torch.uint8 or tuple(p.shape) != (n, kp // 4):
        raise ValueError(
            f"unpack_cpu: for T of shape {(n, k)} expected uint8 [{n}, {kp // 4}], found {p.dtype} {tuple(p.shape)}"
        )
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=p.device).view(1, 1, 4, 1)
    codes = (p.reshape(n, kp // BLOCK, 1, 32) >> shifts) & 3  # [N, blocks, 4, 32]
    return (codes.reshape(n, kp).to(torch.int8) - 1)[:, :k].contiguous()
