"""Python entry points of the C kernels, plus their torch.library custom ops (with fake implementations).

Eager calls go straight to ctypes (the dispatcher would add tens of microseconds to each of the ~200
linears of a decode step); under torch.compile the same computation is reached through the custom ops,
which the compiler treats as opaque nodes with the shapes given by the fake implementations.
"""

from __future__ import annotations

import ctypes

import torch

from bitnetlm.kernels.cpu import _lib
from bitnetlm.kernels.cpu.layout import padded_k


def lib() -> ctypes.CDLL:
    lib = _lib.load()
    if lib is None:
        raise RuntimeError(f"bitnetlm C kernels unavailable: {_lib.load_error()}")
    return lib


def _check_packed(packed: torch.Tensor, n: int, k: int, where: str) -> None:
    want = (n, padded_k(k) // 4)
    if packed.dtype != torch.uint8 or tuple(packed.shape) != want or not packed.is_contiguous():
        raise ValueError(
            f"{where}: packed weights must be contiguous uint8 {list(want)} in layout cpu-2bit-v1 for "
            f"[{n}, {k}], found {packed.dtype} {list(packed.shape)}"
        )


def _as_f32_2d(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if x2.dtype != torch.float32:
        x2 = x2.float()
    return x2.contiguous()


# ---- eager implementations ------------------------------------------------------------------------
def ternary_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor | float, out_features: int):
    """y = (X @ T^T) * s / a with per-token int8 X: bit-identical to the reference backend (float32)."""
    k = x.shape[-1]
    _check_packed(packed, out_features, k, "cpu ternary_linear")
    x2 = _as_f32_2d(x)
    m = x2.shape[0]
    y = torch.empty((m, out_features), dtype=torch.float32)
    s = float(scale)
    lib().bn_ternary_linear_f32(x2.data_ptr(), m, k, packed.data_ptr(), out_features, s, y.data_ptr())
    y = y.reshape(*x.shape[:-1], out_features)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def ternary_linear_multi(x: torch.Tensor, packed: list[torch.Tensor], scales: list, out_features: list[int]):
    """Several ternary linears of one input (q/k/v or gate/up): one quantization, one thread dispatch."""
    k = x.shape[-1]
    count = len(packed)
    if not 1 <= count <= 8 or len(scales) != count or len(out_features) != count:
        raise ValueError(f"ternary_linear_multi: 1..8 matrices with one scale and size each, got {count}")
    for p, n in zip(packed, out_features):
        _check_packed(p, n, k, "cpu ternary_linear_multi")
    x2 = _as_f32_2d(x)
    m = x2.shape[0]
    # one output buffer, split into views: one allocation per call
    y_all = torch.empty((m, sum(out_features)), dtype=torch.float32)
    ys = list(torch.split(y_all, list(out_features), dim=1)) if count > 1 else [y_all]
    ptrs, ns, ss = _weight_arrays(packed, scales, out_features)
    row = y_all.data_ptr()
    offs, o = [], 0
    for n in out_features:
        offs.append(row + 4 * o)
        o += n
    yp = (ctypes.c_void_p * count)(*offs)
    rc = lib().bn_ternary_linear_multi_f32_ld(x2.data_ptr(), m, k, count, ptrs, ns, ss, yp, y_all.shape[1])
    if rc != 0:
        raise RuntimeError(f"bn_ternary_linear_multi_f32 failed with code {rc}")
    lead = x.shape[:-1]
    return [y.reshape(*lead, y.shape[-1]).to(x.dtype) for y in ys]


_arrays: dict[tuple, tuple] = {}


def _weight_arrays(packed, scales, out_features):
    """ctypes arrays of weight/scale pointers and sizes, cached per group of layers (scales are read by
    pointer at call time, so a cached entry never holds a stale scale value)."""
    for s in scales:
        if not (isinstance(s, torch.Tensor) and s.dtype == torch.float32 and s.device.type == "cpu"):
            raise TypeError(
                f"ternary_linear_multi: scales must be float32 CPU tensors, found {type(s).__name__}"
            )
    key = tuple(p.data_ptr() for p in packed) + tuple(s.data_ptr() for s in scales) + tuple(out_features)
    got = _arrays.get(key)
    if got is None:
        count = len(packed)
        got = (
            (ctypes.c_void_p * count)(*[p.data_ptr() for p in packed]),
            (ctypes.c_int64 * count)(*out_features),
            (ctypes.c_void_p * count)(*[s.data_ptr() for s in scales]),
        )
        if len(_arrays) > 4096:
            _arrays.clear()
        _arrays[key] = got
    return got


def ternary_matmul_i32(xq: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """Exact int32 product X @ T^T for any int8 X [..., K] (the oracle is quant.ternary.int_matmul)."""
    if xq.dtype != torch.int8:
        raise TypeError(f"ternary_matmul_i32: activations must be int8, found {xq.dtype}")
    k = xq.shape[-1]
    _check_packed(packed, out_features, k, "cpu ternary_matmul_i32")
    x2 = xq.reshape(-1, k).contiguous()  # [M, K]
    out = torch.empty((x2.shape[0], out_features), dtype=torch.int32)
    rc = lib().bn_ternary_matmul_i32(
        x2.data_ptr(), x2.shape[0], k, packed.data_ptr(), out_features, out.data_ptr()
    )
    if rc != 0:
        raise RuntimeError(f"bn_ternary_matmul_i32 failed with code {rc}")
    return out.reshape(*xq.shape[:-1], out_features)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token int8 quantization by the C library: (X int8 [..., K], a float32 [..., 1])."""
    k = x.shape[-1]
    x2 = _as_f32_2d(x)
    m = x2.shape[0]
    q = torch.empty((m, k), dtype=torch.int8)
    a = torch.empty((m,), dtype=torch.float32)
    lib().bn_quantize_act(x2.data_ptr(), m, k, q.data_ptr(), k, a.data_ptr(), None)
    return q.reshape(x.shape), a.reshape(*x.shape[:-1], 1)


def gemm_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 x [..., K] @ bf16 W[N, K]^T in float32 (the bf16 LM head without a float32 weight copy)."""
    if w.dtype != torch.bfloat16 or w.dim() != 2 or not w.is_contiguous():
        raise ValueError(f"gemm_bf16: weight must be contiguous bf16 [N, K], found {w.dtype} {list(w.shape)}")
    k = x.shape[-1]
    if w.shape[1] != k:
        raise ValueError(f"gemm_bf16: x has K={k}, weight has K={w.shape[1]}")
    x2 = _as_f32_2d(x)
    y = torch.empty((x2.shape[0], w.shape[0]), dtype=torch.float32)
    lib().bn_gemm_bf16(x2.data_ptr(), x2.shape[0], k, w.data_ptr(), w.shape[0], y.data_ptr())
    return y.reshape(*x.shape[:-1], w.shape[0])


def gemm_i8row(x: torch.Tensor, w: torch.Tensor, wscale: torch.Tensor) -> torch.Tensor:
    """float32 x [..., K] @ (int8 W[N, K] * wscale[N, None])^T in float32 (the int8 LM head)."""
    if w.dtype != torch.int8 or w.dim() != 2 or not w.is_contiguous():
        raise ValueError(
            f"gemm_i8row: weight must be contiguous int8 [N, K], found {w.dtype} {list(w.shape)}"
        )
    k = x.shape[-1]
    if w.shape[1] != k or wscale.shape != (w.shape[0],) or wscale.dtype != torch.float32:
        raise ValueError(
            f"gemm_i8row: expected x [..., {w.shape[1]}] and float32 scales [{w.shape[0]}], found x [..., {k}] "
            f"and scales {wscale.dtype} {list(wscale.shape)}"
        )
    x2 = _as_f32_2d(x)
    ws = wscale.contiguous()
    y = torch.empty((x2.shape[0], w.shape[0]), dtype=torch.float32)
    lib().bn_gemm_i8row(x2.data_ptr(), x2.shape[0], k, w.data_ptr(), ws.data_ptr(), w.shape[0], y.data_ptr())
    return y.reshape(*x.shape[:-1], w.shape[0])


# ---- custom ops (torch.compile sees these) --------------------------------------------------------
@torch.library.custom_op("bitnetlm::cpu_ternary_linear", mutates_args=())
def cpu_ternary_linear(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out_features: int
) -> torch.Tensor:
    return ternary_linear(x, packed, scale, out_features)


@cpu_ternary_linear.register_fake
def _(x, packed, scale, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("bitnetlm::cpu_ternary_linear_multi", mutates_args=())
def cpu_ternary_linear_multi(
    x: torch.Tensor, packed: list[torch.Tensor], scales: list[torch.Tensor], out_features: list[int]
) -> list[torch.Tensor]:
    return ternary_linear_multi(x, packed, scales, out_features)


@cpu_ternary_linear_multi.register_fake
def _(x, packed, scales, out_features):
    return [x.new_empty((*x.shape[:-1], n)) for n in out_features]


@torch.library.custom_op("bitnetlm::cpu_ternary_matmul_i32", mutates_args=())
def cpu_ternary_matmul_i32(xq: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return ternary_matmul_i32(xq, packed, out_features)


@cpu_ternary_matmul_i32.register_fake
def _(xq, packed, out_features):
    return xq.new_empty((*xq.shape[:-1], out_features), dtype=torch.int32)


@torch.library.custom_op("bitnetlm::cpu_gemm_bf16", mutates_args=())
def cpu_gemm_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return gemm_bf16(x, w)


@cpu_gemm_bf16.register_fake
def _(x, w):
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=torch.float32)


@torch.library.custom_op("bitnetlm::cpu_gemm_i8row", mutates_args=())
def cpu_gemm_i8row(x: torch.Tensor, w: torch.Tensor, wscale: torch.Tensor) -> torch.Tensor:
    return gemm_i8row(x, w, wscale)


@cpu_gemm_i8row.register_fake
def _(x, w, wscale):
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=torch.float32)


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def linear(x, packed, scale, out_features):
    if _compiling():
        return cpu_ternary_linear(x, packed, scale, out_features)
    return ternary_linear(x, packed, scale, out_features)


def linear_multi(x, packed, scales, out_features):
    if _compiling():
        return cpu_ternary_linear_multi(x, list(packed), list(scales), list(out_features))
    return ternary_linear_multi(x, packed, scales, out_features)


def head_bf16(x, w):
    return cpu_gemm_bf16(x, w) if _compiling() else gemm_bf16(x, w)


def head_i8(x, w, wscale):
    return cpu_gemm_i8row(x, w, wscale) if _compiling() else gemm_i8row(x, w, wscale)
