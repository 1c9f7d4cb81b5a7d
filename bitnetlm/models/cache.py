"""Static (preallocated) KV cache: fixed shapes so decode steps can be compiled and graph-captured."""

from __future__ import annotations

import torch


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

    def mark(self, cache_pos: torch.Tensor, input_mask: torch.Tensor | None = None) -> None:
        """Slots `cache_pos` [B, T] are about to be written: valid where `input_mask` (None: all) is set."""
        # bounds check only where it costs no device sync (CPU, eager)
        if cache_pos.device.type == "cpu" and not torch.compiler.is_compiling():
            top = int(cache_pos.max())
            if top >= self.max_seq_len:
                raise ValueError(
                    f"KV cache holds {self.max_seq_len} positions; asked to write position {top}"
                )
        real = torch.ones_like(cache_pos, dtype=torch.bool) if input_mask is None else input_mask
        self.valid.scatter_(1, cache_pos, real)

    def attention_mask(self, cache_pos: torch.Tensor) -> torch.Tensor:
        """[B, 1, T, S]: key j is visible to query (b, t) if it holds a real token at or before the query's slot
        (a padding query sees itself)."""
        slots = torch.arange(self.max_seq_len, device=cache_pos.device)
        mask = self.valid[:, None, :] & (slots[None, None, :] <= cache_pos[:, :, None])  # [B, T, S]
        mask = mask | (slots[None, None, :] == cache_pos[:, :, None])
        return mask[:, None]

    def shift(self, row: int, n: int, keep: int, drop: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Context shift of `row`, which holds n positions (see `shift_rows`); the freed slots become invalid."""
        shift_rows(self.k, self.v, row, n, keep, drop, cos, sin)
        self.valid[row, n - drop :] = False

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def shift_rows(ks, vs, row: int, n: int, keep: int, drop: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """llama.cpp's context shift on row `row` of the caches ks, vs (per layer [B, H_kv, S, D], n positions held):
    positions keep..keep+drop-1 go, keep+drop..n-1 move down to keep..n-drop-1. Keys are cached after RoPE
    (rotate-half), so each moved key is rotated back by `drop` positions: cos, sin [D/2] are those of the angles
    drop * inv_freq. (Rotations compose: the result is the key at its new position, up to rounding.)"""
    if drop <= 0 or keep + drop > n:
        raise ValueError(f"context shift: cannot drop {drop} of {n} positions after the first {keep}")
    src, dst = slice(keep + drop, n), slice(keep, n - drop)
    c, s = cos.float(), sin.float()
    for k in ks:
        x = k[row, :, src].float()
        x1, x2 = x.chunk(2, dim=-1)
        k[row, :, dst] = torch.cat((x1 * c + x2 * s, x2 * c - x1 * s), dim=-1).to(k.dtype)
    for v in vs:
        v[row, :, dst] = v[row, :, src].clone()
