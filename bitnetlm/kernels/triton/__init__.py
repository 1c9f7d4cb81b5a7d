"""Triton (CUDA) kernel backend: W2A8 GEMV/GEMM over PackingFormat.TRITON_2BIT, exposed as `BACKEND`.

Importing this module imports Triton (never done by `import bitnetlm`). Under TRITON_INTERPRET=1 the kernels
run on CPU tensors through Triton's interpreter (tests); otherwise they need CUDA tensors.
"""

from __future__ import annotations

import torch

from bitnetlm.kernels.triton.common import INTERPRET
from bitnetlm.kernels.triton.layout import pack_triton, packed_row_bytes, unpack_triton
from bitnetlm.quant.packing import PackingFormat


class TritonBackend:
    name = "triton"
    layout = PackingFormat.TRITON_2BIT

    def is_available(self, device: torch.device | str) -> bool:
        dev = torch.device(device)
        if INTERPRET:
            return True
        return dev.type == "cuda" and torch.cuda.is_available()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        return pack_triton(t)

    def unpack(self, p: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        return unpack_triton(p, tuple(shape))

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out_features: int
    ) -> torch.Tensor:
        from bitnetlm.kernels.triton import ops

        return ops.ternary_linear(x, packed, scale, out_features)


BACKEND = TritonBackend()

__all__ = ["BACKEND", "INTERPRET", "TritonBackend", "pack_triton", "packed_row_bytes", "unpack_triton"]
