"""Python entry points of the C kernels, plus their torch.library custom ops (with fake implementations).

Eager calls go straight to ctypes (the dispatcher would add tens of microseconds to each of the ~200
linears of a decode step); under torch.compile the same computation is reached through the custom ops,
which the compiler treats as opaque nodes with the shapes given by the fake implementations.
"""

from __future__ import annotations

import ctypes

import torch

from bitnetlm.kernels.cpu import _lib
from bitnetlm.kernels.cpu.layout import packed_shape, packed_shape3

LAYOUT_NAMES = {_lib.LAYOUT_2BIT: "cpu-2bit-v2", _lib.LAYOUT_BASE3: "cpu-base3-v1"}


def lib() -> ctypes.CDLL:
    lib = _lib.load()
    if lib is None:
        raise RuntimeError(f"bitnetlm C kernels unavailable: {_lib.load_error()}")
    return lib


def _check_packed(packed: torch.Tensor, n: int, k: int, where: str, layout: int = 0) -> None:
    if layout not in LAYOUT_NAMES:
        raise ValueError(f"{where}: unknown weight layout {layout!r}; known: {sorted(LAYOUT_NAMES)}")
    want = packed_shape3(n, k) if layout == _lib.LAYOUT_BASE3 else packed_shape(n, k)
    if packed.dtype != torch.uint8 or tuple(packed.shape) != want or not packed.is_contiguous():
        raise ValueError(
            f"{where}: packed weights must be contiguous uint8 {list(want)} in layout {LAYOUT_NAMES[layout]} "
            f"for [{n}, {k}], found {packed.dtype} {list(packed.shape)}"
        )


def _as_f32_2d(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if x2.dtype != torch.float32:
        x2 = x2.float()
    return x2.contiguous()


# ---- eager implementations ------------------------------------------------------------------------
def ternary_linear(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor | float, out_features: int, layout: int = 0
):
    """y = (X @ T^T) * s / a with per-token int8 X: bit-identical to the reference backend (float32).
    layout: _lib.LAYOUT_* of `packed`."""
    k = x.shape[-1]
    _check_packed(packed, out_features, k, "cpu ternary_linear", layout)
    x2 = _as_f32_2d(x)
    m = x2.shape[0]
    y = torch.empty((m, out_features), dtype=torch.float32)
    s = ctypes.c_float(float(scale))
    sp = ctypes.c_void_p(ctypes.addressof(s))
    w, n, yp = ctypes.c_void_p(packed.data_ptr()), ctypes.c_int64(out_features), ctypes.c_void_p(y.data_ptr())
    rc = lib().bn_ternary_linear_multi_f32_layout(
        x2.data_ptr(),
        m,
        k,
        1,
        ctypes.byref(w),
        ctypes.byref(n),
        ctypes.byref(sp),
        ctypes.byref(yp),
        0,
        layout,
    )
    if rc != 0:
        raise RuntimeError(f"bn_ternary_linear_multi_f32_layout failed with code {rc}")
    y = y.reshape(*x.shape[:-1], out_features)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def ternary_linear_multi(
    x: torch.Tensor, packed: list[torch.Tensor], scales: list, out_features: list[int], layout: int = 0
):
    """Several ternary linears of one input (q/k/v or gate/up): one quantization, one thread dispatch.

    Called ~120 times per 2B4T decode step, so the per-call Python work is kept small: the checks and the
    ctypes pointer arrays are made once per group of weights (`_plan`), outputs share one buffer.
    """
    k = x.shape[-1]
    plan = _plan(packed, scales, out_features, k, layout)
    x2 = x.reshape(-1, k)  # [M, K]
    if x2.dtype != torch.float32:
        x2 = x2.float()
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m = x2.shape[0]
    lead = x.shape[:-1]
    # separate contiguous outputs, already in their final shape (cheaper than splitting one buffer)
    ys = [torch.empty((*lead, n), dtype=torch.float32) for n in plan.sizes]
    yp = (ctypes.c_void_p * plan.count)(*[y.data_ptr() for y in ys])
    rc = lib().bn_ternary_linear_multi_f32_layout(
        x2.data_ptr(), m, k, plan.count, plan.ptrs, plan.ns, plan.scales, yp, 0, layout
    )
    if rc != 0:
        raise RuntimeError(f"bn_ternary_linear_multi_f32_layout failed with code {rc}")
    if x.dtype != torch.float32:
        return [y.to(x.dtype) for y in ys]
    return ys


class _Plan:
    __slots__ = ("count", "ptrs", "ns", "scales", "sizes")


_plans: dict[tuple, _Plan] = {}


def _plan(packed, scales, out_features, k: int, layout: int) -> _Plan:
    """Checked ctypes arrays of weight/scale pointers for one group of layers, cached by their addresses.
    Scales are passed by pointer and read at call time, so a cached plan never holds a stale scale value."""
    key = (k, layout, *(p.data_ptr() for p in packed), *(s.data_ptr() for s in scales), *out_features)
    plan = _plans.get(key)
    if plan is not None:
        return plan
    count = len(packed)
    if not 1 <= count <= 8 or len(scales) != count or len(out_features) != count:
        raise ValueError(f"ternary_linear_multi: 1..8 matrices with one scale and size each, got {count}")
    for p, n in zip(packed, out_features):
        _check_packed(p, n, k, "cpu ternary_linear_multi", layout)
    for sc in scales:
        if not (isinstance(sc, torch.Tensor) and sc.dtype == torch.float32 and sc.device.type == "cpu"):
            raise TypeError(
                f"ternary_linear_multi: scales must be float32 CPU tensors, found {type(sc).__name__}"
            )
    plan = _Plan()
    plan.count = count
    plan.ptrs = (ctypes.c_void_p * count)(*[p.data_ptr() for p in packed])
    plan.ns = (ctypes.c_int64 * count)(*[int(n) for n in out_features])
    plan.scales = (ctypes.c_void_p * count)(*[sc.data_ptr() for sc in scales])
    plan.sizes = [int(n) for n in out_features]
    if len(_plans) > 4096:
        _plans.clear()
    _plans[key] = plan
    return plan


def ternary_matmul_i32(
    xq: torch.Tensor, packed: torch.Tensor, out_features: int, layout: int = 0
) -> torch.Tensor:
    """Exact int32 product X @ T^T for any int8 X [..., K] (the oracle is quant.ternary.int_matmul)."""
    if xq.dtype != torch.int8:
        raise TypeError(f"ternary_matmul_i32: activations must be int8, found {xq.dtype}")
    k = xq.shape[-1]
    _check_packed(packed, out_features, k, "cpu ternary_matmul_i32", layout)
    x2 = xq.reshape(-1, k).contiguous()  # [M, K]
    out = torch.empty((x2.shape[0], out_features), dtype=torch.int32)
    rc = lib().bn_ternary_matmul_i32_layout(
        x2.data_ptr(), x2.shape[0], k, packed.data_ptr(), out_features, out.data_ptr(), layout
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


def gemm_float(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 x [..., K] @ W[N, K]^T in float32 for a bf16 or float32 W (a float LM head). Every row of x is summed
    in one fixed order whatever the number of rows, so its logits do not depend on the other rows (torch's float
    GEMM picks its kernel, and with it the summation order, by the row count)."""
    fns = {torch.bfloat16: "bn_gemm_bf16", torch.float32: "bn_gemm_f32"}
    if w.dtype not in fns or w.dim() != 2 or not w.is_contiguous():
        raise ValueError(
            f"gemm_float: weight must be contiguous bf16 or float32 [N, K], found {w.dtype} {list(w.shape)}"
        )
    k = x.shape[-1]
    if w.shape[1] != k:
        raise ValueError(f"gemm_float: x has K={k}, weight has K={w.shape[1]}")
    x2 = _as_f32_2d(x)
    y = torch.empty((x2.shape[0], w.shape[0]), dtype=torch.float32)
    getattr(lib(), fns[w.dtype])(x2.data_ptr(), x2.shape[0], k, w.data_ptr(), w.shape[0], y.data_ptr())
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
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out_features: int, layout: int = 0
) -> torch.Tensor:
    return ternary_linear(x, packed, scale, out_features, layout)


@cpu_ternary_linear.register_fake
def _(x, packed, scale, out_features, layout=0):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("bitnetlm::cpu_ternary_linear_multi", mutates_args=())
def cpu_ternary_linear_multi(
    x: torch.Tensor,
    packed: list[torch.Tensor],
    scales: list[torch.Tensor],
    out_features: list[int],
    layout: int = 0,
) -> list[torch.Tensor]:
    return ternary_linear_multi(x, packed, scales, out_features, layout)


@cpu_ternary_linear_multi.register_fake
def _(x, packed, scales, out_features, layout=0):
    return [x.new_empty((*x.shape[:-1], n)) for n in out_features]


@torch.library.custom_op("bitnetlm::cpu_ternary_matmul_i32", mutates_args=())
def cpu_ternary_matmul_i32(
    xq: torch.Tensor, packed: torch.Tensor, out_features: int, layout: int = 0
) -> torch.Tensor:
    return ternary_matmul_i32(xq, packed, out_features, layout)


@cpu_ternary_matmul_i32.register_fake
def _(xq, packed, out_features, layout=0):
    return xq.new_empty((*xq.shape[:-1], out_features), dtype=torch.int32)


@torch.library.custom_op("bitnetlm::cpu_gemm_float", mutates_args=())
def cpu_gemm_float(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return gemm_float(x, w)


@cpu_gemm_float.register_fake
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


def linear(x, packed, scale, out_features, layout: int = 0):
    if _compiling():
        return cpu_ternary_linear(x, packed, scale, out_features, layout)
    return ternary_linear(x, packed, scale, out_features, layout)


def linear_multi(x, packed, scales, out_features, layout: int = 0):
    if _compiling():
        return cpu_ternary_linear_multi(x, list(packed), list(scales), list(out_features), layout)
    return ternary_linear_multi(x, packed, scales, out_features, layout)


def head_float(x, w):
    return cpu_gemm_float(x, w) if _compiling() else gemm_float(x, w)


def head_i8(x, w, wscale):
    return cpu_gemm_i8row(x, w, wscale) if _compiling() else gemm_i8row(x, w, wscale)
