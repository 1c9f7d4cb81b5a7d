"""Tensor-level codecs: canonical ternary (int8 T in {-1,0,1}, float scale s, W ~= T*s) <-> GGUF bytes.

TQ1_0 / TQ2_0 (llama.cpp, blocks of 256 values along each row, one fp16 scale per block) and I2_S
(microsoft/BitNet, x86 layout, one float32 scale per tensor). Byte layouts: FORMATS.md. The TQ encoders
are written from T directly (no float round trip) and produce exactly the bytes `gguf.quants` writes for
the float tensor T*s; the tests check that. Everything here is numpy on purpose: GGUF data is numpy
(memory maps), and these functions are also used by the fuzz-tested readers.
"""

from __future__ import annotations

import warnings

import numpy as np

# GGML type ids (gguf.GGMLQuantizationType lacks I2_S: 36 is a removed upstream type reused by bitnet.cpp).
TYPE_F32, TYPE_F16, TYPE_Q8_0, TYPE_BF16, TYPE_TQ1_0, TYPE_TQ2_0, TYPE_I2_S = 0, 1, 8, 30, 34, 35, 36
TERNARY_TYPES = {"tq1_0": TYPE_TQ1_0, "tq2_0": TYPE_TQ2_0, "i2_s": TYPE_I2_S}
TYPE_NAMES = {v: k.upper() for k, v in TERNARY_TYPES.items()}

QK = 256  # TQ block size (values)
TQ2_BYTES = 66  # 64 bytes of 2-bit codes + fp16 scale
TQ1_BYTES = 54  # 48 + 4 bytes of base-3 digits + fp16 scale
I2S_BLOCK = 128  # values per 32-byte I2_S block (x86 layout)
I2S_TAIL = 32  # bytes after the codes; the float32 scale sits at its start

_W5 = np.array([81, 27, 9, 3, 1], dtype=np.uint16)
_W4 = np.array([81, 27, 9, 3], dtype=np.uint16)


class CodecError(ValueError):
    """Bad shapes or bytes for a ternary GGUF codec."""


def _check_ternary(t: np.ndarray, where: str) -> np.ndarray:
    t = np.asarray(t)
    if t.dtype != np.int8:
        raise CodecError(f"{where}: expected int8 ternary values, found {t.dtype}")
    if t.ndim != 2:
        raise CodecError(f"{where}: expected a 2-D matrix [rows, cols], found shape {t.shape}")
    return t


def _fp16_scale(s: float, where: str) -> np.ndarray:
    with np.errstate(over="ignore"):
        s16 = np.asarray(s, dtype=np.float32).astype(np.float16)
    if not np.isfinite(s16) or s16 <= 0:
        raise CodecError(f"{where}: scale {float(s)!r} is not a positive finite fp16 number")
    return s16


def _block_scales(codes: np.ndarray, s: float, where: str) -> np.ndarray:
    """fp16 scale per 256-block as bytes [n_blocks, 2]: s where the block has a nonzero value, else 0.

    That is what gguf.quants / llama.cpp write for T*s: d = max|block| (0 for an all-zero block).
    """
    s16 = _fp16_scale(s, where)
    nonzero = (codes != 1).any(axis=1)
    d = np.where(nonzero, s16, np.float16(0)).astype(np.float16)
    return d.reshape(-1, 1).view(np.uint8)


def _blocks(t: np.ndarray, where: str) -> np.ndarray:
    rows, cols = t.shape
    if cols % QK:
        raise CodecError(f"{where}: row length {cols} is not a multiple of {QK} (required by TQ1_0/TQ2_0)")
    return (t.reshape(-1, QK) + 1).astype(np.uint8)  # [n_blocks, 256] codes t+1


def encode_tq2_0(t: np.ndarray, s: float) -> np.ndarray:
    """TQ2_0 bytes [rows, cols/256*66] of T*s. Byte j of each 128-value half: values j, j+32, j+64, j+96."""
    t = _check_ternary(t, "encode_tq2_0")
    codes = _blocks(t, "encode_tq2_0")
    n = codes.shape[0]
    q = codes.reshape(n, 2, 4, 32)  # [block, half, group, byte]
    qs = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)  # [n, 2, 32]
    out = np.concatenate([qs.reshape(n, 64), _block_scales(codes, s, "encode_tq2_0")], axis=1)
    return out.reshape(t.shape[0], -1)


def encode_tq1_0(t: np.ndarray, s: float) -> np.ndarray:
    """TQ1_0 bytes [rows, cols/256*54] of T*s: five base-3 digits per byte, fixed-point (code*256+242)//243."""
    t = _check_ternary(t, "encode_tq1_0")
    codes = _blocks(t, "encode_tq1_0").astype(np.uint16)
    n = codes.shape[0]
    q0 = (codes[:, :160].reshape(n, 5, 32) * _W5[None, :, None]).sum(axis=1)  # [n, 32]
    q1 = (codes[:, 160:240].reshape(n, 5, 16) * _W5[None, :, None]).sum(axis=1)  # [n, 16]
    qh = (codes[:, 240:].reshape(n, 4, 4) * _W4[None, :, None]).sum(axis=1)  # [n, 4]
    qs = np.concatenate([q0, q1, qh], axis=1)  # [n, 52] base-3 numbers < 243
    qs = ((qs * 256 + 242) // 243).astype(np.uint8)
    out = np.concatenate([qs, _block_scales(codes.astype(np.uint8), s, "encode_tq1_0")], axis=1)
    return out.reshape(t.shape[0], -1)


def _decode_scales(d: np.ndarray, where: str, strict: bool) -> float:
    """One per-tensor scale from the per-block fp16 scales (zero blocks carry no information)."""
    d = d.astype(np.float32)
    if not np.isfinite(d).all():
        raise CodecError(f"{where}: block scales contain inf/nan")
    nz = d[d != 0]
    if nz.size == 0:
        return 1.0
    lo, hi = float(np.abs(nz).min()), float(np.abs(nz).max())
    if hi != lo:
        msg = (
            f"{where}: block scales differ ({lo:.6g} .. {hi:.6g}); a ternary model has one scale per matrix. "
            "Using their mean (lossy)."
        )
        if strict:
            raise CodecError(msg)
        warnings.warn(msg, stacklevel=3)
        return float(np.abs(nz).mean())
    return hi


def _tq_check(data: np.ndarray, shape: tuple[int, int], bpb: int, where: str) -> np.ndarray:
    rows, cols = shape
    if cols % QK:
        raise CodecError(f"{where}: row length {cols} is not a multiple of {QK}")
    need = rows * (cols // QK) * bpb
    data = np.asarray(data).reshape(-1).view(np.uint8)
    if data.size != need:
        raise CodecError(f"{where}: shape {tuple(shape)} needs {need} bytes, found {data.size}")
    return data.reshape(-1, bpb)


def decode_tq2_0(data: np.ndarray, shape: tuple[int, int], strict: bool = False) -> tuple[np.ndarray, float]:
    """TQ2_0 bytes -> (T int8 [rows, cols], scale). Code 3 (unused) decodes to +2 and is rejected."""
    b = _tq_check(data, shape, TQ2_BYTES, "decode_tq2_0")
    n = b.shape[0]
    qs = b[:, :64].reshape(n, 2, 1, 32)
    codes = (qs >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3  # [n, 2, 4, 32]
    if (codes == 3).any():
        raise CodecError("decode_tq2_0: code 3 found; TQ2_0 ternary codes are 0, 1, 2")
    t = codes.reshape(n, QK).astype(np.int8) - 1
    s = _decode_scales(b[:, 64:66].copy().view(np.float16), "decode_tq2_0", strict)
    return t.reshape(shape), s


def decode_tq1_0(data: np.ndarray, shape: tuple[int, int], strict: bool = False) -> tuple[np.ndarray, float]:
    """TQ1_0 bytes -> (T int8 [rows, cols], scale). Digit n of byte q: ((q * 3**n) % 256 * 3) >> 8."""
    b = _tq_check(data, shape, TQ1_BYTES, "decode_tq1_0")
    n = b.shape[0]
    p5 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)

    def digits(q: np.ndarray, k: int) -> np.ndarray:  # q [n, m] -> [n, k, m] (digit index major)
        v = (q[:, None, :] * p5[None, :k, None]).astype(np.uint8)  # wraps mod 256 on purpose
        return (v.astype(np.uint16) * 3) >> 8

    d0 = digits(b[:, :32], 5).reshape(n, 160)
    d1 = digits(b[:, 32:48], 5).reshape(n, 80)
    dh = digits(b[:, 48:52], 4).reshape(n, 16)
    t = np.concatenate([d0, d1, dh], axis=1).astype(np.int8) - 1  # [n, 256]
    if (t > 1).any():
        raise CodecError("decode_tq1_0: digit 3 found; bytes are not valid TQ1_0")
    s = _decode_scales(b[:, 52:54].copy().view(np.float16), "decode_tq1_0", strict)
    return t.reshape(shape), s


def i2s_nbytes(n_values: int) -> int:
    return n_values // 4 + I2S_TAIL


def encode_i2_s(t: np.ndarray, s: float) -> np.ndarray:
    """I2_S bytes (flat uint8, n/4 + 32): 128-value blocks, byte j = c[j]<<6|c[j+32]<<4|c[j+64]<<2|c[j+96]."""
    t = _check_ternary(t, "encode_i2_s")
    if t.size % I2S_BLOCK:
        raise CodecError(f"encode_i2_s: {t.size} values is not a multiple of {I2S_BLOCK}")
    c = (t.reshape(-1, 4, 32) + 1).astype(np.uint8)  # [blocks, group, byte]
    qs = (c[:, 0] << 6) | (c[:, 1] << 4) | (c[:, 2] << 2) | c[:, 3]  # [blocks, 32]
    tail = np.zeros(I2S_TAIL, dtype=np.uint8)
    sc = np.float32(s)
    if not np.isfinite(sc) or sc <= 0:
        raise CodecError(f"encode_i2_s: scale {float(s)!r} is not a positive finite number")
    tail[:4] = np.array([sc], dtype="<f4").view(np.uint8)
    return np.concatenate([qs.reshape(-1), tail])


def decode_i2_s(data: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, float]:
    """I2_S bytes -> (T int8 [rows, cols], float32 scale)."""
    rows, cols = shape
    n = rows * cols
    if n % I2S_BLOCK:
        raise CodecError(f"decode_i2_s: {n} values is not a multiple of {I2S_BLOCK}")
    data = np.asarray(data).reshape(-1).view(np.uint8)
    if data.size < i2s_nbytes(n):
        raise CodecError(f"decode_i2_s: shape {tuple(shape)} needs {i2s_nbytes(n)} bytes, found {data.size}")
    qs = data[: n // 4].reshape(-1, 1, 32)
    codes = (qs >> np.array([6, 4, 2, 0], dtype=np.uint8).reshape(1, 4, 1)) & 3  # [blocks, 4, 32]
    if (codes == 3).any():
        raise CodecError("decode_i2_s: code 3 found; I2_S ternary codes are 0, 1, 2")
    s = float(data[n // 4 : n // 4 + 4].copy().view("<f4")[0])
    if not np.isfinite(s):
        raise CodecError(f"decode_i2_s: tensor scale is {s}")
    return (codes.reshape(rows, cols).astype(np.int8) - 1), s


def encode(t: np.ndarray, s: float, type_id: int) -> np.ndarray:
    """Bytes of ternary matrix T with scale s in GGML type `type_id` (TQ1_0, TQ2_0 or I2_S)."""
    if type_id == TYPE_TQ1_0:
        return encode_tq1_0(t, s)
    if type_id == TYPE_TQ2_0:
        return encode_tq2_0(t, s)
    if type_id == TYPE_I2_S:
        return encode_i2_s(t, s)
    raise CodecError(f"not a ternary GGML type: {type_id}")


def decode(
    data: np.ndarray, shape: tuple[int, int], type_id: int, strict: bool = False
) -> tuple[np.ndarray, float]:
    if type_id == TYPE_TQ1_0:
        return decode_tq1_0(data, shape, strict)
    if type_id == TYPE_TQ2_0:
        return decode_tq2_0(data, shape, strict)
    if type_id == TYPE_I2_S:
        return decode_i2_s(data, shape)
    raise CodecError(f"not a ternary GGML type: {type_id}")


def nbytes(type_id: int, shape: tuple[int, ...]) -> int:
    """Data size in bytes of a ternary tensor of `shape` (numpy order) in `type_id`."""
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if type_id == TYPE_I2_S:
        return i2s_nbytes(n)
    bpb = {TYPE_TQ1_0: TQ1_BYTES, TYPE_TQ2_0: TQ2_BYTES}[type_id]
    return n // QK * bpb


def bits_per_weight(type_id: int, n_values: int) -> float:
    return 8.0 * nbytes(type_id, (n_values,)) / max(n_values, 1)
