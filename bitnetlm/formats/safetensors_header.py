"""The safetensors header, read and validated the way the safetensors library validates it.

Every reader of ours that looks at a header without the library (the zero-copy memory map, the layout probe,
`bitnet inspect`) goes through `read_header`, so a file the library refuses is refused here too, with one line
naming the file and the tensor: an object header of at most 100 MB, known dtypes, non-negative integer dims,
byte sizes that fit in 64 bits and equal dtype size x element count, and data ranges that tile the data region
exactly (sorted, from 0, no gap, no overlap, ending at the end of the file). Overlapping or shifted ranges would
otherwise read other tensors' bytes and silently change a model's output.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

MAX_HEADER = 100_000_000  # the safetensors library's limit
_U64 = 1 << 64

# dtype -> bits per element (the safetensors library's Dtype list)
DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # byte offsets relative to the data region
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Header:
    path: Path
    tensors: dict[str, TensorEntry]  # in file order of their data
    metadata: dict[str, str]
    data_start: int  # absolute offset of the data region
    file_size: int


def _nonneg_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _entry(path: Path, name: str, info) -> TensorEntry:
    if not isinstance(info, dict):
        raise ValueError(f"{path}: tensor {name!r}: header entry must be an object, found {info!r:.80}")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise ValueError(f"{path}: tensor {name!r} has unknown dtype {dtype!r:.40}")
    if not isinstance(shape, list) or not all(_nonneg_int(d) for d in shape):
        raise ValueError(
            f"{path}: tensor {name!r}: shape must be a list of non-negative integers, found {shape!r:.80}"
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_nonneg_int(o) for o in offsets)):
        raise ValueError(
            f"{path}: tensor {name!r}: data_offsets must be two non-negative integers, found {offsets!r:.80}"
        )
    start, end = offsets
    numel = 1
    for d in shape:
        numel *= d
    bits = numel * DTYPE_BITS[dtype]
    if bits >= _U64 * 8:
        raise ValueError(f"{path}: tensor {name!r}: shape {shape} overflows (more than 2^64 bytes)")
    if bits % 8:
        raise ValueError(f"{path}: tensor {name!r}: {dtype} shape {shape} does not end on a byte boundary")
    if end < start or end - start != bits // 8:
        raise ValueError(
            f"{path}: tensor {name!r}: {dtype} shape {shape} needs {bits // 8} bytes, "
            f"its data_offsets [{start}, {end}] give {end - start}"
        )
    return TensorEntry(name, dtype, tuple(shape), start, end)


def _check_tiling(path: Path, entries: list[TensorEntry], data_size: int) -> list[TensorEntry]:
    """Sorted by offset, the ranges must follow each other with no gap or overlap and end at the file's end."""
    entries = sorted(entries, key=lambda e: (e.start, e.end))
    pos, prev = 0, None
    for e in entries:
        if e.end > data_size:
            raise ValueError(
                f"{path}: tensor {e.name!r} data [{e.start}, {e.end}) runs past the end of the file "
                f"({data_size} data bytes; truncated?)"
            )
        if e.start != pos:
            what = f"overlaps tensor {prev.name!r}" if e.start < pos else "leaves a gap before it"
            where = f"after {prev.name!r} ends at {pos}" if prev else "the data starts at 0"
            raise ValueError(
                f"{path}: tensor {e.name!r}: data_offsets [{e.start}, {e.end}] {what} ({where}); "
                "tensor data must be contiguous and non-overlapping"
            )
        pos, prev = e.end, e
    if pos != data_size:
        raise ValueError(
            f"{path}: tensor data ends at {pos} but the file holds {data_size} data bytes "
            "(truncated, or bytes no tensor covers)"
        )
    return entries


def read_header(path: str | os.PathLike) -> Header:
    """The validated header of a safetensors file (ValueError naming the file and tensor otherwise)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes; the header length alone is 8)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(
                f"{path}: safetensors header length {n} exceeds the file size {size} (truncated?)"
            )
        if n > MAX_HEADER:
            raise ValueError(f"{path}: safetensors header length {n} is over the {MAX_HEADER}-byte limit")
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: corrupt safetensors header (not JSON: {str(e).splitlines()[0]})") from None
    if not isinstance(header, dict):
        raise ValueError(
            f"{path}: corrupt safetensors header: expected a JSON object, found {type(header).__name__}"
        )
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: corrupt safetensors header: __metadata__ must be an object")
    entries = [_entry(path, str(k), v) for k, v in header.items()]
    entries = _check_tiling(path, entries, size - 8 - n)
    return Header(
        path=path,
        tensors={e.name: e for e in entries},
        metadata={str(k): str(v) for k, v in meta.items()},
        data_start=8 + n,
        file_size=size,
    )
