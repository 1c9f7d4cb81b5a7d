"""The CUDA runner over a paged KV cache (`RuntimeConfig.kv_tokens` on a GPU): `CudaRunner`'s captured steps,
prefills, verifications and samplers over the engine's block pools, with `PagedRows`' bookkeeping
(blocks taken as a row's tokens arrive, prompt prefixes shared through the prefix cache, copy on write).

The host holds the block tables (`PagedRows.table`); before each forward the runner uploads them to the engine's
device table where they changed (stream-ordered: a step already queued reads the table it was queued with). A
captured decode step writes a key for every row of its batch, so the rows that hold no sequence in that step point
at the trash block; a row's entries past its blocks always do. A carried token (sampled on the device) is not on
the host when its row decodes: its place in the row's tokens holds -1, which no cache key reads (only prefilled
blocks are cached).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bitnetlm.runtime.config import RuntimeConfig
from bitnetlm.runtime.cuda.runner import CudaRunner
from bitnetlm.runtime.paged_rows import PagedRows


class PagedCudaRunner(PagedRows, CudaRunner):
    zero_new_blocks = False  # (the kernels read positions 0..pos of a row, all written)

    def __init__(self, model, config: RuntimeConfig, rows: int, max_seq_len: int, plan=None):
        CudaRunner.__init__(self, model, config, rows, max_seq_len, plan)
        e = self.eng
        self.k, self.v = e.k_cache, e.v_cache
        self._init_rows(rows, max_seq_len, e.ecfg.kv_blocks, e.ecfg.kv_block_size, no_block=e.trash)
        self.inv_freq = model.inv_freq
        self._uploaded: torch.Tensor | None = None  # the device table's rows as last uploaded

    def _upload(self, idle: Sequence[int] = ()) -> None:
        """The host's block tables into the engine's device table where they changed, rows `idle` at the trash."""
        want = self.step_table(idle)
        if self._uploaded is not None and torch.equal(want, self._uploaded):
            return
        self.eng.table[: self.rows].copy_(want.pin_memory(), non_blocking=True)
        self._uploaded = want.clone()

    def _fits(self, end: int) -> None:
        if end > self.max_seq_len:
            raise ValueError(f"{end} positions exceed the runner's context of {self.max_seq_len}")

    def _write(self, row: int, tokens: Sequence[int], start: int, prefill: bool) -> None:
        self._fits(start + len(tokens))
        self._reserve([(row, start, start + len(tokens))])
        self._written(row, start, tokens, prefill)
        self._upload()

    # ---- rows -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, row: int, tokens: Sequence[int], start: int = 0) -> torch.Tensor:
        self._unsteady()
        self._write(row, tokens, start, prefill=True)
        out = CudaRunner.prefill(self, row, tokens, start)
        self._cache_blocks(row)
        return out

    @torch.no_grad()
    def verify(self, row: int, tokens: Sequence[int], start: int) -> torch.Tensor:
        if start == 0:
            raise ValueError("verify continues a cached prompt (start > 0)")
        self._unsteady()
        self._write(row, tokens, start, prefill=False)
        return CudaRunner.verify(self, row, tokens, start)

    def prefill_many(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.stack([self.prefill(r, p) for r, p in zip(rows, prompts, strict=True)])

    def truncate(self, row: int, n: int) -> None:
        self._drop_from(row, n)

    def reset(self, row: int, keep: int = 0) -> None:
        self._drop_from(row, keep)
        self.lengths[row] = keep

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self._unsteady()
        self.reset(dst)
        self._share_prefix(src, dst, n)

    @torch.no_grad()
    def shift(self, row: int, keep: int, drop: int) -> None:
        self._unsteady()
        self._shift_blocks(row, keep, drop, self.inv_freq)

    # ---- decode ---------------------------------------------------------------------------------------
    def _take(self, rows: Sequence[int], tokens: Sequence[int | None], positions: Sequence[int]) -> None:
        """Blocks for each row's position (or OutOfBlocks, nothing changed), and the positions' tokens."""
        self._fits(max(positions) + 1)
        self._reserve([(r, p, p + 1) for r, p in zip(rows, positions, strict=True)])
        for r, t, p in zip(rows, tokens, positions, strict=True):
            self._written(r, p, [-1 if t is None else t], prefill=False)

    def _decode(self, rows: Sequence[int], tokens: Sequence[int | None], positions: Sequence[int]) -> None:
        self._take(rows, tokens, positions)
        size = next(s for s in self.sizes if s > max(rows))
        busy = set(rows)
        self._upload([r for r in range(size) if r not in busy])
        CudaRunner._decode(self, rows, tokens, positions)

    def _steady_step(self, rows, positions, specs):
        self._take(rows, [None] * len(rows), positions)
        self._upload()
        return CudaRunner._steady_step(self, rows, positions, specs)
