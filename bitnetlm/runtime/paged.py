"""The paged CPU runner: the fused C step over a KV cache of fixed-size blocks shared by every row (`paged_rows`:
the blocks, the prefix cache, copy on write).

Each layer's pool holds `RuntimeConfig.kv_tokens` positions, allocated untouched: the OS commits its pages as
blocks are first used, lowest ids first. The step's attention reads a row's keys block by block in the same order
as from a static row: results equal the static CPU runner's bit for bit (tests/test_paged.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bitnetlm.kernels.cpu.decode import KV_DTYPES, FusedStep, PagedKV
from bitnetlm.models import KVCache
from bitnetlm.runtime.config import RuntimeConfig
from bitnetlm.runtime.cpu import fused_forward, logits
from bitnetlm.runtime.eager import EagerRunner, left_padded
from bitnetlm.runtime.paged_rows import PagedRows


class PagedCpuRunner(PagedRows, EagerRunner):
    """A CPU runner over a paged KV cache (see the module docstring); the sampling is the eager runner's."""

    def __init__(self, model, config: RuntimeConfig, rows: int, max_seq_len: int, step: FusedStep):
        cfg, bs = model.config, config.kv_block_size
        self.model, self.config, self.fused, self.why_not = model, config, step, None
        self.device = torch.device("cpu")
        self.ring = None  # (the fused step runs no sliding-window layers)
        self.rows, self.max_seq_len, self.vocab_size = rows, max_seq_len, cfg.vocab_size
        self._init_rows(rows, max_seq_len, max(1, config.kv_tokens // bs), bs)
        shape = (self.pool.num_blocks, cfg.num_key_value_heads, bs, cfg.head_dim)
        dtype = config.kv_dtype(torch.float32)
        self.k = [torch.empty(shape, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.empty(shape, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.valid = torch.zeros(rows, self.max_blocks * bs, dtype=torch.bool)
        self.carry: dict[int, int] = {}
        self._last = None

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
        self._shift_blocks(row, keep, drop, self.model.inv_freq)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.reset(dst)
        self._share_prefix(src, dst, n)

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
