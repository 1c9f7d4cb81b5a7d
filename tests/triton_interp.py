"""The Triton modules for a test file: compiled on a CUDA machine, else under Triton's interpreter.

Without CUDA, TRITON_INTERPRET=1 is set before the kernel modules are imported (the CI path: small ragged shapes
on CPU tensors); kernel modules imported earlier without it hold compiled-only kernels and are imported again.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def triton_modules(*names: str):
    """bitnetlm.kernels.triton.<name> for each name, in order."""
    if not CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
        common = sys.modules.get("bitnetlm.kernels.triton.common")
        if common is None or not common.INTERPRET:
            for name in [m for m in sys.modules if m.startswith("bitnetlm.kernels.triton")]:
                del sys.modules[name]
    return [importlib.import_module(f"bitnetlm.kernels.triton.{n}") for n in names]
