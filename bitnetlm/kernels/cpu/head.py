"""Compact embedding + LM head for CPU decode: bf16 (default) or int8 with one float32 scale per row.

In a decode step the tied embedding / LM head of BitNet 2B4T (128256 x 2560) is read once per token:
656 MB in bf16 against 520 MB for all ternary projections, so its storage type sets a large part of the
decode speed. A `CompactHead` keeps one copy of the matrix and computes the logits with the C kernels in
float32 accumulation (a torch fallback runs anywhere else); `CompactEmbedding` looks rows up in the same copy,
so a tied model keeps one matrix for both uses (`bitnetlm.runtime.cpu.set_head_dtype` swaps them in).

int8: q[v, :] = round(w[v, :] * 127 / max|w[v, :]|), scale[v] = max|w[v, :]| / 127 (symmetric, per row);
the activations stay float32 (weights-only quantization).
"""

from __future__ import annotations

import torch
from torch import nn

from bitnetlm.kernels.cpu import arena

HEAD_DTYPES = ("bf16", "int8")


def quantize_rows_int8(w: torch.Tensor, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: (q int8 [V, H], scale float32 [V]) with w ~= q * scale[:, None]."""
    q = arena.empty(w.shape, torch.int8)  # streamed every step: huge pages
    s = torch.empty(w.shape[0], dtype=torch.float32)
    for i in range(0, w.shape[0], chunk):  # chunks: never a float32 copy of the whole matrix
        wf = w[i : i + chunk].float()
        amax = wf.abs().amax(dim=1).clamp(min=1e-12)
        s[i : i + chunk] = amax / 127
        q[i : i + chunk] = (wf * (127 / amax)[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, s


class CompactHead(nn.Module):
    """Embedding lookup and/or LM head over one bf16 or int8 matrix [V, H]."""

    def __init__(self, weight: torch.Tensor, dtype: str):
        super().__init__()
        if dtype not in HEAD_DTYPES:
            raise ValueError(f"head dtype must be one of {HEAD_DTYPES}, got {dtype!r}")
        self.dtype_name = dtype
        w = weight.detach()
        if dtype == "bf16":
            # streamed every step: huge pages; converted in place, no second full-size temporary
            self.register_buffer("weight", arena.place(w, torch.bfloat16))
            self.register_buffer("scale", None)
        else:
            q, s = quantize_rows_int8(w)
            self.register_buffer("weight", q)
            self.register_buffer("scale", s)

    @property
    def num_embeddings(self) -> int:
        return self.weight.shape[0]

    def nbytes(self) -> int:
        n = self.weight.numel() * self.weight.element_size()
        return n + (0 if self.scale is None else self.scale.numel() * 4)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows = self.weight[ids]  # [..., H]
        if self.scale is None:
            return rows.to(dtype)
        return (rows.float() * self.scale[ids][..., None]).to(dtype)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """logits [..., V] in float32 (or h's dtype if that is wider)."""
        if self.weight.device.type == "cpu":
            from bitnetlm.kernels import cpu

            if cpu.available():
                from bitnetlm.kernels.cpu.ops import head_float, head_i8

                if self.scale is None:
                    return head_float(h, self.weight)
                return head_i8(h, self.weight, self.scale)
        if self.scale is None:
            return torch.nn.functional.linear(h.to(torch.bfloat16), self.weight).float()
        return torch.nn.functional.linear(h.float(), self.weight.float()) * self.scale


class CompactEmbedding(nn.Module):
    """The embedding lookup over a CompactHead's matrix (shared with the LM head of a tied model)."""

    def __init__(self, head: CompactHead):
        super().__init__()
        self.head = head

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    @property
    def num_embeddings(self) -> int:
        return self.head.num_embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.embed(ids)
