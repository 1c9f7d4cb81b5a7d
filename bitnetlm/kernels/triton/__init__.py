"""Triton (CUDA) kernel backend: W2A8 GEMV/GEMM over PackingFormat.TRITON_2BIT, exposed as `BACKEND`.

Importing this module imports Triton (never done by `import bitnetlm`). Under TRITON_INTERPRET=1 the kernels
run on CPU tensors through Triton's interpreter (tests); otherwise they need CUDA tensors.
"""

from __future__ import annotations

import torch

from bitnetlm.kernels.triton.common import INTERPRET
from bitnetlm.kernels.triton.layout import pack_triton, packed_row_bytes, repack_hf, unpack_triton
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

    def repack(self, p: torch.Tensor, layout, shape: tuple[int, int]) -> torch.Tensor | None:
        """Direct HF 2-bit -> triton-2bit-v1 at load (None for other layouts: unpack + pack)."""
        if PackingFormat(layout) is not PackingFormat.HF_2BIT:
            return None
        return repack_hf(p, tuple(shape))

    def warm_up(self) -> None:
        """The first launch's one-time host work, done ahead (`kernels.warm_up_async` runs it in a thread beside
        the weight load): Triton's compiler key (a hash of its ~400 MB library that every process computes before
        its first launch, even when every kernel comes from the on-disk cache), the modules the first launch
        imports, Triton's CUDA helper module, and our launchers and kernels. No GPU work."""
        if INTERPRET:
            return
        from triton.runtime.cache import triton_key
        from triton.runtime.driver import driver

        triton_key()  # file reads and sha256 run without the GIL: this overlaps the load fully
        try:  # imported by the argument specialisation of the first launch (Triton 3.6)
            import triton.experimental.gluon.nvidia.hopper  # noqa: F401
        except ImportError:
            pass
        driver.active.utils  # noqa: B018 - builds or loads the cached helper module
        from bitnetlm.kernels.triton import attention, launch  # noqa: F401

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out_features: int
    ) -> torch.Tensor:
        from bitnetlm.kernels.triton import ops

        return ops.ternary_linear(x, packed, scale, out_features)


BACKEND = TritonBackend()

__all__ = ["BACKEND", "INTERPRET", "TritonBackend", "pack_triton", "packed_row_bytes", "unpack_triton"]
