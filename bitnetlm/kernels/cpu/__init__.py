"""CPU kernel backend "cpu": the C library in csrc/ (AVX-512 VNNI / AVX2 / NEON / scalar, multithreaded).

Layout PackingFormat.CPU_2BIT ("cpu-2bit-v2", see layout.py). Without the built library (no compiler at
install time) `BACKEND.is_available()` is False and dispatch falls back to
the reference backend.

Threads: `set_num_threads(n)` (default: physical cores; env BITNETLM_NUM_THREADS). Instruction set:
`set_isa("scalar" | "avx2" | "avx512vnni" | "neon" | None)` (default: best supported; env BITNETLM_CPU_ISA).
"""

from __future__ import annotations

import contextlib

import torch

from bitnetlm.kernels.cpu import _lib, arena
from bitnetlm.kernels.cpu.layout import pack_cpu, packed_rows, padded_k, unpack_cpu
from bitnetlm.quant.packing import PackingFormat

__all__ = [
    "BACKEND",
    "available",
    "get_isa",
    "get_num_threads",
    "physical_cores",
    "set_isa",
    "set_num_threads",
    "supported_isas",
    "use_isa",
    "pack_cpu",
    "unpack_cpu",
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
    name = "cpu"
    layout = PackingFormat.CPU_2BIT

    def is_available(self, device: torch.device | str = "cpu") -> bool:
        return torch.device(device).type == "cpu" and available()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        return pack_cpu(t.to(torch.int8))

    def unpack(self, p: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        return unpack_cpu(p, tuple(shape))

    def repack(self, p: torch.Tensor, layout, shape: tuple[int, int]) -> torch.Tensor | None:
        """The HF 2-bit layout straight into ours in C (no int8 copy; ~10x faster at load), else None."""
        n, k = shape
        if (
            PackingFormat(layout) is not PackingFormat.HF_2BIT
            or p.device.type != "cpu"
            or p.dtype != torch.uint8
            or tuple(p.shape) != ((n + 3) // 4, k)
            or not available()
        ):
            return None
        np_, kp = packed_rows(n), padded_k(k)
        out = arena.empty((np_, kp // 4))  # [Np, Kp/4]
        src = p.contiguous()
        _need().bn_repack_hf(src.data_ptr(), n, k, out.data_ptr())
        return out

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out_features: int
    ) -> torch.Tensor:
        return self._ops().linear(x, packed, scale, out_features)

    def linear_multi(self, x, packed, scales, out_features):
        """Several linears of one input at once (one activation quantization, one thread dispatch)."""
        return self._ops().linear_multi(x, packed, scales, out_features)

    _ops_mod = None

    @classmethod
    def _ops(cls):
        if cls._ops_mod is None:  # imported on first use: registering the custom ops costs import time
            from bitnetlm.kernels.cpu import ops

            cls._ops_mod = ops
        return cls._ops_mod


BACKEND = CpuBackend()
