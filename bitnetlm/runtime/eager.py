"""The eager runner: the model's own forward over a static KV cache, on any device (the reference runner).

Rows that are not decoding in a step (free, or still prefilling) sit inside the batch [0, hi) as masked padding
tokens at their next free slot, which their own next token or prefill chunk overwrites. Whole prompts that
arrive together prefill in one left-padded forward in a cache of their own, then move into their rows at the
slots of their positions. Sampling runs on the host sampler (`sampling.sample`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bitnetlm.models import KVCache
from bitnetlm.runtime.base import Pending, Sampled, SampleSpec, host_sample
from bitnetlm.runtime.config import RuntimeConfig


def left_padded(prompts: Sequence[Sequence[int]]):
    """Prompts as one left-padded batch: (ids, positions, cache slots [k, L], real-token mask or None if none is
    padded), each prompt's last token in the last column."""
    k, big = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(k, big, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, big - len(p) :] = torch.tensor(list(p))
    slots = torch.arange(big)
    offset = (big - torch.tensor([len(p) for p in prompts]))[:, None]
    mask = slots[None, :] >= offset  # [k, L]
    positions = (slots[None, :] - offset).clamp(min=0)
    return ids, positions, slots[None, :].expand(k, big), None if bool(mask.all()) else mask


def model_device(model) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


class EagerRunner:
    pipelined = False
    batched_prefill = True

    def __init__(self, model, config: RuntimeConfig, rows: int, max_seq_len: int):
        self.model, self.config = model, config
        self.device = model_device(model)
        self.rows, self.max_seq_len = rows, max_seq_len
        self.vocab_size = model.config.vocab_size
        act = model.norm.weight.dtype  # (the embedding's may be a compact head's int8 or bf16 storage)
        self.cache = model.new_cache(rows, max_seq_len, device=self.device, dtype=config.kv_dtype(act))
        self.ring = self.cache.ring  # the sliding layers' rings (what a row can roll back to, reuse), or None
        self.lengths = [0] * rows  # positions each row holds
        self.carry: dict[int, int] = {}  # row -> its last sample(carry=True) token
        self._last: tuple[torch.Tensor, dict[int, int]] | None = None  # the last decode's logits and rows

    # ---- the model's forward (the CPU runner replaces its layers) -------------------------------------
    def forward(self, ids, positions, cache: KVCache, cache_pos=None, input_mask=None, every=False):
        """Logits [B, V] after the last token of each row of ids [B, T] (every: [B, T, V], after each)."""
        out = self.model(
            ids,
            positions=positions,
            cache=cache,
            cache_pos=cache_pos,
            input_mask=input_mask,
            last_only=not every,
        )
        return out if every else out[:, -1]

    def _view(self, lo: int, hi: int) -> KVCache:
        """The cache's rows [lo, hi): slices share storage, so writes land in the runner's cache."""
        return self.cache.view(lo, hi)

    def _check(self, row: int, end: int) -> None:
        if not 0 <= row < self.rows:
            raise ValueError(f"row {row} outside the runner's {self.rows} rows")
        if end > self.max_seq_len:
            raise ValueError(f"{end} positions exceed the runner's context of {self.max_seq_len}")

    # ---- Runner -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, row: int, tokens: Sequence[int], start: int = 0) -> torch.Tensor:
        t = len(tokens)
        self._check(row, start + t)
        ids = torch.tensor([list(tokens)], device=self.device)
        pos = torch.arange(start, start + t, device=self.device)[None]
        logits = self.forward(ids, pos, self._view(row, row + 1))[0]
        self.lengths[row] = start + t
        return logits.float()

    @torch.inference_mode()
    def prefill_many(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        for r, p in zip(rows, prompts, strict=True):
            self._check(r, len(p))
        ids, positions, slots, mask = left_padded(prompts)
        k, big = ids.shape
        tmp = self.model.new_cache(k, big, device=self.device, dtype=self.cache.k[0].dtype, rings=False)
        dev = self.device
        logits = self.forward(
            ids.to(dev),
            positions.to(dev),
            tmp,
            cache_pos=slots.to(dev),
            input_mask=None if mask is None else mask.to(dev),
        )
        for i, (r, p) in enumerate(zip(rows, prompts, strict=True)):
            n = len(p)
            self.cache.load_row(r, tmp, i, big - n, n)
            self.lengths[r] = n
        return logits.float()

    @torch.inference_mode()
    def verify(self, row: int, tokens: Sequence[int], start: int) -> torch.Tensor:
        t = len(tokens)
        self._check(row, start + t)
        ids = torch.tensor([list(tokens)], device=self.device)
        pos = torch.arange(start, start + t, device=self.device)[None]
        logits = self.forward(ids, pos, self._view(row, row + 1), every=True)[0]
        self.lengths[row] = start + t
        return logits.float()

    def truncate(self, row: int, n: int) -> None:
        self.cache.forget(row, n)
        self.lengths[row] = min(self.lengths[row], n)

    @torch.inference_mode()
    def shift(self, row: int, keep: int, drop: int) -> None:
        n = self.lengths[row]
        angle = drop * self.model.inv_freq.float().to(self.device)
        self.cache.shift(row, n, keep, drop, angle.cos(), angle.sin())
        self.lengths[row] = n - drop

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.cache.copy_prefix(src, dst, n)
        self.lengths[dst] = n

    def reset(self, row: int, keep: int = 0) -> None:
        self.cache.forget(row, keep)
        self.lengths[row] = keep
        self.carry.pop(row, None)

    @torch.inference_mode()
    def decode(
        self, rows: Sequence[int], tokens: Sequence[int | None], positions: Sequence[int]
    ) -> torch.Tensor:
        hi = max(rows) + 1
        for r, p in zip(rows, positions, strict=True):
            self._check(r, p + 1)
        ids = torch.zeros(hi, 1, dtype=torch.long)
        pos = torch.tensor([min(n, self.max_seq_len - 1) for n in self.lengths[:hi]])[:, None]
        live = torch.zeros(hi, 1, dtype=torch.bool)
        for r, t, p in zip(rows, tokens, positions, strict=True):
            ids[r, 0] = self.carry[r] if t is None else t
            pos[r, 0] = p
            live[r, 0] = True
        dev = self.device
        logits = self.forward(
            ids.to(dev), pos.to(dev), self._view(0, hi), input_mask=None if bool(live.all()) else live.to(dev)
        )  # [hi, V]
        for r, p in zip(rows, positions, strict=True):
            self.lengths[r] = p + 1
        self._last = (logits, {r: r for r in rows})
        out = logits if len(rows) == hi and list(rows) == list(range(hi)) else logits[list(rows)]
        return out.float()

    def decode_sample(
        self, rows, tokens, positions, specs: Sequence[SampleSpec], carry: bool = False
    ) -> Pending:
        self.decode(rows, tokens, positions)
        return self.sample(specs, carry=carry)

    def sample(
        self, specs: Sequence[SampleSpec], logits: torch.Tensor | None = None, carry: bool = False
    ) -> Pending:
        if logits is None:
            last, at = self._last
            logits = last[[at[s.row] for s in specs]]
        out = host_sample(logits, specs)
        if carry:
            for s, t in zip(specs, out.tokens, strict=True):
                self.carry[s.row] = t
        return Pending(list(specs), out)

    def collect(self, pending: Pending) -> Sampled:
        return pending.result
