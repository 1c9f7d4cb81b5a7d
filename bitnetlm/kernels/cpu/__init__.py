"""CPU kernel backend "cpu": the C library in csrc/ (AVX-512 VNNI / AVX2 / NEON / scalar, multithreaded).

Layouts PackingFormat.CPU_2BIT ("cpu-2bit-v2", `BACKEND`) and CPU_BASE3 ("cpu-base3-v1", 1.6 bits a weight,
`BACKEND_BASE3`), see layout.py. Without the built library (no compiler at
install time) `BACKEND.is_available()` is False and dispatch falls back to
the reference backend.

Threads: `set_num_threads(n)` (default: physical cores; env BITNETLM_NUM_THREADS). Instruction set:
`set_isa("scalar" | "avx2" | "avx512vnni" | "neon" | None)` (default: best supported; env BITNETLM_CPU_ISA).
"""

from __future__ import annotations

import contextlib

import torch

from bitnetlm.kernels.cpu import _lib, arena
from bitnetlm.kernels.cpu.layout import (
    pack_base3_cpu,
    pack_cpu,
    packed_shape,
    packed_shape3,
    padded_k,
    unpack_base3_cpu,
    unpack_cpu,
)
from bitnetlm.quant.packing import PackingFormat

__all__ = [
    "BACKEND",
    "BACKEND_BASE3",
    "WEIGHTS_LAYOUTS",
    "available",
    "get_isa",
    "get_num_threads",
    "physical_cores",
    "set_isa",
    "set_num_threads",
    "supported_isas",
    "use_isa",
    "pack_cpu",
    "pack_base3_cpu",
    "unpack_cpu",
    "unpack_base3_cpu",
    "padded_k",
]

physical_cores = _lib.physical_cores


def available() -> bool:
    """True when the C library is built and loaded."""
    return _lib.load() is not None


def _need():
    lib = _lib.load()
    if lib is None:
        raise RuntimeError(f"bitnetlm C kernels unavailable: {_lib.load_error()}")
    return lib


def set_num_threads(n: int | None) -> int:
    """Threads used by the C kernels (None or <= 0: physical cores). Returns the count now in use."""
    lib = _need()
    return int(lib.bn_set_num_threads(physical_cores() if not n or n <= 0 else int(n)))


def get_num_threads() -> int:
    return int(_need().bn_get_num_threads())


def supported_isas() -> list[str]:
    """Instruction-set paths this build can run on this CPU, best last."""
    lib = _need()
    return [name for isa, name in _lib.ISA_NAMES.items() if lib.bn_isa_supported(isa)]


def get_isa() -> str:
    return _lib.ISA_NAMES[int(_need().bn_get_isa())]


def set_isa(name: str | None) -> str:
    """Force an instruction-set path (None: the best one). Raises ValueError if unsupported here."""
    lib = _need()
    if name is None:
        code = _lib.ISA_AUTO
    else:
        codes = {v: k for k, v in _lib.ISA_NAMES.items()}
        if name not in codes:
            raise ValueError(f"unknown ISA {name!r}; known: {sorted(codes)}")
        code = codes[name]
    got = lib.bn_set_isa(code)
    if got < 0:
        raise ValueError(f"ISA {name!r} is not supported on this CPU/build; supported: {supported_isas()}")
    return _lib.ISA_NAMES[int(got)]


@contextlib.contextmanager
def use_isa(name: str | None):
    """Run a block with a forced instruction-set path, restoring the previous one after."""
    prev = get_isa()
    set_isa(name)
    try:
        yield
    finally:
        set_isa(prev)


class CpuBackend:
    """The C kernels over one packed layout: cpu-2bit-v2 (`BACKEND`) or cpu-base3-v1 (`BACKEND_BASE3`, 1.6 bits a
    weight: fewer bytes for decode to read, more work to unpack them). Both are named "cpu"."""

    name = "cpu"

    def __init__(self, layout: PackingFormat = PackingFormat.CPU_2BIT):
        self.layout = PackingFormat(layout)
        self.base3 = self.layout is PackingFormat.CPU_BASE3
        self.code = _lib.LAYOUT_BASE3 if self.base3 else _lib.LAYOUT_2BIT

    def is_available(self, device: torch.device | str = "cpu") -> bool:
        return torch.device(device).type == "cpu" and available()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        return (pack_base3_cpu if self.base3 else pack_cpu)(t.to(torch.int8))

    def unpack(self, p: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        return (unpack_base3_cpu if self.base3 else unpack_cpu)(p, tuple(shape))

    def repack(self, p: torch.Tensor, layout, shape: tuple[int, int]) -> torch.Tensor | None:
        """The HF 2-bit layout, or the other "cpu" layout, straight into ours in C without an int8 copy (~10x faster
        at load), else None."""
        n, k = shape
        layout = PackingFormat(layout)
        if p.device.type != "cpu" or p.dtype != torch.uint8 or not available():
            return None
        if layout is PackingFormat.HF_2BIT and tuple(p.shape) == ((n + 3) // 4, k):
            shape2 = packed_shape(n, k)  # [Np, Kp/4]; a temporary for base-3
            out = torch.empty(shape2, dtype=torch.uint8) if self.base3 else arena.empty(shape2)
            _need().bn_repack_hf(p.contiguous().data_ptr(), n, k, out.data_ptr())
            return self.repack(out, PackingFormat.CPU_2BIT, shape) if self.base3 else out
        other = WEIGHTS_LAYOUTS["2bit" if self.base3 else "base3"]
        want = packed_shape3(n, k) if other.base3 else packed_shape(n, k)
        if layout is not other.layout or tuple(p.shape) != want:
            return None
        out = arena.empty(packed_shape3(n, k) if self.base3 else packed_shape(n, k))
        if _need().bn_repack(p.contiguous().data_ptr(), other.code, n, k, out.data_ptr(), self.code) != 0:
            raise MemoryError(f"repacking a [{n}, {k}] matrix into {self.layout.value}: out of memory")
        return out

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out_features: int
    ) -> torch.Tensor:
        return self._ops().linear(x, packed, scale, out_features, self.code)

    def linear_multi(self, x, packed, scales, out_features):
        """Several linears of one input at once (one activation quantization, one thread dispatch)."""
        return self._ops().linear_multi(x, packed, scales, out_features, self.code)

    _ops_mod = None

    @classmethod
    def _ops(cls):
        if cls._ops_mod is None:  # imported on first use: registering the custom ops costs import time
            from bitnetlm.kernels.cpu import ops

            cls._ops_mod = ops
        return cls._ops_mod


BACKEND = CpuBackend()
BACKEND_BASE3 = CpuBackend(PackingFormat.CPU_BASE3)
WEIGHTS_LAYOUTS = {"2bit": BACKEND, "base3": BACKEND_BASE3}  # runtime weights_layout -> its backend
