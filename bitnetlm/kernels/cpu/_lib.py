"""Finding and loading the C kernel library (csrc/, built by setup.py) through ctypes.

The library is plain C with no Python headers: `bitnetlm/kernels/_bitnet_cpu<EXT_SUFFIX>`.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
from pathlib import Path

ISA_AUTO, ISA_SCALAR, ISA_AVX2, ISA_AVX512VNNI, ISA_NEON = -1, 0, 1, 2, 3
ISA_NAMES = {ISA_SCALAR: "scalar", ISA_AVX2: "avx2", ISA_AVX512VNNI: "avx512vnni", ISA_NEON: "neon"}
LAYOUT_2BIT, LAYOUT_BASE3 = 0, 1  # BN_LAYOUT_*

_lib: ctypes.CDLL | None = None
_error: str | None = None
_tried = False

_i64, _i32, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_float
_vp = ctypes.c_void_p


def library_path() -> Path | None:
    """Path of the built library next to bitnetlm/kernels, or None when it was not built."""
    here = Path(__file__).resolve().parent.parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = here / f"_bitnet_cpu{suffix}"
        if p.exists():
            return p
    return None


def _declare(lib: ctypes.CDLL) -> None:
    sig = {
        "bn_version": (ctypes.c_char_p, []),
        "bn_isa_supported": (_i32, [_i32]),
        "bn_isa_best": (_i32, []),
        "bn_set_isa": (_i32, [_i32]),
        "bn_get_isa": (_i32, []),
        "bn_set_num_threads": (_i32, [_i32]),
        "bn_get_num_threads": (_i32, []),
        "bn_padded_k": (_i64, [_i64]),
        "bn_packed_row_bytes": (_i64, [_i64]),
        "bn_packed_rows": (_i64, [_i64]),
        "bn_pack": (None, [_vp, _i64, _i64, _vp]),
        "bn_unpack": (None, [_vp, _i64, _i64, _vp]),
        "bn_repack_hf": (None, [_vp, _i64, _i64, _vp]),
        "bn_repack": (_i32, [_vp, _i32, _i64, _i64, _vp, _i32]),
        "bn_ternary_matmul_i32_layout": (_i32, [_vp, _i64, _i64, _vp, _i64, _vp, _i32]),
        "bn_ternary_linear_multi_f32_layout": (
            _i32,
            [_vp, _i64, _i64, _i32, _vp, _vp, _vp, _vp, _i64, _i32],
        ),
        "bn_quantize_act": (None, [_vp, _i64, _i64, _vp, _i64, _vp, _vp]),
        "bn_ternary_matmul_i32": (_i32, [_vp, _i64, _i64, _vp, _i64, _vp]),
        "bn_ternary_linear_f32": (_i32, [_vp, _i64, _i64, _vp, _i64, _f32, _vp]),
        "bn_ternary_linear_multi_f32": (_i32, [_vp, _i64, _i64, _i32, _vp, _vp, _vp, _vp]),
        "bn_ternary_linear_multi_f32_ld": (_i32, [_vp, _i64, _i64, _i32, _vp, _vp, _vp, _vp, _i64]),
        "bn_gemm_bf16": (_i32, [_vp, _i64, _i64, _vp, _i64, _vp]),
        "bn_gemm_f32": (_i32, [_vp, _i64, _i64, _vp, _i64, _vp]),
        "bn_gemm_i8row": (_i32, [_vp, _i64, _i64, _vp, _vp, _i64, _vp]),
        "bn_parallel_copy": (None, [_vp, _vp, _i64]),
        "bn_parallel_read": (ctypes.c_uint64, [_vp, _i64]),
        "bn_silu_mul_f32": (None, [_vp, _vp, _vp, _i64]),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args


def load() -> ctypes.CDLL | None:
    """The loaded library, or None (see `load_error()` for why)."""
    global _lib, _error, _tried
    if _tried:
        return _lib
    _tried = True
    path = library_path()
    if path is None:
        _error = "the C kernel library was not built (pip install -e . needs a C compiler)"
        return None
    try:
        lib = ctypes.CDLL(str(path))
        _declare(lib)
    except (OSError, AttributeError) as e:
        _error = f"could not load {path}: {e}"
        return None
    _lib = lib
    if not os.environ.get("BITNETLM_NUM_THREADS"):
        lib.bn_set_num_threads(physical_cores())
    return _lib


def load_error() -> str | None:
    load()
    return _error


def physical_cores() -> int:
    """Physical cores this process may run on (hyper-threads of one core count once)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
    cores = set()
    for c in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            pkg = (topo / "physical_package_id").read_text().strip()
            core = (topo / "core_id").read_text().strip()
        except OSError:
            return len(cpus)
        cores.add((pkg, core))
    return max(1, len(cores))
