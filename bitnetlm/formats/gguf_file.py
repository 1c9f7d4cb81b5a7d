"""The GGUF container: a bounds-checked, memory-mapped reader and a writer on top of `gguf.GGUFWriter`.

Why our own reader: `gguf.GGUFReader` cannot open files holding I2_S (type 36, unknown to its enum) and
trusts every count and offset in the file. This one checks each field against the file size before it
allocates or slices anything, so truncated or hostile files fail with a `GGUFError` naming the field,
never with a crash or a huge allocation. Tensor data stays in the memory map (zero-copy views).

Layout (little-endian, GGUF v2/v3): magic "GGUF", u32 version, u64 n_tensors, u64 n_kv, then n_kv
(key string, u32 value type, value), then n_tensors (name, u32 n_dims, u64 dims[n_dims] (ggml order,
fastest first), u32 type, u64 offset), padding to `general.alignment` (default 32), tensor data.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bitnetlm.formats import atomic
from bitnetlm.formats import gguf_codecs as codecs

MAGIC = b"GGUF"
MAX_DIMS = 4
MAX_ELEMENTS = 1 << 40  # no real tensor comes near this; larger dims are treated as corrupt
MAX_ARRAY_DEPTH = 4

# value types
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALAR = {
    UINT8: ("<B", 1),
    INT8: ("<b", 1),
    UINT16: ("<H", 2),
    INT16: ("<h", 2),
    UINT32: ("<I", 4),
    INT32: ("<i", 4),
    FLOAT32: ("<f", 4),
    BOOL: ("<?", 1),
    UINT64: ("<Q", 8),
    INT64: ("<q", 8),
    FLOAT64: ("<d", 8),
}
_NP = {
    UINT8: "<u1",
    INT8: "<i1",
    UINT16: "<u2",
    INT16: "<i2",
    UINT32: "<u4",
    INT32: "<i4",
    FLOAT32: "<f4",
    BOOL: "?",
    UINT64: "<u8",
    INT64: "<i8",
    FLOAT64: "<f8",
}


def _type_sizes() -> dict[int, tuple[int, int]]:
    """GGML type id -> (block size in values, bytes per block), from the gguf package plus I2_S."""
    from gguf.constants import GGML_QUANT_SIZES

    sizes = {int(k): (int(v[0]), int(v[1])) for k, v in GGML_QUANT_SIZES.items()}
    sizes[codecs.TYPE_I2_S] = (4, 1)  # 2 bits per value; the 32-byte scale tail is added in tensor_nbytes
    return sizes


TYPE_SIZES = _type_sizes()


def type_name(type_id: int) -> str:
    if type_id == codecs.TYPE_I2_S:
        return "I2_S"
    try:
        from gguf.constants import GGMLQuantizationType

        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type{type_id}"


def tensor_nbytes(type_id: int, shape: tuple[int, ...]) -> int:
    """Data size of a tensor with numpy-order `shape`; raises GGUFError for unknown types or bad rows."""
    if type_id not in TYPE_SIZES:
        raise GGUFError(f"unknown GGML tensor type id {type_id}")
    blk, size = TYPE_SIZES[type_id]
    n = 1
    for d in shape:
        n *= d
    if type_id == codecs.TYPE_I2_S:
        return codecs.i2s_nbytes(n)
    row = shape[-1] if shape else 1
    if row % blk:
        raise GGUFError(f"row length {row} is not a multiple of the {type_name(type_id)} block size {blk}")
    return n // blk * size


class GGUFError(ValueError):
    """A GGUF file that is malformed, truncated or unsupported."""


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (slowest first): GGUF dims reversed
    type_id: int
    offset: int  # absolute file offset of the data
    nbytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.type_id)

    @property
    def n_values(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


@dataclass
class GGUFFile:
    """An opened GGUF file: metadata (key -> value), value types, tensor table, and the memory map."""

    path: Path
    version: int
    metadata: dict[str, Any]
    value_types: dict[str, tuple[int, int | None]]  # key -> (type, array element type)
    tensors: dict[str, TensorInfo]
    alignment: int
    data_offset: int
    _mm: np.memmap | None = field(default=None, repr=False)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view into the memory map (no copy)."""
        ti = self._info(name)
        return self._mm[ti.offset : ti.offset + ti.nbytes]

    def _info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        return self.tensors[name]

    def array(self, name: str) -> np.ndarray:
        """A float tensor as numpy: F32/F16/BF16 as views or float32; other GGML types dequantized to float32."""
        ti = self._info(name)
        raw = self.raw(name)
        if ti.type_id == codecs.TYPE_F32:
            return raw.view("<f4").reshape(ti.shape)
        if ti.type_id == codecs.TYPE_F16:
            return raw.view("<f2").reshape(ti.shape)
        if ti.type_id == codecs.TYPE_BF16:
            u = raw.view("<u2").astype(np.uint32) << 16
            return u.view(np.float32).reshape(ti.shape)
        if ti.type_id in codecs.TYPE_NAMES:
            t, s = self.ternary(name)
            return t.astype(np.float32) * np.float32(s)
        from gguf import quants
        from gguf.constants import GGMLQuantizationType

        try:
            qt = GGMLQuantizationType(ti.type_id)
            blk, size = TYPE_SIZES[ti.type_id]
            return quants.dequantize(raw.reshape(*ti.shape[:-1], ti.shape[-1] // blk * size), qt)
        except (NotImplementedError, ValueError) as e:
            raise GGUFError(
                f"{self.path}: tensor {name!r}: cannot dequantize type {ti.type_name}: {e}"
            ) from e

    def ternary(self, name: str, strict: bool = False) -> tuple[np.ndarray, float]:
        """(T int8 [rows, cols], scale) of a TQ1_0 / TQ2_0 / I2_S matrix."""
        ti = self._info(name)
        if ti.type_id not in codecs.TYPE_NAMES:
            raise GGUFError(f"{self.path}: tensor {name!r} is {ti.type_name}, not a ternary type")
        if len(ti.shape) != 2:
            raise GGUFError(f"{self.path}: ternary tensor {name!r} must be 2-D, found shape {ti.shape}")
        try:
            return codecs.decode(self.raw(name), ti.shape, ti.type_id, strict=strict)
        except codecs.CodecError as e:
            raise GGUFError(f"{self.path}: tensor {name!r}: {e}") from e

    def close(self) -> None:
        self._mm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def decode_utf8_lossy(raw: bytes) -> str:
    """Text of bytes that are not valid UTF-8, as llama.cpp reads them (unicode_cpts_from_utf8): a byte that does
    not start a complete sequence becomes U+FFFD and decoding resumes at the next byte. Code points Python cannot
    hold in a str (surrogates, beyond U+10FFFF) become U+FFFD too, so no lone surrogate reaches tokenizers or print.
    """
    out, i, n = [], 0, len(raw)
    while i < n:
        b = raw[i]
        size = 1 if b < 0x80 else 2 if b >> 5 == 6 else 3 if b >> 4 == 14 else 4 if b >> 3 == 30 else 0
        if size and i + size <= n and all(raw[j] >> 6 == 2 for j in range(i + 1, i + size)):
            cpt = b & (0x7F, 0x1F, 0x0F, 0x07)[size - 1]
            for j in range(i + 1, i + size):
                cpt = cpt << 6 | raw[j] & 0x3F
            out.append("\ufffd" if 0xD800 <= cpt <= 0xDFFF or cpt > 0x10FFFF else chr(cpt))
            i += size
        else:
            out.append("\ufffd")
            i += 1
    return "".join(out)


class _Cursor:
    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(
                f"{self.path}: truncated or corrupt: {what} needs {n} bytes at offset {self.pos}, "
                f"file has {len(self.buf)} bytes"
            )

    def scalar(self, vtype: int, what: str):
        fmt, n = _SCALAR[vtype]
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.scalar(UINT64, f"length of {what}")
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return decode_utf8_lossy(raw)

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALAR:
            return self.scalar(vtype, what), None
        if vtype == STRING:
            return self.string(what), None
        if vtype != ARRAY:
            raise GGUFError(f"{self.path}: {what}: unknown value type {vtype}")
        if depth >= MAX_ARRAY_DEPTH:
            raise GGUFError(f"{self.path}: {what}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
        etype = self.scalar(UINT32, f"element type of {what}")
        count = self.scalar(UINT64, f"element count of {what}")
        # Bound the count by the bytes left before allocating anything (strings take >= 8 bytes each).
        min_size = _SCALAR[etype][1] if etype in _SCALAR else 8 if etype in (STRING, ARRAY) else None
        if min_size is None:
            raise GGUFError(f"{self.path}: {what}: unknown array element type {etype}")
        self.need(count * min_size, f"{what} ({count} elements)")
        if etype in _SCALAR:
            arr = np.frombuffer(self.buf, dtype=_NP[etype], count=count, offset=self.pos)
            self.pos += count * min_size
            return arr.tolist(), etype
        return [self.value(etype, f"{what}[{i}]", depth + 1)[0] for i in range(count)], etype


def _read_header(cur: _Cursor, mm: np.memmap, path: Path) -> tuple[int, int, int]:
    """The magic and version checked; (version, tensor count, metadata count)."""
    magic = bytes(mm[:4])
    if magic != MAGIC:
        raise GGUFError(f"{path}: wrong magic {magic!r}, expected {MAGIC!r} (not a GGUF file)")
    cur.pos = 4
    version = cur.scalar(UINT32, "version")
    if version not in (2, 3):
        if version & 0xFFFF == 0 and (version >> 16) in (2, 3) or version in (0x02000000, 0x03000000):
            raise GGUFError(f"{path}: big-endian GGUF is not supported")
        raise GGUFError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors = cur.scalar(UINT64, "tensor count")
    n_kv = cur.scalar(UINT64, "metadata count")
    # each kv takes >= 12 bytes (8 key length + 4 type), each tensor info >= 24 bytes
    cur.need(n_kv * 12 + n_tensors * 24, f"{n_kv} metadata entries and {n_tensors} tensor infos")
    return version, n_tensors, n_kv


def _read_metadata(cur: _Cursor, n_kv: int) -> tuple[dict[str, Any], dict[str, tuple[int, int | None]]]:
    """The n_kv metadata entries: (values, (value type, array element type) of each key)."""
    metadata: dict[str, Any] = {}
    vtypes: dict[str, tuple[int, int | None]] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        vtype = cur.scalar(UINT32, f"type of metadata {key!r}")
        val, etype = cur.value(vtype, f"metadata {key!r}")
        metadata[key] = val
        vtypes[key] = (vtype, etype)
    return metadata, vtypes


def _checked_alignment(metadata: dict[str, Any], path: Path) -> int:
    """general.alignment (default 32), checked to be a power of two of at most 1 MiB."""
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1) or alignment > 1 << 20:
        raise GGUFError(f"{path}: general.alignment must be a power of two, found {alignment!r}")
    return alignment


def _read_tensor_info(cur: _Cursor, i: int, path: Path) -> tuple[str, tuple[int, ...], int, int, int]:
    """Tensor #i's table entry, checked: (name, shape, type id, data offset, bytes)."""
    name = cur.string(f"name of tensor #{i}")
    nd = cur.scalar(UINT32, f"n_dims of tensor {name!r}")
    if nd > MAX_DIMS:
        raise GGUFError(f"{path}: tensor {name!r} has {nd} dims, at most {MAX_DIMS} allowed")
    dims = [cur.scalar(UINT64, f"dim {j} of tensor {name!r}") for j in range(nd)]
    n = 1
    for d in dims:
        n *= d
    if n > MAX_ELEMENTS:
        raise GGUFError(f"{path}: tensor {name!r} has absurd dimensions {dims} ({n} elements)")
    type_id = cur.scalar(UINT32, f"type of tensor {name!r}")
    offset = cur.scalar(UINT64, f"offset of tensor {name!r}")
    shape = tuple(reversed(dims))
    if type_id not in TYPE_SIZES:
        raise GGUFError(f"{path}: tensor {name!r} has unknown type id {type_id}")
    try:
        nbytes = tensor_nbytes(type_id, shape)
    except GGUFError as e:
        raise GGUFError(f"{path}: tensor {name!r}: {e}") from None
    return name, shape, type_id, offset, nbytes


def _place_tensors(infos: list[tuple], data_offset: int, alignment: int, size: int, path: Path) -> dict:
    """The tensors' `TensorInfo`s by name, their data checked to lie in the file, in table order, aligned."""
    tensors: dict[str, TensorInfo] = {}
    expected = 0
    for name, shape, type_id, offset, nbytes in infos:
        if name in tensors:
            raise GGUFError(f"{path}: duplicate tensor name {name!r}")
        start = data_offset + offset
        if start + nbytes > size:
            raise GGUFError(
                f"{path}: tensor {name!r} data ({nbytes} bytes at offset {start}) runs past the end of the "
                f"file ({size} bytes); the file is truncated"
            )
        if offset != expected:  # llama.cpp's rule: each tensor's data follows the previous one's, padded
            raise GGUFError(
                f"{path}: tensor {name!r} data offset {offset}, expected {expected}: tensor data must follow "
                f"the tensor table's order with no overlap or gap (aligned to {alignment})"
            )
        expected += -(-nbytes // alignment) * alignment
        tensors[name] = TensorInfo(name, shape, type_id, start, nbytes)
    return tensors


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open and validate a GGUF file (header, metadata, tensor table, data bounds); data stays memory-mapped."""
    path = Path(path)
    size = path.stat().st_size
    if size < 24:
        raise GGUFError(f"{path}: not a GGUF file (only {size} bytes; the header alone is 24)")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm), path)
    version, n_tensors, n_kv = _read_header(cur, mm, path)
    metadata, vtypes = _read_metadata(cur, n_kv)
    alignment = _checked_alignment(metadata, path)
    infos = [_read_tensor_info(cur, i, path) for i in range(n_tensors)]
    data_offset = -(-cur.pos // alignment) * alignment
    tensors = _place_tensors(infos, data_offset, alignment, size, path)
    return GGUFFile(path, version, metadata, vtypes, tensors, alignment, data_offset, mm)


# ---- writing -----------------------------------------------------------------------------------


@dataclass
class TensorToWrite:
    name: str
    data: np.ndarray  # bytes (uint8) for quantized types, else the float array itself
    type_id: int
    shape: tuple[int, ...]  # numpy order, in values


def _guess_vtype(v: Any) -> tuple[int, int | None]:
    if isinstance(v, bool):
        return BOOL, None
    if isinstance(v, int):
        return (INT32 if -(2**31) <= v < 2**31 else INT64), None
    if isinstance(v, float):
        return FLOAT32, None
    if isinstance(v, str):
        return STRING, None
    if isinstance(v, (list, tuple)):
        if not v or isinstance(v[0], str):
            return ARRAY, STRING
        if isinstance(v[0], bool):
            return ARRAY, BOOL
        if isinstance(v[0], int):
            return ARRAY, INT32
        return ARRAY, FLOAT32
    raise TypeError(f"cannot store metadata value of type {type(v).__name__} in GGUF")


def write_gguf(
    path: str | os.PathLike,
    arch: str,
    metadata: dict[str, Any],
    tensors: Iterable[TensorToWrite],
    value_types: dict[str, tuple[int, int | None]] | None = None,
    alignment: int = 32,
) -> None:
    """Write a GGUF v3 file atomically (temp file in the same directory, then rename).

    `metadata` maps keys to Python values (types from `value_types` when given, else guessed);
    `general.architecture` is written from `arch`. Tensors are written in order, one at a time.
    """
    import gguf

    path = Path(path)
    value_types = value_types or {}
    tensors = list(tensors)
    with atomic.temp_file(path) as tmp:
        w = gguf.GGUFWriter(tmp, arch)
        if alignment != 32:
            w.data_alignment = alignment
            w.add_uint32("general.alignment", alignment)
        for key, val in metadata.items():
            if key in ("general.architecture", "general.alignment"):
                continue
            vt, et = value_types.get(key) or _guess_vtype(val)
            if isinstance(val, np.ndarray):
                val = val.tolist()
            w.add_key_value(key, val, gguf.GGUFValueType(vt), None if et is None else gguf.GGUFValueType(et))
        for t in tensors:
            nb = tensor_nbytes(t.type_id, t.shape)
            if t.data.nbytes != nb:
                raise GGUFError(
                    f"write_gguf: tensor {t.name!r} has {t.data.nbytes} bytes, {type_name(t.type_id)} "
                    f"of shape {t.shape} needs {nb}"
                )
            # pass a non-uint8 dtype so GGUFWriter keeps our logical shape (it cannot derive I2_S shapes)
            w.add_tensor_info(t.name, list(t.shape), np.dtype(np.float32), nb, raw_dtype=t.type_id)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in tensors:
            w.write_tensor_data(np.ascontiguousarray(t.data))
        w.close()
        atomic.commit(tmp, path)
