"""The paged CPU runner: the fused C step over a KV cache of fixed-size blocks shared by every row.

Each layer's keys and values live in a pool [blocks, H_kv, block_size, D] (`RuntimeConfig.kv_tokens` positions);
a row's block table lists the blocks holding its positions in order, and the C step reads and writes through it.
Blocks are taken as a row's tokens arrive and given back when it forgets them, so memory follows the tokens
held, not max_seq_len per row (the pool is allocated untouched: the OS commits its pages as blocks are first
used, lowest ids first). Prompt prefixes are shared, not copied: a full block that a prompt's prefill wrote is
cached (`runtime.blocks.BlockPool`) and a later prompt that starts with the same tokens maps it into its own
table (`adopt`); a choice of the same request shares its sibling's blocks (`copy_prefix`). A row writes a shared
block only after copying it (copy on write), and a cached one only after uncaching it, so what another row or
a later prompt reads never changes under it.

The step's attention reads a row's keys block by block in the same order as from a static row: results equal the
static CPU runner's bit for bit (tests/test_paged.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bitnetlm.kernels.cpu.decode import KV_DTYPES, FusedStep, PagedKV
from bitnetlm.models import KVCache
from bitnetlm.models.cache import shift_rows
from bitnetlm.runtime.blocks import BlockPool, OutOfBlocks
from bitnetlm.runtime.config import RuntimeConfig
from bitnetlm.runtime.cpu import fused_forward, logits
from bitnetlm.runtime.eager import EagerRunner, left_padded


class PagedCpuRunner(EagerRunner):
    """A CPU runner over a paged KV cache (see the module docstring); the sampling is the eager runner's."""

    paged = True

    def __init__(self, model, config: RuntimeConfig, rows: int, max_seq_len: int, step: FusedStep):
        cfg, bs = model.config, config.kv_block_size
        self.model, self.config, self.fused, self.why_not = model, config, step, None
        self.device = torch.device("cpu")
        self.ring = None  # (the fused step runs no sliding-window layers)
        self.rows, self.max_seq_len, self.vocab_size = rows, max_seq_len, cfg.vocab_size
        self.max_blocks = -(-max_seq_len // bs)
        self.pool = BlockPool(max(1, config.kv_tokens // bs), bs)
        shape = (self.pool.num_blocks, cfg.num_key_value_heads, bs, cfg.head_dim)
        dtype = config.kv_dtype(torch.float32)
        self.k = [torch.empty(shape, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.empty(shape, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.valid = torch.zeros(rows, self.max_blocks * bs, dtype=torch.bool)
        self.table = torch.zeros(rows, self.max_blocks, dtype=torch.int32)
        self.blocks: list[list[int]] = [[] for _ in range(rows)]
        self.tokens: list[list[int]] = [[] for _ in range(rows)]  # the token at each position a row holds
        # positions 0..n-1 were all written by prefills (their full blocks may be cached)
        self.prefilled = [0] * rows
        self.lengths = [0] * rows
        self.carry: dict[int, int] = {}
        self._last = None

    # ---- blocks ---------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def usage(self) -> float:
        """Blocks referenced by a row over all blocks (0-1)."""
        return self.pool.in_use() / self.pool.num_blocks

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
            for t in self.k + self.v:  # (an unwritten slot between valid ones is read with weight 0: no NaN)
                t[new].zero_()
            have.append(new)
            changed = True
        if changed:
            self.table[row, : len(have)] = torch.tensor(have, dtype=torch.int32)

    def _drop_from(self, row: int, n: int) -> None:
        """`row` forgets positions n.. (the blocks wholly past them go back to the pool)."""
        keep = self.pool.blocks_for(n)
        for b in self.blocks[row][keep:]:
            self.pool.decref(b)
        del self.blocks[row][keep:]
        del self.tokens[row][n:]
        self.valid[row, n:] = False
        self.lengths[row] = min(self.lengths[row], n)
        self.prefilled[row] = min(self.prefilled[row], n)

    def _written(self, row: int, start: int, tokens: Sequence[int], prefill: bool, mark: bool = True) -> None:
        """`tokens` are at positions start.. of `row` (marked valid unless the caller marks them)."""
        t = self.tokens[row]
        del t[start:]
        t += list(tokens)
        end = start + len(tokens)
        if mark:
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
        if got:
            self.table[row, : len(got)] = torch.tensor(got, dtype=torch.int32)
        self.tokens[row] = list(tokens[:n])
        self.valid[row, :n] = True
        self.lengths[row] = self.prefilled[row] = n
        return n

    # ---- the forward -----------------------------------------------------------------------------------
    def _step(self, rows: list[int], ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """ids, positions [B, T] of `rows` (already writable and marked valid) -> hidden states [B, T, H]."""
        e = self.model.embed(ids)
        cos, sin = self.model.rope(positions, e.dtype)
        pages = PagedKV(self.table[rows], self.pool.block_size)
        return self.fused(e, cos, sin, self.k, self.v, self.valid[rows].contiguous(), positions, pages)

    def _run(self, row: int, tokens: Sequence[int], start: int, prefill: bool) -> torch.Tensor:
        t = len(tokens)
        self._check(row, start + t)
        self._reserve([(row, start, start + t)])
        self._written(row, start, tokens, prefill)
        ids = torch.tensor([list(tokens)])
        pos = torch.arange(start, start + t)[None]
        return self._step([row], ids, pos)[0]

    @torch.inference_mode()
    def prefill(self, row: int, tokens: Sequence[int], start: int = 0) -> torch.Tensor:
        h = self._run(row, tokens, start, prefill=True)
        self._cache_blocks(row)
        return logits(self.model, h[-1:]).float()[0]

    @torch.inference_mode()
    def verify(self, row: int, tokens: Sequence[int], start: int) -> torch.Tensor:
        return logits(self.model, self._run(row, tokens, start, prefill=False)).float()

    @torch.inference_mode()
    def prefill_many(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Whole prompts in one left-padded forward over a static cache of their own, then into their blocks."""
        for r, p in zip(rows, prompts, strict=True):
            self._check(r, len(p))
        self._reserve([(r, 0, len(p)) for r, p in zip(rows, prompts, strict=True)])
        ids, positions, slots, mask = left_padded(prompts)
        k, big = ids.shape
        tmp = KVCache(len(self.k), k, self.k[0].shape[1], big, self.k[0].shape[3], dtype=self.k[0].dtype)
        out = fused_forward(self.model, self.fused, ids, positions, tmp, slots, mask, last_only=True)
        for i, (r, p) in enumerate(zip(rows, prompts, strict=True)):
            self._store(r, [t[i, :, big - len(p) :] for t in tmp.k], [t[i, :, big - len(p) :] for t in tmp.v])
            self._written(r, 0, p, prefill=True)
            self._cache_blocks(r)
        return out[:, -1].float()

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
        idx = torch.tensor(self.blocks[row][: self.pool.blocks_for(n)], dtype=torch.long)

        def one(t):
            x = t[idx]  # [nb, H, bs, D]
            return x.permute(1, 0, 2, 3).reshape(t.shape[1], -1, t.shape[3])[None, :, :n]

        return [one(t) for t in self.k], [one(t) for t in self.v]

    @torch.inference_mode()
    def decode(
        self, rows: Sequence[int], tokens: Sequence[int | None], positions: Sequence[int]
    ) -> torch.Tensor:
        rows = list(rows)
        for r, p in zip(rows, positions, strict=True):
            self._check(r, p + 1)
        self._reserve([(r, p, p + 1) for r, p in zip(rows, positions, strict=True)])
        toks = [self.carry[r] if t is None else t for r, t in zip(rows, tokens, strict=True)]
        for r, t, p in zip(rows, toks, positions, strict=True):
            self._written(r, p, [t], prefill=False, mark=False)
        pos = torch.tensor(list(positions))[:, None]
        self.valid[torch.tensor(rows), pos[:, 0]] = True
        h = self._step(rows, torch.tensor(toks)[:, None], pos)
        out = logits(self.model, h[:, -1]).float()
        self._last = (out, {r: i for i, r in enumerate(rows)})
        return out

    # ---- row edits ---------------------------------------------------------------------------------------
    def truncate(self, row: int, n: int) -> None:
        self._drop_from(row, n)

    @torch.inference_mode()
    def shift(self, row: int, keep: int, drop: int) -> None:
        n = self.lengths[row]
        ks, vs = self._gather(row, n)
        angle = drop * self.model.inv_freq.float()
        shift_rows(ks, vs, 0, n, keep, drop, angle.cos(), angle.sin())
        self._reserve([(row, keep, n - drop)])
        self._store(row, [k[0, :, keep : n - drop] for k in ks], [v[0, :, keep : n - drop] for v in vs], keep)
        moved = self.tokens[row][keep + drop : n]
        self._drop_from(row, n - drop)
        self.tokens[row][keep:] = moved
        self.prefilled[row] = min(self.prefilled[row], keep)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """dst shares src's blocks of positions 0..n-1 (a partly used last block is copied when written)."""
        self.reset(dst)
        got = self.blocks[src][: self.pool.blocks_for(n)]
        for b in got:
            self.pool.incref(b)
        self.blocks[dst] = list(got)
        if got:
            self.table[dst, : len(got)] = torch.tensor(got, dtype=torch.int32)
        self.tokens[dst] = self.tokens[src][:n]
        self.valid[dst, :n] = self.valid[src, :n]
        self.lengths[dst] = n
        self.prefilled[dst] = min(self.prefilled[src], n)

    def reset(self, row: int, keep: int = 0) -> None:
        self._drop_from(row, keep)
        self.lengths[row] = keep
        self.carry.pop(row, None)


def paged_runner(model, config: RuntimeConfig, rows: int, max_seq_len: int) -> PagedCpuRunner | str:
    """A paged CPU runner for `model`, or the reason it cannot have one (the model's own layers, float32
    activations and the fused C step are needed)."""
    from bitnetlm.runtime.cpu import fused_step

    if model.training:
        return "the model is in training mode"
    if model.norm.weight.dtype != torch.float32:
        return f"activations are {model.norm.weight.dtype} (the paged cache needs float32)"
    if config.kv_dtype(torch.float32) not in KV_DTYPES:
        return f"--kv-cache-dtype {config.kv_cache_dtype} (the fused step's cache: float32 or bf16)"
    step = fused_step(model)
    if isinstance(step, str):
        return step
    return PagedCpuRunner(model, config, rows, max_seq_len, step)
