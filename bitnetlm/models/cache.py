"""Static (preallocated) KV cache: fixed shapes so decode steps can be compiled and graph-captured."""

from __future__ import annotations

import torch


def parse_kv_cache_dtype(name: str | None) -> torch.dtype | None:
    """A --kv-cache-dtype value -> a model's `kv_cache_dtype`: None (auto: the activations' dtype), bfloat16 or
    float8_e4m3fn."""
    if name in (None, "", "auto"):
        return None
    if name in ("bf16", "bfloat16"):
        return torch.bfloat16
    if name in ("fp8", "fp8_e4m3", "float8_e4m3fn"):
        return torch.float8_e4m3fn
    raise ValueError(f"--kv-cache-dtype {name!r}: expected auto, bf16 or fp8")


class KVCache:
    """k[layer], v[layer]: [B, H_kv, S, D]; valid: [B, S] bool (slot holds a real, attendable token)."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        device=None,
        dtype=torch.float32,
    ):
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.valid = torch.zeros(batch_size, max_seq_len, dtype=torch.bool, device=device)

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.valid.shape[1]

    def reset(self, rows=None) -> None:
        """Forget everything (or only the batch rows in `rows`); stale k/v are masked out by `valid`."""
        if rows is None:
            self.valid.zero_()
        else:
            self.valid[rows] = False

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
