"""The rows of a paged KV cache: which blocks hold each row's positions, shared with other rows or the prefix cache,
and the block table the kernels read. The CPU's paged runner (`paged.py`) and the CUDA one (`cuda/paged_runner.py`)
are this bookkeeping over their own pools and forwards.

Each layer's keys and values live in pools [blocks, H_kv, block_size, D] (`k`, `v`); a row's block table lists the
blocks holding its positions in order, and its entries past them name `no_block`. Blocks are taken as a row's
tokens arrive and given back when it forgets them, so memory follows the tokens held, not max_seq_len per row.
Prompt prefixes are shared, not copied: a full block that a prompt's prefill wrote is cached (`BlockPool`) and a
later prompt that starts with the same tokens maps it into its own table (`adopt`); a choice of the same request
shares its sibling's blocks (`copy_prefix`). A row writes a shared block only after copying it (copy on write), and
a cached one only after uncaching it, so what another row or a later prompt reads never changes under it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bitnetlm.models.cache import shift_rows
from bitnetlm.runtime.blocks import BlockPool, OutOfBlocks


def gather_blocks(pool: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """Positions 0..n-1 of the rows whose block tables are `table` [B, blocks a row] (on the pool's device), as a
    contiguous [B, H_kv, n, D] copy of `pool` [blocks, H_kv, block_size, D]."""
    nb = -(-n // pool.shape[2])
    x = pool[table[:, :nb].long()]  # [B, nb, H_kv, bs, D]
    b, hkv, d = table.shape[0], pool.shape[1], pool.shape[3]
    return x.permute(0, 2, 1, 3, 4).reshape(b, hkv, -1, d)[:, :, :n]


class PagedRows:
    """The block bookkeeping of a paged runner (see the module docstring). A runner sets `k`, `v` (the per-layer
    pools), `valid` (a [rows, positions] mask of written positions, or None) and calls `_init_rows` first."""

    paged = True
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    valid: torch.Tensor | None = None
    zero_new_blocks = (
        True  # (a reader of the CPU's pools weighs unwritten slots between valid ones by 0: no NaN)
    )

    def _init_rows(self, rows: int, max_seq_len: int, num_blocks: int, block_size: int, no_block: int = 0):
        self.max_blocks = -(-max_seq_len // block_size)
        self.pool = BlockPool(num_blocks, block_size)
        self.no_block = no_block
        self.table = torch.full((rows, self.max_blocks), no_block, dtype=torch.int32)
        self.blocks: list[list[int]] = [[] for _ in range(rows)]
        self.tokens: list[list[int]] = [[] for _ in range(rows)]  # the token at each position a row holds
        # positions 0..n-1 were all written by prefills (their full blocks may be cached)
        self.prefilled = [0] * rows
        self.lengths = [0] * rows

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def usage(self) -> float:
        """Blocks referenced by a row over all blocks (0-1)."""
        return self.pool.in_use() / self.pool.num_blocks

    # ---- blocks ---------------------------------------------------------------------------------------
    def _set_table(self, row: int) -> None:
        have = self.blocks[row]
        self.table[row] = self.no_block
        if have:
            self.table[row, : len(have)] = torch.tensor(have, dtype=torch.int32)

    def step_table(self, idle=()) -> torch.Tensor:
        """The block tables a forward reads, with rows `idle` (holding no sequence in it) all `no_block`."""
        if not idle:
            return self.table
        out = self.table.clone()
        out[list(idle)] = self.no_block
        return out

    def _need(self, row: int, start: int, end: int) -> int:
        """New blocks a write of positions [start, end) into `row` takes (appended, or copies of shared ones)."""
        have, bs = self.blocks[row], self.pool.block_size
        shared = sum(self.pool.refs[b] > 1 for b in have[start // bs : -(-end // bs)])
        return max(0, self.pool.blocks_for(end) - len(have)) + shared

    def _reserve(self, writes: list[tuple[int, int, int]]) -> None:
        """Make positions [start, end) of each (row, start, end) writable, or raise OutOfBlocks changing nothing."""
        need = sum(self._need(*w) for w in writes)
        if need > self.pool.available():
            raise OutOfBlocks(
                f"KV cache: this step needs {need} more blocks of {self.pool.block_size} positions, "
                f"{self.pool.available()} of {self.pool.num_blocks} are free (raise --kv-tokens)"
            )
        for row, start, end in writes:
            self._writable(row, start, end)

    def _writable(self, row: int, start: int, end: int) -> None:
        have, pool, bs = self.blocks[row], self.pool, self.pool.block_size
        changed = False
        for i in range(start // bs, min(len(have), -(-end // bs))):
            b = have[i]
            if pool.refs[b] > 1:  # copy on write: the other rows keep the block as it is
                new = pool.allocate()
                for t in self.k + self.v:
                    t[new] = t[b]
                pool.decref(b)
                have[i], changed = new, True
            elif pool.cached(b):
                pool.uncache(b)
        while len(have) < pool.blocks_for(end):
            new = pool.allocate()
            if self.zero_new_blocks:
                for t in self.k + self.v:
                    t[new].zero_()
            have.append(new)
            changed = True
        if changed:
            self._set_table(row)

    def _drop_from(self, row: int, n: int) -> None:
        """`row` forgets positions n.. (the blocks wholly past them go back to the pool)."""
        keep = self.pool.blocks_for(n)
        for b in self.blocks[row][keep:]:
            self.pool.decref(b)
        if len(self.blocks[row]) > keep:
            del self.blocks[row][keep:]
            self._set_table(row)
        del self.tokens[row][n:]
        if self.valid is not None:
            self.valid[row, n:] = False
        self.lengths[row] = min(self.lengths[row], n)
        self.prefilled[row] = min(self.prefilled[row], n)

    def _written(self, row: int, start: int, tokens: Sequence[int], prefill: bool, mark: bool = True) -> None:
        """`tokens` are at positions start.. of `row` (marked valid unless the caller marks them)."""
        t = self.tokens[row]
        del t[start:]
        t += list(tokens)
        end = start + len(tokens)
        if mark and self.valid is not None:
            self.valid[row, start:end] = True
        self.lengths[row] = end
        if prefill and self.prefilled[row] == start:
            self.prefilled[row] = end
        else:
            self.prefilled[row] = min(self.prefilled[row], start)

    def _cache_blocks(self, row: int) -> None:
        """Offer the row's full blocks of prefilled prompt positions (written) to the prefix cache."""
        bs, have = self.pool.block_size, self.blocks[row]
        for i in range(self.prefilled[row] // bs):
            if not self.pool.cached(have[i]):
                self.pool.cache(have[i], have[i - 1] if i else None, self.tokens[row][i * bs : (i + 1) * bs])

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        """Leading positions of `tokens` whose keys and values the prefix cache holds (whole blocks)."""
        return len(self.pool.match(tokens, count=False)) * self.pool.block_size

    def admission_cost(self, tokens: Sequence[int]) -> int:
        """Blocks that a new row prefilled with `tokens`, then decoding one token, takes from the available ones:
        all it fills but the cached leading blocks that a row already references (shared for free)."""
        shared = sum(self.pool.refs[b] > 0 for b in self.pool.match(tokens[:-1], count=False))
        return self.pool.blocks_for(len(tokens) + 1) - shared

    def adopt(self, row: int, tokens: Sequence[int]) -> int:
        """Empty `row` maps the cached blocks of `tokens`' leading full blocks into its table (shared, not
        copied); returns the positions it now holds."""
        if self.blocks[row]:
            raise ValueError(f"row {row}: adopt into a row that holds {self.lengths[row]} positions")
        got = self.pool.match(tokens)
        for b in got:
            self.pool.incref(b)
        self.blocks[row] = list(got)
        n = len(got) * self.pool.block_size
        self._set_table(row)
        self.tokens[row] = list(tokens[:n])
        if self.valid is not None:
            self.valid[row, :n] = True
        self.lengths[row] = self.prefilled[row] = n
        return n

    # ---- whole rows ---------------------------------------------------------------------------------------
    def _store(self, row: int, ks: list[torch.Tensor], vs: list[torch.Tensor], start: int = 0) -> None:
        """Per-layer keys / values [H_kv, n, D] into `row`'s (writable) blocks at positions start.."""
        n, bs = ks[0].shape[1], self.pool.block_size
        p = start
        while p < start + n:
            b, o = self.blocks[row][p // bs], p % bs
            e = min(start + n, (p // bs + 1) * bs)
            for pool, src in zip(self.k + self.v, ks + vs, strict=True):
                pool[b, :, o : o + e - p] = src[:, p - start : e - start]
            p = e

    def _gather(self, row: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer keys / values of `row`'s positions 0..n-1 as [1, H_kv, n, D] copies."""
        tab = torch.tensor([self.blocks[row][: self.pool.blocks_for(n)]], device=self.k[0].device)
        return [gather_blocks(t, tab, n) for t in self.k], [gather_blocks(t, tab, n) for t in self.v]

    def _shift_blocks(self, row: int, keep: int, drop: int, inv_freq: torch.Tensor) -> None:
        """`Runner.shift` over the blocks: positions keep + drop.. move down by drop, their keys rotated back."""
        n = self.lengths[row]
        ks, vs = self._gather(row, n)
        angle = drop * inv_freq.float()
        shift_rows(ks, vs, 0, n, keep, drop, angle.cos(), angle.sin())
        self._reserve([(row, keep, n - drop)])
        self._store(row, [k[0, :, keep : n - drop] for k in ks], [v[0, :, keep : n - drop] for v in vs], keep)
        moved = self.tokens[row][keep + drop : n]
        self._drop_from(row, n - drop)
        self.tokens[row][keep:] = moved
        self.prefilled[row] = min(self.prefilled[row], keep)

    def _share_prefix(self, src: int, dst: int, n: int) -> None:
        """dst (emptied) shares src's blocks of positions 0..n-1 (a partly used last block is copied when
        written)."""
        got = self.blocks[src][: self.pool.blocks_for(n)]
        for b in got:
            self.pool.incref(b)
        self.blocks[dst] = list(got)
        self._set_table(dst)
        self.tokens[dst] = self.tokens[src][:n]
        if self.valid is not None:
            self.valid[dst, :n] = self.valid[src, :n]
        self.lengths[dst] = n
        self.prefilled[dst] = min(self.prefilled[src], n)
