"""Packed ternary layouts. Every layout the project reads, writes or computes with has a name here.

Canonical in-memory form is an int8 tensor T [out_features, in_features] with values in {-1, 0, 1};
every layout converts to and from it (`pack(t, fmt)` / `unpack(p, fmt, shape)`).
"""

from __future__ import annotations

import enum

import torch


class PackingFormat(str, enum.Enum):
    """Names of the ternary weight layouts. The string value is what we record in files we write."""

    INT8 = "int8"  # unpacked int8 [N, K], values -1/0/1 (reference backend)
    HF_2BIT = "hf-2bit"  # transformers offline layout: uint8 [ceil(N/4), K], four strided row slabs, codes t+1, low bits first
    BASE3 = "base3-5"  # 5 trits per byte (1.6 bits/weight), row-major, for dense distribution files
    GGUF_TQ1_0 = "gguf-tq1_0"  # llama.cpp TQ1_0 blocks of 256 (formats.gguf)
    GGUF_TQ2_0 = "gguf-tq2_0"  # llama.cpp TQ2_0 blocks of 256 (formats.gguf)
    GGUF_I2_S = "gguf-i2_s"  # bitnet.cpp I2_S, x86 128-value blocks, per-tensor scale (formats.gguf)
    CPU_2BIT = "cpu-2bit-v2"  # layout of the C kernels (kernels.cpu), see csrc/
    CPU_BASE3 = "cpu-base3-v1"  # the C kernels' 1.6-bit layout (kernels.cpu), see csrc/bitnet_cpu.h
    TRITON_2BIT = "triton-2bit-v1"  # layout of the Triton kernels (kernels.triton)


def _check_ternary(t: torch.Tensor, where: str) -> None:
    if t.dtype != torch.int8:
        raise TypeError(f"{where}: expected int8 ternary tensor, found {t.dtype}")


def pack_hf(t: torch.Tensor) -> torch.Tensor:
    """Pack int8 ternary T [N, K] into the transformers offline layout, uint8 [ceil(N/4), K].

    packed[r, c] = sum_i (T[i*R + r, c] + 1) << (2*i), R = ceil(N/4); missing rows pad with code 0.
    """
    _check_ternary(t, "pack_hf")
    n = t.shape[0]
    r = (n + 3) // 4
    codes = torch.zeros((4 * r, *t.shape[1:]), dtype=torch.uint8, device=t.device)
    codes[:n] = (t + 1).to(torch.uint8)
    codes = codes.reshape(4, r, *t.shape[1:])  # [4, R, K]: slab i holds rows i*R .. i*R+R-1
    out = codes[0] | (codes[1] << 2) | (codes[2] << 4) | (codes[3] << 6)
    return out


def unpack_hf(packed: torch.Tensor, out_features: int | None = None) -> torch.Tensor:
    """Inverse of `pack_hf`: uint8 [R, K] -> int8 T [out_features or 4R, K]."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_hf: expected uint8 packed weights, found {packed.dtype}")
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(0) >> shifts.view(4, *([1] * packed.dim()))) & 3  # [4, R, K]
    t = codes.reshape(-1, *packed.shape[1:]).to(torch.int8) - 1  # [4R, K]
    n = t.shape[0] if out_features is None else out_features
    if n > t.shape[0]:
        raise ValueError(
            f"unpack_hf: {packed.shape[0]} packed rows hold at most {t.shape[0]} rows, asked for {n}"
        )
    return t[:n].contiguous()


_POW3 = torch.tensor([81, 27, 9, 3, 1], dtype=torch.int32)


def pack_base3(t: torch.Tensor) -> torch.Tensor:
    """5 trits per byte, row-major over the flattened matrix: byte = sum_j (t_j+1) * 3**(4-j). 1.6 bits/weight."""
    _check_ternary(t, "pack_base3")
    flat = t.reshape(-1).to(torch.int32) + 1
    pad = (-flat.numel()) % 5
    if pad:
        flat = torch.cat([flat, torch.ones(pad, dtype=torch.int32, device=flat.device)])
    groups = flat.reshape(-1, 5)  # [n/5, 5]
    return (groups * _POW3.to(flat.device)).sum(dim=1).to(torch.uint8)


def unpack_base3(packed: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of `pack_base3` for a matrix of the given shape."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_base3: expected uint8, found {packed.dtype}")
    n = 1
    for d in shape:
        n *= d
    need = (n + 4) // 5
    if packed.numel() != need:
        raise ValueError(f"unpack_base3: shape {tuple(shape)} needs {need} bytes, found {packed.numel()}")
    v = packed.to(torch.int32).unsqueeze(1)  # [n/5, 1]
    digits = (v // _POW3.to(v.device)) % 3  # [n/5, 5]
    return (digits.reshape(-1)[:n] - 1).to(torch.int8).reshape(shape)


def pack(t: torch.Tensor, fmt: PackingFormat) -> torch.Tensor:
    """Pack canonical int8 ternary T [N, K] into `fmt` (a kernel backend packs its own layouts)."""
    fmt = PackingFormat(fmt)
    if fmt is PackingFormat.INT8:
        _check_ternary(t, "pack")
        return t.contiguous()
    if fmt is PackingFormat.HF_2BIT:
        return pack_hf(t)
    if fmt is PackingFormat.BASE3:
        return pack_base3(t)
    raise ValueError(f"pack: layout {fmt.value!r} belongs to a kernel backend; pack with that backend")


def unpack(p: torch.Tensor, fmt: PackingFormat, shape: tuple[int, int]) -> torch.Tensor:
    """Unpack `p` in layout `fmt` back to canonical int8 ternary T of `shape` [N, K]."""
    fmt = PackingFormat(fmt)
    if fmt is PackingFormat.INT8:
        return p
    if fmt is PackingFormat.HF_2BIT:
        return unpack_hf(p, shape[0])
    if fmt is PackingFormat.BASE3:
        return unpack_base3(p, tuple(shape))
    raise ValueError(f"unpack: layout {fmt.value!r} belongs to a kernel backend; unpack with that backend")
