"""The Triton kernels' packed ternary layout, PackingFormat.TRITON_2BIT ("triton-2bit-v1").

uint8 [N, Kp] with Kp = 4 * ceil(K / 16) bytes per output row (so a row is a whole number of int32 words).
Byte b of row n holds four weights from four K slabs of width Kp, codes t+1, lowest bits first:

    packed[n, b] = sum_i (T[n, i*Kp + b] + 1) << (2*i)        i = 0..3;  k >= K pads with code 1 (t = 0)

Why this shape: one byte (or one int32 word = 4 consecutive bytes) expands with a single shift + mask into
codes for *consecutive* k inside slab i, so the GEMV feeds `dp4a` with whole words and the GEMM feeds
`tl.dot` with a [BN, BKB] int8 tile per slab, with no shuffles. Kernels compute with the unsigned codes
c = t + 1 in {0, 1, 2} and subtract the activation row sum: X @ T^T = X @ C^T - rowsum(X), exact in int32.
"""

from __future__ import annotations

import torch


def packed_row_bytes(k: int) -> int:
    """Kp: bytes per packed row for K input features (a multiple of 4)."""
    return 4 * ((k + 15) // 16)


def pack_triton(t: torch.Tensor) -> torch.Tensor:
    """int8 ternary T [N, K] -> uint8 [N, Kp] in the triton-2bit-v1 layout."""
    if t.dtype != torch.int8 or t.dim() != 2:
        raise TypeError(
            f"pack_triton: expected a 2-d int8 ternary tensor, found {t.dtype} of shape {tuple(t.shape)}"
        )
    n, k = t.shape
    kp = packed_row_bytes(k)
    codes = torch.ones((n, 4 * kp), dtype=torch.uint8, device=t.device)
    codes[:, :k] = (t + 1).to(torch.uint8)
    codes = codes.view(n, 4, kp)  # [N, 4, Kp]: slab i holds k = i*Kp .. i*Kp + Kp - 1
    return (codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6)).contiguous()


def unpack_triton(p: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Inverse of `pack_triton`: uint8 [N, Kp] -> int8 T of `shape` [N, K]."""
    n, k = shape
    kp = packed_row_bytes(k)
    if p.dtype != torch.uint8 or tuple(p.shape) != (n, kp):
        raise ValueError(
            f"unpack_triton: for shape {(n, k)} expected uint8 [{n}, {kp}], found {p.dtype} {tuple(p.shape)}"
        )
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=p.device)
    codes = (p[:, None, :] >> shifts[None, :, None]) & 3  # [N, 4, Kp]
    return (codes.reshape(n, 4 * kp)[:, :k].to(torch.int8) - 1).contiguous()


def repack_hf(p: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The transformers offline 2-bit layout (`quant.packing.pack_hf`, uint8 [ceil(N/4), K]) straight to
    triton-2bit-v1: equal to `pack_triton(unpack_hf(p, N))`, in a few wide ops on the codes (no int8 T)."""
    n, k = shape
    r, kp = (n + 3) // 4, packed_row_bytes(k)
    if p.dtype != torch.uint8 or tuple(p.shape) != (r, k):
        raise ValueError(
            f"repack_hf: for shape {(n, k)} expected uint8 [{r}, {k}], found {p.dtype} {tuple(p.shape)}"
        )
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=p.device)
    codes = ((p[None] >> shifts[:, None, None]) & 3).view(4 * r, k)[:n]  # [N, K]: t + 1 of row i*R + r
    if k != 4 * kp:  # pad K with code 1 (t = 0)
        codes = torch.nn.functional.pad(codes, (0, 4 * kp - k), value=1)
    return (codes.view(n, 4, kp) << shifts[None, :, None]).sum(dim=1, dtype=torch.uint8)
