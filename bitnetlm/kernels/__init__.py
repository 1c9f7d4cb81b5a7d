"""Kernel dispatch: the one place that knows which implementation computes a ternary linear.

Backends (in order of preference for a device):
  cuda -> "triton" (bitnetlm.kernels.triton, issue: GPU inference) -> "reference"
  cpu  -> "cpu" (C extension, bitnetlm.kernels.cpu, issue: CPU inference) -> "reference"
A backend is an object with: `name`, `layout` (a PackingFormat), `is_available(device) -> bool`,
`pack(t_int8[N, K]) -> Tensor`, `unpack(p, (N, K)) -> int8 tensor`, and
`linear(x[..., K], packed, scale, out_features) -> y[..., N]` computing (X @ T^T) * s / a with the
per-token int8 activation quantization of quant.ternary (integer part exact).

Backends are imported lazily so `import bitnetlm` never imports Triton or initialises CUDA.
Force one with the environment variable BITNETLM_BACKEND=reference|cpu|triton.
A backend may also have `warm_up()`: its one-time host work before the first launch, which the CUDA runtime runs
in a thread beside the weight load.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from typing import Any

import torch

# name -> "module:attribute" of the backend object; modules are imported on first use.
_BACKEND_SPECS: dict[str, str] = {
    "reference": "bitnetlm.kernels.reference:BACKEND",
    "cpu": "bitnetlm.kernels.cpu:BACKEND",
    "triton": "bitnetlm.kernels.triton:BACKEND",
}
_PREFERENCE = {"cuda": ["triton", "reference"], "cpu": ["cpu", "reference"]}
_loaded: dict[str, Any] = {}
_failed: dict[str, str] = {}


def get_backend(name: str) -> Any:
    """The backend object called `name`; raises ValueError if it is unknown or cannot be imported."""
    if name in _loaded:
        return _loaded[name]
    if name not in _BACKEND_SPECS:
        raise ValueError(f"unknown kernel backend {name!r}; known: {sorted(_BACKEND_SPECS)}")
    mod_name, attr = _BACKEND_SPECS[name].split(":")
    try:
        backend = getattr(importlib.import_module(mod_name), attr)
    except Exception as e:  # a missing compiler, extension or Triton makes a backend unavailable
        _failed[name] = f"{type(e).__name__}: {e}"
        raise ValueError(f"kernel backend {name!r} is not available here ({_failed[name]})") from e
    _loaded[name] = backend
    return backend


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Names of the backends that can run on `device`, best first."""
    dev = torch.device(device)
    out = []
    for name in _PREFERENCE.get(dev.type, ["reference"]):
        try:
            if get_backend(name).is_available(dev):
                out.append(name)
        except ValueError:
            continue
    return out


def select_backend(device: torch.device | str = "cpu", name: str | None = None) -> Any:
    """The backend to use on `device`: `name`, else $BITNETLM_BACKEND, else the best available."""
    name = name or os.environ.get("BITNETLM_BACKEND") or None
    dev = torch.device(device)
    if name:
        backend = get_backend(name)
        if not backend.is_available(dev):
            raise ValueError(f"kernel backend {name!r} cannot run on device {dev}")
        return backend
    names = available_backends(dev)
    return get_backend(names[0] if names else "reference")


def backend_for_layout(layout) -> Any:
    """The backend that owns packing layout `layout` (a PackingFormat)."""
    from bitnetlm.quant.packing import PackingFormat

    layout = PackingFormat(layout)
    for name in _BACKEND_SPECS:
        try:
            b = get_backend(name)
        except ValueError:
            continue
        if PackingFormat(b.layout) is layout:
            return b
    raise ValueError(f"no available kernel backend computes with layout {layout.value!r}")


def prepare(model: torch.nn.Module, device: torch.device | str | None = None, backend: str | None = None):
    """Move `model` to `device` and give every inference-mode BitLinear the chosen backend's kernels (repacked
    once into that backend's layout)."""
    from bitnetlm.quant.bitlinear import BitLinear

    if device is not None:
        model.to(device)
    for m in model.modules():
        if isinstance(m, BitLinear) and not m.training_mode:
            m.use_kernel(select_backend(m.packed.device, backend))
    return model


def uses_c_kernels(model: torch.nn.Module) -> bool:
    """Whether `model`'s ternary layers run on the C kernels (inference mode, CPU backend)."""
    from bitnetlm.quant.bitlinear import BitLinear

    return any(
        isinstance(m, BitLinear) and not m.training_mode and getattr(m.kernel, "name", None) == "cpu"
        for m in model.modules()
    )


@contextlib.contextmanager
def torch_threads_beside_c(model: torch.nn.Module):
    """Inside: torch's own ops on one thread while `model`'s C kernels run on their pool (as `configure_threads`
    sets for good); the previous count is restored on exit. libgomp's workers spin for milliseconds after each
    parallel torch op and take the cores from the kernel threads (2-core EPYC, 2B4T: 11% more decode tokens/s
    with it in `generate`, 2026-11-28; benchmarks/cpu.py --tables generate)."""
    n = torch.get_num_threads()
    if n == 1 or not uses_c_kernels(model):
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def configure_threads(model: torch.nn.Module, threads: int | None = None) -> None:
    """Thread settings for CPU inference of `model`.

    With the C backend the kernels run on their own pool (`threads`, default physical cores) and torch's
    small ops run single-threaded beside them: two pools on the same cores slow a decode step down ~1.7x
    (benchmarks/cpu_profile.py). Otherwise `threads` is torch's thread count.
    """
    if uses_c_kernels(model):
        from bitnetlm.kernels import cpu

        cpu.set_num_threads(threads)
        torch.set_num_threads(1)
    elif threads:
        torch.set_num_threads(int(threads))
