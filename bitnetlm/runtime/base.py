"""The Runner protocol: what every loop (offline generation, the server) drives, whatever the device.

A runner owns a KV cache of `rows` rows (one per sequence being generated) of `max_seq_len` positions and runs
the model over it: prefill a chunk of a row's prompt, decode one token for a set of rows, sample. Each row's
keys and values sit at their own positions: position p of a row holds its p-th token, so a row computes what it
would compute alone. Implementations: `eager` (the model's own forward, any device: the reference), `cpu` (the
fused C layer step), `cuda` (captured CUDA graphs over the Triton kernels).

Sampling happens inside the runner so that a device may keep the sampled tokens where they are: with
`carry=True` a row's sampled token is also the input of its next decode (pass None as its token), and
`collect` brings the tokens to the host later, so the host's work on one step overlaps the device's next.

A paged runner (`runtime/paged_rows.py`: the CPU's and the CUDA one) also has `pool` (its `BlockPool`),
`cached_prefix(tokens)` (the leading positions its block cache holds) and `adopt(row, tokens)` (an empty row maps
those blocks); the engine's scheduler then admits by blocks and reuses prefixes through them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from bitnetlm.sampling import RowRandom, SamplingParams, sample


@dataclass
class SampleSpec:
    """What a runner needs to sample a row: its parameters and random stream, the draws it may still need, and
    (for penalties) its prompt and output tokens. `owner` identifies the row's occupant (a new one on a row whose
    sampler state is kept on the device reloads it). `allowed`: the bitmask of the tokens structured output
    allows this step (`sampling.sampler.apply_allowed`), or None."""

    row: int
    params: SamplingParams
    random: RowRandom | None
    budget: int
    owner: Any = None
    prompt: Sequence[int] = ()
    output: Sequence[int] = ()
    allowed: torch.Tensor | None = None

    @property
    def on_host(self) -> bool:
        """Sampled by the host sampler: penalties and masks need this step's tokens on the host."""
        return self.allowed is not None or self.params.needs_penalties


@dataclass
class Sampled:
    """One sampling step on the host: per spec, in order, the token, its log-probability and, when asked for,
    the top log-probabilities (ids and values)."""

    tokens: list[int]
    logprobs: list[float]
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


@dataclass
class Pending:
    """A queued sampling step; `Runner.collect` turns it into `Sampled`."""

    specs: list[SampleSpec]
    result: Sampled | None = None  # filled at once by runners that sample on the host
    device: dict = field(default_factory=dict)  # a device runner's handles (events, pinned buffers)


class Runner(Protocol):
    device: torch.device
    rows: int
    max_seq_len: int
    vocab_size: int
    pipelined: bool  # sample(carry=True) may return before the tokens reach the host
    batched_prefill: bool  # prefill_many runs several whole prompts in one forward
    # the sliding-window layers' rings (models.cache.Ring), or None: a row holds only the last ring.size
    # positions there, which bounds how far it may roll back (`truncate`) and which prefixes it can keep
    ring: Any

    def prefill(self, row: int, tokens: Sequence[int], start: int = 0) -> torch.Tensor:
        """`tokens` at positions start.. into `row` -> float32 logits [V] after the last one."""

    def prefill_many(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Whole prompts from position 0 into `rows` -> logits [R, V] after each prompt's last token."""

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Row `dst` gets row `src`'s first n positions (choices of one prompt share its prefill)."""

    def reset(self, row: int, keep: int = 0) -> None:
        """Forget what `row` holds (a new sequence starts in it) but for its first `keep` positions (a prompt
        prefix the new sequence shares)."""

    def verify(self, row: int, tokens: Sequence[int], start: int) -> torch.Tensor:
        """`tokens` at positions start.. into `row` -> float32 logits [T, V] after each (speculative decoding
        scores a draft in one pass)."""

    def truncate(self, row: int, n: int) -> None:
        """Forget `row`'s positions from n on (rejected draft tokens)."""

    def shift(self, row: int, keep: int, drop: int) -> None:
        """Context shift: forget `row`'s positions keep..keep+drop-1 and move the later ones down by `drop`, their
        keys (cached after RoPE) rotated back by `drop` positions, so the row continues at its length - drop."""

    def decode(
        self, rows: Sequence[int], tokens: Sequence[int | None], positions: Sequence[int]
    ) -> torch.Tensor:
        """One token for each of `rows` (None: the token its last sample(carry=True) left) at its position ->
        logits [R, V] (float32)."""

    def sample(
        self, specs: Sequence[SampleSpec], logits: torch.Tensor | None = None, carry: bool = False
    ) -> Pending:
        """One token per spec from `logits` [R, V] (None: the last decode's, by row). carry: keep each token as
        its row's next decode input (and let the step run ahead of the host)."""

    def decode_sample(
        self, rows, tokens, positions, specs: Sequence[SampleSpec], carry: bool = False
    ) -> Pending:
        """decode, then sample its logits (a device runner may run the two as one)."""

    def collect(self, pending: Pending) -> Sampled:
        """The tokens of a queued sampling step (waits for the device)."""


def host_sample(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> Sampled:
    """`sampling.sample` over `logits` [R, V] with each spec's parameters and stream, read back to the host."""
    params = [s.params for s in specs]
    pen = any(p.needs_penalties for p in params)
    top = max((p.top_logprobs for p in params if p.logprobs or p.top_logprobs), default=0)
    out = sample(
        logits,
        params,
        [s.random for s in specs],
        prompt_tokens=[s.prompt for s in specs] if pen else None,
        output_tokens=[s.output for s in specs] if pen else None,
        num_top_logprobs=top,
        allowed=[s.allowed for s in specs] if any(s.allowed is not None for s in specs) else None,
    )
    return Sampled(
        out.tokens.tolist(),
        out.logprobs.tolist(),
        out.top_ids.tolist() if top else None,
        out.top_logprobs.tolist() if top else None,
    )
