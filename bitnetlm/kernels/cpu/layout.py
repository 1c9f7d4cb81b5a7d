"""The cpu-2bit-v2 layout (PackingFormat.CPU_2BIT) in torch, the definition the C kernels read.

T int8 [N, K] -> uint8 [Np, Kp/4], Kp = K rounded up to 128, Np = N rounded up to 4. Each row is Kp/128
blocks of 32 bytes; in a block, byte j holds the codes t+1 of elements j, j+32, j+64, j+96 in bits 0-1, 2-3,
4-5, 6-7. Rows come in groups of 4 whose blocks are interleaved in memory: [Np/4, Kp/128, 4, 32]. Padding
rows and elements hold code 1 (t = 0). One 32-byte load, a shift and a mask give 32 consecutive codes,
aligned with 32 consecutive int8 activations, and the decode kernel's 4 rows are one sequential stream
(see csrc/bitnet_cpu.h). Packed tensors live in huge-page arenas (arena.py).

The cpu-base3-v1 layout (PackingFormat.CPU_BASE3), 1.6 bits a weight: T -> uint8 [Np, Kp3/5], Kp3 = K rounded up
to 320; rows in groups of 4 with interleaved blocks of 64 bytes, [Np/4, Kp3/320, 4, 64]; byte j of a block holds
the codes c_i = t+1 of elements j + 64 i (i = 0..4) as ceil(v * 256 / 243), v = sum_i c_i 3^(4-i), so code i is
((byte * 3^i mod 256) * 3) >> 8 (llama.cpp's TQ1_0 digits, 64 of them aligned with 64 activations).
"""

from __future__ import annotations

import torch

from bitnetlm.kernels.cpu import arena

BLOCK = 128
GROUP = 4
BLOCK3 = 320  # K elements per cpu-base3-v1 block (64 bytes)


def padded_k(k: int) -> int:
    return (k + BLOCK - 1) // BLOCK * BLOCK


def packed_rows(n: int) -> int:
    return (n + GROUP - 1) // GROUP * GROUP


def packed_shape(n: int, k: int) -> tuple[int, int]:
    return packed_rows(n), padded_k(k) // 4


def pack_cpu(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.int8 or t.dim() != 2:
        raise TypeError(f"pack_cpu: expected int8 ternary [N, K], found {t.dtype} {tuple(t.shape)}")
    n, k = t.shape
    np_, kp = packed_rows(n), padded_k(k)
    codes = torch.ones((np_, kp), dtype=torch.uint8, device=t.device)
    codes[:n, :k] = (t + 1).to(torch.uint8)
    # [groups, row in group, blocks, 4 code planes, 32 bytes] -> [groups, blocks, row in group, planes, bytes]
    codes = codes.reshape(np_ // GROUP, GROUP, kp // BLOCK, 4, 32).transpose(1, 2)
    out = codes[:, :, :, 0] | (codes[:, :, :, 1] << 2) | (codes[:, :, :, 2] << 4) | (codes[:, :, :, 3] << 6)
    out = out.reshape(np_, kp // 4)  # [Np, Kp/4] bytes in memory order
    return arena.place(out) if t.device.type == "cpu" else out.contiguous()


def unpack_cpu(p: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    n, k = shape
    np_, kp = packed_rows(n), padded_k(k)
    if p.dtype != torch.uint8 or tuple(p.shape) != (np_, kp // 4):
        raise ValueError(
            f"unpack_cpu: for T of shape {(n, k)} expected uint8 [{np_}, {kp // 4}] (layout cpu-2bit-v2), "
            f"found {p.dtype} {tuple(p.shape)}"
        )
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=p.device).view(1, 1, 1, 4, 1)
    b = p.reshape(np_ // GROUP, kp // BLOCK, GROUP, 1, 32)  # [groups, blocks, row in group, 1, bytes]
    codes = (b >> shifts) & 3  # [groups, blocks, row, plane, bytes]
    codes = codes.transpose(1, 2).reshape(np_, kp)  # [Np, Kp]
    return (codes.to(torch.int8) - 1)[:n, :k].contiguous()


def padded_k3(k: int) -> int:
    return (k + BLOCK3 - 1) // BLOCK3 * BLOCK3


def packed_shape3(n: int, k: int) -> tuple[int, int]:
    return packed_rows(n), padded_k3(k) // 5


_POW3 = (81, 27, 9, 3, 1)


def pack_base3_cpu(t: torch.Tensor) -> torch.Tensor:
    """int8 ternary [N, K] -> cpu-base3-v1 uint8 [Np, Kp3/5] (the layout's definition; the C library's
    bn_repack writes the same bytes from cpu-2bit-v2)."""
    if t.dtype != torch.int8 or t.dim() != 2:
        raise TypeError(f"pack_base3_cpu: expected int8 ternary [N, K], found {t.dtype} {tuple(t.shape)}")
    n, k = t.shape
    np_, kp = packed_rows(n), padded_k3(k)
    codes = torch.ones((np_, kp), dtype=torch.int32, device=t.device)
    codes[:n, :k] = t.to(torch.int32) + 1
    # [groups, row in group, blocks, 5 digits, 64 bytes] -> [groups, blocks, row in group, digits, bytes]
    codes = codes.reshape(np_ // GROUP, GROUP, kp // BLOCK3, 5, 64).transpose(1, 2)
    v = sum(codes[:, :, :, i] * p for i, p in enumerate(_POW3))
    out = ((v * 256 + 242) // 243).to(torch.uint8).reshape(np_, kp // 5)
    return arena.place(out) if t.device.type == "cpu" else out.contiguous()


def unpack_base3_cpu(p: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    n, k = shape
    np_, kp = packed_rows(n), padded_k3(k)
    if p.dtype != torch.uint8 or tuple(p.shape) != (np_, kp // 5):
        raise ValueError(
            f"unpack_base3_cpu: for T of shape {(n, k)} expected uint8 [{np_}, {kp // 5}] (layout cpu-base3-v1), "
            f"found {p.dtype} {tuple(p.shape)}"
        )
    b = p.reshape(np_ // GROUP, kp // BLOCK3, GROUP, 1, 64).to(torch.int32)
    mul = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32, device=p.device).view(1, 1, 1, 5, 1)
    codes = (((b * mul) & 255) * 3) >> 8  # [groups, blocks, row, digit, bytes]
    codes = codes.transpose(1, 2).reshape(np_, kp)
    return (codes.to(torch.int8) - 1)[:n, :k].contiguous()
