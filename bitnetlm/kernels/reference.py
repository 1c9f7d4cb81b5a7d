"""Pure-torch reference backend: runs anywhere, defines the semantics every fast backend must match."""

from __future__ import annotations

import torch

from bitnetlm.quant.packing import PackingFormat, pack_hf, unpack_hf
from bitnetlm.quant.ternary import int_matmul_f32, quantize_activations


class ReferenceBackend:
    name = "reference"
    layout = PackingFormat.HF_2BIT  # keeps the checkpoint layout: 2 bits/weight resident, unpacked per call

    def is_available(self, device: torch.device) -> bool:
        return True

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        return pack_hf(t)

    def unpack(self, p: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        return unpack_hf(p, shape[0])

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out_features: int
    ) -> torch.Tensor:
        t = unpack_hf(packed, out_features)
        xq, a = quantize_activations(x)
        y = int_matmul_f32(xq, t) * (scale.float() / a)
        return y.to(x.dtype)


BACKEND = ReferenceBackend()
