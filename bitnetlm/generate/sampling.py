"""Sampling: per-request parameters and a batched sampler with per-row parameters.

Order of logit processing (the transformers / vLLM order): repetition penalty (HF/CTRL rule, over prompt +
output), presence and frequency penalties (OpenAI rule, over output only), logit_bias, then temperature,
top-k, top-p, min-p; temperature == 0 means greedy (argmax of the penalised logits).

Every row draws its randomness from its own `torch.Generator` (seeded per request), and a row consumes the
same random numbers whatever else is in the batch, so a seeded request gives the same tokens alone and
batched (the server's continuous batching relies on this).
Reported log-probabilities are those of the model's raw distribution (log_softmax of the unprocessed logits),
as in mlx-lm and vLLM's default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; >1 discourages tokens already in prompt or output
    presence_penalty: float = 0.0  # OpenAI: subtract once if the token was generated
    frequency_penalty: float = 0.0  # OpenAI: subtract per occurrence in the output
    seed: int | None = None
    logit_bias: dict[int, float] | None = None
    stop: list[str] = field(default_factory=list)  # stop strings (never emitted)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # True: do not stop on the tokenizer's end-of-sequence ids
    logprobs: bool = False
    top_logprobs: int = 0  # also report the n most likely tokens per step
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = [int(i) for i in (self.stop_token_ids or [])]
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        checks = [
            (self.max_tokens >= 0, "max_tokens must be >= 0"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0 (0 disables it)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.top_logprobs >= 0, "top_logprobs must be >= 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"SamplingParams: {msg} (got {self!r})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def make_generator(self, device="cpu") -> torch.Generator | None:
        """A generator seeded with `seed` (None when unseeded: rows then use torch's global RNG)."""
        if self.seed is None:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(int(self.seed))
        return g


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32, log p(token) under the raw model distribution
    top_ids: torch.Tensor | None = None  # [B, k]
    top_logprobs: torch.Tensor | None = None  # [B, k]


def _row_tensor(values, device, dtype=torch.float32) -> torch.Tensor:
    """Per-row values on `device`. To a GPU through pinned memory without blocking: a plain host-to-device copy
    waits for the queued GPU work, which would stall the CUDA-graph decode pipeline (generate/graph.py)."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_tokens: Sequence | None,
    output_tokens: Sequence | None,
) -> torch.Tensor:
    """Repetition / presence / frequency penalties, per row (rows without penalties are left untouched)."""
    b, v = logits.shape
    for i, p in enumerate(params):
        if not p.needs_penalties:
            continue
        out = _ids(output_tokens[i] if output_tokens is not None else None, logits.device)
        row = logits[i]
        if p.repetition_penalty != 1.0:
            prm = _ids(prompt_tokens[i] if prompt_tokens is not None else None, logits.device)
            seen = torch.unique(torch.cat([prm, out]))
            seen = seen[(seen >= 0) & (seen < v)]
            s = row[seen]
            # CTRL / transformers rule: divide positive logits, multiply negative ones
            row[seen] = torch.where(s > 0, s / p.repetition_penalty, s * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and out.numel():
            counts = torch.bincount(out[(out >= 0) & (out < v)], minlength=v).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def _ids(x, device) -> torch.Tensor:
    if x is None:
        return torch.zeros(0, dtype=torch.long, device=device)
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=torch.long).reshape(-1)
    return torch.tensor(list(x), dtype=torch.long, device=device)


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_tokens: Sequence | None = None,
    output_tokens: Sequence | None = None,
) -> torch.Tensor:
    """Processed logits [B, V] float32: penalties, bias, temperature, top-k/top-p/min-p (removed = -inf).

    Greedy rows (temperature 0) get penalties and bias only; their argmax is the greedy token.
    """
    b, v = logits.shape
    if len(params) != b:
        raise ValueError(f"process_logits: {b} logit rows but {len(params)} SamplingParams")
    x = logits.float().clone()
    x = apply_penalties(x, params, prompt_tokens, output_tokens)
    for i, p in enumerate(params):
        if p.logit_bias:
            if min(p.logit_bias) < 0 or max(p.logit_bias) >= v:
                raise ValueError(f"logit_bias token id out of range [0, {v}): {sorted(p.logit_bias)}")
            ids = _row_tensor(list(p.logit_bias), x.device, torch.long)
            x[i, ids] += _row_tensor(list(p.logit_bias.values()), x.device, x.dtype)
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    if any(t != 1.0 for t in temps):  # a Python scalar when the rows agree (no copy at all)
        x = x / (temps[0] if len(set(temps)) == 1 else _row_tensor(temps, x.device)[:, None])
    mask = _filter_mask(x, params)
    if mask is None:
        return x
    return x.masked_fill(mask, float("-inf"))


# top-p / min-p first look at this many best tokens; the full-vocabulary sort runs only when a row's cut is
# not provably inside them (a flat distribution)
CANDIDATES = 256


def _filter_mask(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor | None:
    """[B, V] bool, True = removed by top-k / top-p / min-p (None when no row filters anything)."""
    b, v = x.shape
    filt = [not p.greedy and (0 < p.top_k < v or p.top_p < 1.0 or p.min_p > 0) for p in params]
    if not any(filt):
        return None
    kvals = [p.top_k if 0 < p.top_k < v else v for p in params]  # v = no top-k
    kmax = max((k for k, f in zip(kvals, filt, strict=True) if f and k < v), default=0)
    n = min(v, max(CANDIDATES, kmax))
    mask = _filter_mask_over(x, params, filt, kvals, n) if n < v else None
    if mask is None:
        mask = _filter_mask_over(x, params, filt, kvals, v)
    return mask


def _filter_mask_over(x, params, filt, kvals, n):
    b, v = x.shape
    dev = x.device
    if n < v:
        sorted_x, order = x.topk(n, dim=-1)  # [B, n] descending
    else:
        sorted_x, order = x.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(n, device=dev)[None, :]  # [1, n]
    k = _row_tensor(kvals, dev, torch.long)
    has_k = k < v
    remove = rank >= k[:, None]
    rows = _row_tensor(filt, dev, torch.bool)
    if any(f and (p.top_p < 1.0 or p.min_p > 0) for f, p in zip(filt, params, strict=True)):
        masked = sorted_x.masked_fill(remove, float("-inf"))
        # true probabilities over each row's surviving set: its top-k, or the whole vocabulary
        lse = masked.logsumexp(dim=-1)  # [B]
        if not all(kv < v for kv, f in zip(kvals, filt, strict=True) if f):  # a row without top-k: all of V
            lse = torch.where(has_k, lse, x.logsumexp(dim=-1))
        probs = (masked - lse[:, None]).exp()  # [B, n]
        top_p = _row_tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], dev)  # 2 = never cuts
        min_p = _row_tensor([p.min_p for p in params], dev)
        # keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does
        remove |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
        remove |= probs < min_p[:, None] * probs[:, :1]
        if n < v and not all(k < v for k, f in zip(kvals, filt, strict=True) if f):
            # every token outside the candidates is removed too iff the candidates already hold top_p of
            # the mass, or the last candidate is already below the min-p threshold; else use the full sort
            inside = has_k | (probs.sum(dim=-1) >= top_p) | (probs[:, -1] < min_p * probs[:, 0])
            if not bool(inside[rows].all()):
                return None
    remove[:, 0] = False  # always keep the most likely token
    mask = torch.ones_like(x, dtype=torch.bool).scatter_(1, order, remove)  # [B, V] back to vocab order
    return mask & rows[:, None]  # greedy / unfiltered rows: nothing removed


CDF_CHUNK = 256  # the inverse-CDF search: chunk masses first, then a cumulative sum inside one chunk


def _inverse_cdf(x: torch.Tensor, greedy: list[bool], generators) -> torch.Tensor:
    """One token per row of processed logits x [B, V]: the first whose cumulative probability exceeds u times the
    row's total, u uniform in [0, 1) drawn from the row's own generator (one draw per sampled row, in row order,
    so a row's draws do not depend on the rest of the batch; greedy rows draw nothing and their result is unused).
    The draw torch.multinomial(replacement=True) makes, without its pass per row (4.6 ms a row for 128k entries
    on a 2-core CPU) or a sequential sum over the vocabulary: the chunk holding the target is found from chunk
    masses, then the token inside it (cumulative sums in float64, so no tail token loses its mass to their
    rounding). A token of probability 0 (removed by a filter) is never drawn."""
    b, v = x.shape
    dev = x.device
    us = []
    for i in range(b):
        g = generators[i] if generators is not None else None
        us.append(
            x.new_zeros(1, dtype=torch.float64)
            if greedy[i]
            else torch.rand(1, generator=g, device=dev, dtype=torch.float64)
        )
    c = CDF_CHUNK
    p = torch.softmax(x, dim=-1).contiguous()  # [B, V]
    mass = p.as_strided((b, v // c, c), (v, c, 1)).sum(dim=-1)  # [B, V // c] whole chunks (a view, no copy)
    if v % c:
        mass = torch.cat([mass, p[:, v // c * c :].sum(dim=-1, keepdim=True)], dim=1)  # the short last chunk
    mass = mass.double().cumsum(dim=-1)  # [B, C] mass up to each chunk's end
    target = torch.cat(us)[:, None] * mass[:, -1:]  # [B, 1]
    # [B, 1]: the first chunk whose end passes the target
    j = torch.searchsorted(mass, target, right=True).clamp(max=mass.shape[1] - 1)
    before = torch.where(j > 0, mass.gather(1, (j - 1).clamp(min=0)), 0.0)  # [B, 1] mass of earlier chunks
    offs = torch.arange(c, device=dev)
    idx = j * c + offs  # [B, c] the chosen chunk's tokens
    inside = torch.where(idx < v, p.gather(1, idx.clamp(max=v - 1)), 0.0)  # [B, c] their probabilities
    k = torch.searchsorted(inside.cumsum(dim=-1, dtype=torch.float64), target - before, right=True)  # [B, 1]
    # a chunk's two sums may differ in their last bits: past the end means the chunk's last positive token
    last = torch.where(inside > 0, offs, -1).amax(dim=-1, keepdim=True)  # [B, 1]
    return (j * c + torch.minimum(k, last))[:, 0]


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
    prompt_tokens: Sequence | None = None,
    output_tokens: Sequence | None = None,
    num_top_logprobs: int = 0,
) -> SampleOutput:
    """Sample one token per row of `logits` [B, V] with that row's params and generator."""
    b, v = logits.shape
    x = process_logits(logits, params, prompt_tokens, output_tokens)
    greedy = [p.greedy for p in params]
    if all(greedy):
        tokens = x.argmax(dim=-1)
    elif not any(greedy):
        tokens = _inverse_cdf(x, greedy, generators)
    else:
        is_greedy = _row_tensor(greedy, x.device, torch.bool)
        tokens = torch.where(is_greedy, x.argmax(dim=-1), _inverse_cdf(x, greedy, generators))
    raw = torch.log_softmax(logits.float(), dim=-1)
    out = SampleOutput(tokens=tokens, logprobs=raw.gather(1, tokens[:, None])[:, 0])
    if num_top_logprobs > 0:
        top = raw.topk(min(num_top_logprobs, v), dim=-1)
        out.top_logprobs, out.top_ids = top.values, top.indices
    return out
