"""Huge-page arenas for CPU weights that are streamed every decode step (packed ternary matrices, LM head).

Why: decode reads ~1 GB of weights per token at memory bandwidth. With 4 KiB pages the hardware prefetchers
stop at every page boundary and the TLB misses constantly; on 2 MiB transparent huge pages the same kernels
read measurably faster (benchmarks/cpu_profile.py --kernels). Linux only grants huge pages to ranges marked with
madvise(MADV_HUGEPAGE) (the common "madvise" THP mode) before they are first touched, so weights are copied
into large arenas marked that way. Each tensor is a 64-byte aligned view into an arena; elsewhere (no Linux,
THP off) the same code simply gives ordinary memory.
"""

from __future__ import annotations

import ctypes
import math
import sys
import threading

import torch

HUGE = 2 << 20
CHUNK = 64 << 20  # arena size; bigger tensors get their own arena
_MADV_HUGEPAGE = 14
_lock = threading.Lock()
_cur: torch.Tensor | None = None  # the arena being filled
_off = 0
_madvise = None


def enabled() -> bool:
    return sys.platform.startswith("linux")


def _advise(buf: torch.Tensor) -> None:
    """Mark the 2 MiB-aligned interior of a fresh (untouched) buffer for transparent huge pages."""
    global _madvise
    if _madvise is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            _madvise = libc.madvise
            _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _madvise.restype = ctypes.c_int
        except (OSError, AttributeError):
            _madvise = False
    if not _madvise:
        return
    start = (buf.data_ptr() + HUGE - 1) // HUGE * HUGE
    end = (buf.data_ptr() + buf.numel()) // HUGE * HUGE
    if end > start:
        _madvise(start, end - start, _MADV_HUGEPAGE)  # best effort: failure only costs speed


def _new_arena(nbytes: int) -> torch.Tensor:
    buf = torch.empty(nbytes + HUGE, dtype=torch.uint8)  # fresh pages: madvise before the first touch
    _advise(buf)
    skip = (-buf.data_ptr()) % HUGE
    return buf[skip : skip + nbytes]


def _bytes(nbytes: int) -> torch.Tensor:
    """Uninitialised uint8 [nbytes] on huge pages where possible (a view into a shared arena)."""
    global _cur, _off
    if not enabled() or nbytes < (256 << 10):
        return torch.empty(nbytes, dtype=torch.uint8)
    with _lock:
        if nbytes > CHUNK // 2:
            return _new_arena((nbytes + 63) // 64 * 64)[:nbytes]
        if _cur is None or _off + nbytes > _cur.numel():
            _cur, _off = _new_arena(CHUNK), 0
        out = _cur[_off : _off + nbytes]
        _off += (nbytes + 63) // 64 * 64
        return out


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """Uninitialised contiguous tensor of `shape` and `dtype` on huge pages where possible."""
    numel = math.prod(shape)
    return _bytes(numel * dtype.itemsize).view(dtype).view(shape)


def place(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous copy of `t` on huge pages (same shape; `dtype` converts element by element, no temporary)."""
    out = empty(t.shape, dtype or t.dtype)
    out.copy_(t)
    return out
