"""Static (preallocated) KV cache: fixed shapes so decode steps can be compiled and graph-captured.

A full-attention layer keeps a row's position p at slot p. A sliding-window layer (a query at p sees positions
p-W+1..p) keeps only a ring of `Ring.size` slots, position p at slot p % size, so a row's memory grows with its
global layers alone. The ring holds `RING_SLACK` slots beyond the window: a row may write up to `Ring.slack`
positions past the one it rolls back to (a rejected speculative draft) and still hold the window it continues
from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

RING_SLACK = 16  # ring slots beyond the window: the longest speculative rollback, the longest fast-path chunk


@dataclass(frozen=True)
class Ring:
    """The sliding layers' rings: `window` positions seen, `size` slots held."""

    window: int
    size: int

    @property
    def slack(self) -> int:
        """How far a row may write past position n and still continue at n (rollback), and the longest chunk
        that is written before it is attended to."""
        return self.size - self.window + 1

    def shift_drop(self, n: int, keep: int, drop: int) -> int:
        """A context shift's drop (of n positions, the first `keep` kept) that leaves the ring holding the window
        it continues from: `drop`, or the slack where that window would reach kept positions already
        overwritten."""
        if drop <= self.slack or n <= self.size or keep <= n - drop - self.window + 1:
            return drop
        return self.slack

    def keeps(self, written: int, n: int) -> bool:
        """Whether a row that has had positions up to `written` - 1 written still holds what continuing at
        position n needs: the positions max(0, n-W+1)..n-1 (slots are overwritten from `written` - size down)."""
        return written - self.size <= max(0, n - self.window + 1)


class KVCache:
    """k[layer], v[layer]: [B, H_kv, S, D] (a ring layer: [B, H_kv, ring.size, D]); valid: [B, S] bool (a full
    layer's slot holds a real, attendable token); ring_pos: [B, ring.size] the position in each ring slot (-1:
    none). window / sliding: the sliding layers' window and which layers slide; rings=False (or a context no
    longer than a ring) keeps every layer whole, the window then masked by slot (a temporary cache of prompts)."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        device=None,
        dtype=torch.float32,
        window: int | None = None,
        sliding: Sequence[bool] | None = None,
        rings: bool = True,
    ):
        size = (window or 0) + RING_SLACK
        ringed = rings and window is not None and sliding is not None and any(sliding) and size < max_seq_len
        self.ring = Ring(window, size) if ringed else None
        self.rings = tuple(bool(s) for s in sliding) if ringed else (False,) * num_layers
        self.k, self.v = [], []
        for on_ring in self.rings:
            shape = (batch_size, num_kv_heads, size if on_ring else max_seq_len, head_dim)
            self.k.append(torch.zeros(shape, device=device, dtype=dtype))
            self.v.append(torch.zeros(shape, device=device, dtype=dtype))
        self.valid = torch.zeros(batch_size, max_seq_len, dtype=torch.bool, device=device)
        n = size if ringed else 0
        self.ring_pos = torch.full((batch_size, n), -1, dtype=torch.long, device=device)

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.valid.shape[1]

    def view(self, lo: int, hi: int) -> KVCache:
        """Rows [lo, hi): slices share storage, so writes land in this cache."""
        v = object.__new__(KVCache)
        v.ring, v.rings = self.ring, self.rings
        v.k, v.v = [t[lo:hi] for t in self.k], [t[lo:hi] for t in self.v]
        v.valid, v.ring_pos = self.valid[lo:hi], self.ring_pos[lo:hi]
        return v

    def reset(self, rows=None) -> None:
        """Forget everything (or only the batch rows in `rows`); stale k/v are masked out by `valid`."""
        if rows is None:
            self.valid.zero_()
            self.ring_pos.fill_(-1)
        else:
            self.valid[rows] = False
            self.ring_pos[rows] = -1

    def forget(self, row: int, n: int) -> None:
        """Row `row`'s positions from n on become invisible (a rollback, or a new sequence keeping n)."""
        self.valid[row, n:] = False
        held = self.ring_pos[row]
        held.masked_fill_(held >= n, -1)

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

    def mark_ring(self, cache_pos: torch.Tensor, input_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The ring layers' mask [B, 1, T, K] for a forward writing positions `cache_pos` [B, T] (consecutive in
        each row), whose writes it records: key at position k is visible to the query at q if q-W < k <= q
        (a padding query sees itself). K: the ring; a chunk longer than the slack attends to the ring as it was
        and then the chunk (`store`), as its own writes would overwrite keys its first queries need."""
        r, (b, t) = self.ring, cache_pos.shape
        real = torch.ones_like(cache_pos, dtype=torch.bool) if input_mask is None else input_mask
        before = self.ring_pos.clone() if t > r.slack else None
        keep = slice(max(0, t - r.size), t)  # (the chunk's last `size` positions: distinct slots)
        self.ring_pos.scatter_(
            1, cache_pos[:, keep] % r.size, torch.where(real[:, keep], cache_pos[:, keep], -1)
        )
        if before is None:
            keys, me = self.ring_pos, cache_pos % r.size
        else:  # (positions at or after the chunk's start are the chunk's own, whatever a slot held before)
            old = torch.where(before < cache_pos[:, :1], before, -1)
            keys = torch.cat([old, torch.where(real, cache_pos, -1)], 1)
            me = (r.size + torch.arange(t, device=cache_pos.device)).expand(b, t)
        k, q = keys[:, None, :], cache_pos[:, :, None]
        mask = (k >= 0) & (k <= q) & (k > q - r.window)
        mask |= torch.arange(keys.shape[1], device=keys.device)[None, None, :] == me[:, :, None]
        return mask[:, None]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, cache_pos: torch.Tensor):
        """Write a layer's new k, v [B, H_kv, T, D] at positions `cache_pos` [B, T] -> the keys and values its
        queries attend to (the masks' key axis: `attention_mask`, or `mark_ring`'s for a ring layer)."""
        ck, cv = self.k[layer], self.v[layer]
        if not self.rings[layer]:
            _scatter(ck, cache_pos, k)
            _scatter(cv, cache_pos, v)
            return ck, cv
        r, t = self.ring, k.shape[2]
        out = None
        if t > r.slack:  # the ring as it was, then the chunk (rounded through the cache's dtype as if stored)
            out = tuple(
                torch.cat([c.to(x.dtype), x.to(c.dtype).to(x.dtype)], 2) for c, x in ((ck, k), (cv, v))
            )
        keep = slice(max(0, t - r.size), t)
        _scatter(ck, cache_pos[:, keep] % r.size, k[:, :, keep])
        _scatter(cv, cache_pos[:, keep] % r.size, v[:, :, keep])
        return out or (ck, cv)

    def extent(self, layer: int, top: int, t: int) -> int:
        """How many leading keys of `store`'s result queries at positions up to `top` (a chunk of t) may see."""
        if not self.rings[layer]:
            return top + 1
        return self.ring.size + t if t > self.ring.slack else min(self.ring.size, top + 1)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Row `dst` gets row `src`'s first n positions (a ring: those of them it still holds)."""
        for on_ring, k, v in zip(self.rings, self.k, self.v, strict=True):
            cut = slice(None) if on_ring else slice(0, n)
            k[dst, :, cut] = k[src, :, cut]
            v[dst, :, cut] = v[src, :, cut]
        self.valid[dst] = False
        self.valid[dst, :n] = self.valid[src, :n]
        if self.ring is not None:
            held = self.ring_pos[src]
            self.ring_pos[dst] = torch.where(held < n, held, -1)

    def load_row(self, row: int, src: KVCache, src_row: int, start: int, n: int) -> None:
        """Row `row` gets positions 0..n-1 from `src` (a cache without rings), which holds them at its slots
        start..start+n-1 of `src_row`."""
        p = torch.arange(max(0, n - self.ring.size) if self.ring else 0, n, device=self.valid.device)
        for on_ring, k, v, sk, sv in zip(self.rings, self.k, self.v, src.k, src.v, strict=True):
            if on_ring:
                k[row, :, p % self.ring.size] = sk[src_row, :, start + p]
                v[row, :, p % self.ring.size] = sv[src_row, :, start + p]
            else:
                k[row, :, :n] = sk[src_row, :, start : start + n]
                v[row, :, :n] = sv[src_row, :, start : start + n]
        self.valid[row] = False
        self.valid[row, :n] = src.valid[src_row, start : start + n]
        if self.ring is not None:
            self.ring_pos[row] = -1
            self.ring_pos[row, p % self.ring.size] = torch.where(src.valid[src_row, start + p], p, -1)

    def shift(self, row: int, n: int, keep: int, drop: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Context shift of `row`, which holds n positions (see `shift_rows`); the freed slots become invalid."""
        full = [i for i, on_ring in enumerate(self.rings) if not on_ring]
        shift_rows([self.k[i] for i in full], [self.v[i] for i in full], row, n, keep, drop, cos, sin)
        self.valid[row, n - drop :] = False
        if self.ring is not None:
            self._shift_ring(row, n, keep, drop, cos, sin)

    def _shift_ring(
        self, row: int, n: int, keep: int, drop: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """The shift on the rings: new position p takes old position p (p < keep) or p + drop, rotated back."""
        r, m = self.ring, n - drop
        dst = torch.arange(max(0, m - r.size), m, device=self.ring_pos.device)
        src = torch.where(dst < keep, dst, dst + drop)
        held = self.ring_pos[row, src % r.size] == src
        if bool((~held & (dst > m - r.window)).any()):
            raise ValueError(
                f"context shift: dropping {drop} positions after the first {keep} of {n} needs kept positions "
                f"that the sliding layers' rings no longer hold (drop at most {r.slack})"
            )
        moved = (dst >= keep)[:, None]
        c, s = cos.float(), sin.float()
        for on_ring, k, v in zip(self.rings, self.k, self.v, strict=True):
            if on_ring:
                x = k[row, :, src % r.size].float()  # (a copy: the slots it came from may be written below)
                x1, x2 = x.chunk(2, dim=-1)
                turned = torch.cat((x1 * c + x2 * s, x2 * c - x1 * s), dim=-1)
                k[row, :, dst % r.size] = torch.where(moved, turned, x).to(k.dtype)
                v[row, :, dst % r.size] = v[row, :, src % r.size]
        self.ring_pos[row] = -1
        self.ring_pos[row, dst % r.size] = torch.where(held, dst, -1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def _scatter(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """cache[b, :, slots[b, t]] = x[b, :, t] (cache [B, H, S, D], slots [B, T], x [B, H, T, D])."""
    idx = slots[:, None, :, None].expand(x.shape[0], x.shape[1], slots.shape[1], x.shape[3])
    if cache.element_size() == 1:  # float8: no scatter kernel for it, so scatter its bytes
        cache.view(torch.uint8).scatter_(2, idx, x.to(cache.dtype).view(torch.uint8))
    else:
        cache.scatter_(2, idx, x.to(cache.dtype))


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
