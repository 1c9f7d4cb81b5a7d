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

from bitnetlm.sampling import reductions
from bitnetlm.sampling.structured import StructuredOutput


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
    structured: StructuredOutput | None = (
        None  # the output must match it (a dict such as {"json": schema} works)
    )

    def __post_init__(self):
        self.structured = StructuredOutput.of(self.structured)
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


# Uniforms are drawn from a row's generator this many at a time (RowRandom); the block size is part of the
# random stream (on a CUDA generator, one draw of n numbers is not n draws of one).
BLOCK = 256


class RowRandom:
    """A row's stream of uniforms in [0, 1) (float64, on `device`), drawn from its generator (None: torch's
    global RNG) BLOCK at a time. The host sampler takes one a step, the CUDA-graph sampler (graph_sampler.py)
    a request's whole budget up front: both see the same numbers, so a seeded request samples the same tokens
    on either path. On a CPU generator the stream equals one draw at a time (the pre-BLOCK behaviour)."""

    def __init__(self, generator: torch.Generator | None, device):
        self.generator = generator
        self.device = torch.device(device)
        self._block = None
        self._i = BLOCK

    def take(self, n: int) -> torch.Tensor:
        """The next n uniforms [n]."""
        parts = []
        while n > 0:
            if self._i == BLOCK:
                self._block = torch.rand(
                    BLOCK, generator=self.generator, device=self.device, dtype=torch.float64
                )
                self._i = 0
            m = min(n, BLOCK - self._i)
            parts.append(self._block[self._i : self._i + m])
            self._i += m
            n -= m
        return parts[0] if len(parts) == 1 else torch.cat(parts)


# top-p / min-p first look at this many best tokens; the full-vocabulary sort runs only when a row's cut is
# not provably inside them (a flat distribution)
CANDIDATES = 256


@dataclass
class RowTensors:
    """The per-row parameters of a batch of SamplingParams as tensors on the logits' device, and the flags that
    fix which ops run: the host-free part of the sampler, built by sample() for each call and by the CUDA-graph
    sampler once per generate call (whose captured ops read these tensors in place)."""

    temps: torch.Tensor  # [B, 1] float32 temperature (1 for greedy rows)
    k: torch.Tensor  # [B] long top-k (V = none)
    top_p: torch.Tensor  # [B] float32 (2 = never cuts)
    min_p: torch.Tensor  # [B] float32
    filt: torch.Tensor  # [B] bool: the row filters (not greedy, some of top-k / top-p / min-p on)
    greedy: torch.Tensor  # [B] bool
    ck: torch.Tensor  # [B] bool: the row samples and has a top-k (it draws among its top-k, see `choose`)
    n: int  # candidates: the best n tokens of every row are sorted (n < V) before any full sort
    kmax: int  # the largest top-k of a filtered row (0: none)
    cand: bool  # some row samples, and every one that does has a top-k
    some_k: bool  # some row samples and has a top-k
    scale: bool  # some row's temperature is not 1
    any_filter: bool
    need_p: bool  # some filtered row has top-p or min-p
    all_k: bool  # every filtered row has top-k (then the n candidates always hold the cut)
    all_greedy: bool
    any_greedy: bool

    def key(self) -> tuple:
        """What fixes the ops (and the shapes) a sampler runs: the static part of a captured sampler's kind."""
        names = (
            "n",
            "kmax",
            "cand",
            "some_k",
            "scale",
            "any_filter",
            "need_p",
            "all_k",
            "all_greedy",
            "any_greedy",
        )
        return tuple(getattr(self, f) for f in names)


def row_tensors(params: Sequence[SamplingParams], v: int, device) -> RowTensors:
    filt = [not p.greedy and (0 < p.top_k < v or p.top_p < 1.0 or p.min_p > 0) for p in params]
    kvals = [p.top_k if 0 < p.top_k < v else v for p in params]
    kmax = max((k for k, f in zip(kvals, filt, strict=True) if f and k < v), default=0)
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    greedy = [p.greedy for p in params]
    ck = [f and k < v for f, k in zip(filt, kvals, strict=True)]  # (a filtered row is never greedy)
    floats = _row_tensor(
        [temps, [p.top_p if p.top_p < 1.0 else 2.0 for p in params], [p.min_p for p in params]], device
    )  # [3, B]
    ints = _row_tensor([kvals, filt, greedy, ck], device, torch.long)  # [4, B]
    return RowTensors(
        temps=floats[0][:, None],
        k=ints[0],
        top_p=floats[1],
        min_p=floats[2],
        filt=ints[1].bool(),
        greedy=ints[2].bool(),
        ck=ints[3].bool(),
        n=min(v, max(CANDIDATES, kmax)),
        kmax=kmax,
        cand=not all(greedy) and all(c for c, g in zip(ck, greedy, strict=True) if not g),
        some_k=any(ck),
        scale=any(t != 1.0 for t in temps),
        any_filter=any(filt),
        need_p=any(f and (p.top_p < 1.0 or p.min_p > 0) for f, p in zip(filt, params, strict=True)),
        all_k=all(k < v for k, f in zip(kvals, filt, strict=True) if f),
        all_greedy=all(greedy),
        any_greedy=any(greedy),
    )


def _penalised(logits, params, prompt_tokens, output_tokens, allowed=None) -> torch.Tensor:
    """float32 copy of logits [B, V] with penalties and logit_bias applied, and the tokens a row's `allowed`
    bitmask excludes (structured output) removed."""
    b, v = logits.shape
    if len(params) != b:
        raise ValueError(f"process_logits: {b} logit rows but {len(params)} SamplingParams")
    x = logits.float().clone()
    x = apply_penalties(x, params, prompt_tokens, output_tokens)
    for i, p in enumerate(params):
        if p.logit_bias:
            ids, vals = bias_tensors(p, v, x.device)
            x[i, ids] += vals
    if allowed is not None:
        apply_allowed(x, allowed)
    return x


# what a token a bitmask excludes gets added to its logit: its probability is then exactly 0 (a finite value: one
# arithmetic pass over the vocabulary, where masked_fill / where over a bool mask take 4-6x as long on the CPU)
EXCLUDED = -1e30


def apply_allowed(x: torch.Tensor, allowed: Sequence[torch.Tensor | None]) -> None:
    """Exclude (in place) from each row of x [B, V] the tokens its bitmask does not allow: allowed[i] is None
    (anything goes) or int32 [ceil(V'/32)] with bit j of word w allowing token 32w + j (llguidance's and
    xgrammar's layout); tokens past its V' are not allowed. An excluded token's logit becomes EXCLUDED."""
    import numpy as np

    rows = [i for i, m in enumerate(allowed) if m is not None]
    if not rows:
        return
    v = x.shape[1]
    words = torch.stack([allowed[i] for i in rows]).to(torch.int32).cpu().contiguous()  # [R, W]
    bits = np.unpackbits(words.numpy().view(np.uint8), axis=1, bitorder="little")[:, :v]  # [R, <= V]
    ok = torch.zeros(len(rows), v)
    ok[:, : bits.shape[1]] = torch.from_numpy(bits)
    pen = ok.sub_(1).mul_(-EXCLUDED).to(x.device)  # 0 where allowed, EXCLUDED elsewhere
    if len(rows) == x.shape[0]:
        x.add_(pen)
    else:
        idx = torch.tensor(rows, device=x.device)
        x.index_add_(0, idx, pen)


def bias_tensors(p: SamplingParams, v: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """p.logit_bias as (token ids [n] long, biases [n] float32) on `device`, the ids checked against [0, v)."""
    if min(p.logit_bias) < 0 or max(p.logit_bias) >= v:
        raise ValueError(f"logit_bias token id out of range [0, {v}): {sorted(p.logit_bias)}")
    ids = _row_tensor(list(p.logit_bias), device, torch.long)
    return ids, _row_tensor(list(p.logit_bias.values()), device)


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_tokens: Sequence | None = None,
    output_tokens: Sequence | None = None,
) -> torch.Tensor:
    """Processed logits [B, V] float32: penalties, bias, temperature, top-k/top-p/min-p (removed = -inf).

    Greedy rows (temperature 0) get penalties and bias only; their argmax is the greedy token.
    """
    x = _penalised(logits, params, prompt_tokens, output_tokens)
    return filtered(x, row_tensors(params, x.shape[1], x.device))


def filtered(x: torch.Tensor, t: RowTensors, full: bool = False) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p over penalised logits x [B, V] (a new tensor where anything
    changes). full=True: no data-dependent fallback (the CUDA-graph sampler): rows without top-k sort the whole
    vocabulary every time, which gives what the candidates-then-fallback path gives, ties aside."""
    if t.scale:
        x = x / t.temps
    if not t.any_filter:
        return x
    v = x.shape[1]
    n = t.n if t.all_k or not full else v
    mask, inside = _filter_mask_over(x, t, n) if n < v else (None, None)
    if mask is None or (inside is not None and not bool(inside.all())):  # (host sync: not in a graph)
        mask, _ = _filter_mask_over(x, t, v)
    return x.masked_fill(mask, float("-inf"))


def _cut(remove: torch.Tensor, probs: torch.Tensor, t: RowTensors) -> None:
    """top-p and min-p over probabilities [B, n] sorted descending: marks in `remove` [B, n] (in place) the tokens
    past the smallest prefix whose mass reaches top_p (dropped once the mass before them does), and those below
    min_p times the best one's probability."""
    remove |= (probs.cumsum(dim=-1) - probs) >= t.top_p[:, None]
    remove |= probs < t.min_p[:, None] * probs[:, :1]


def _filter_mask_over(x: torch.Tensor, t: RowTensors, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([B, V] bool, True = removed by top-k / top-p / min-p, from the n best tokens of each row; [B] bool: the
    cut provably lies inside the n, or None when it always does)."""
    b, v = x.shape
    dev = x.device
    if n < v:
        sorted_x, order = x.topk(n, dim=-1)  # [B, n] descending
    else:
        sorted_x, order = x.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(n, device=dev)[None, :]  # [1, n]
    has_k = t.k < v
    remove = rank >= t.k[:, None]
    inside = None
    if t.need_p:
        masked = sorted_x.masked_fill(remove, float("-inf"))
        # true probabilities over each row's surviving set: its top-k, or the whole vocabulary
        lse = masked.logsumexp(dim=-1)  # [B]
        if not t.all_k:  # a row without top-k: all of V
            lse = torch.where(has_k, lse, x.logsumexp(dim=-1))
        probs = (masked - lse[:, None]).exp()  # [B, n]
        _cut(remove, probs, t)
        if n < v and not t.all_k:
            # every token outside the candidates is removed too iff the candidates already hold top_p of
            # the mass, or the last candidate is already below the min-p threshold; else use the full sort
            inside = ~t.filt | has_k | (probs.sum(dim=-1) >= t.top_p) | (probs[:, -1] < t.min_p * probs[:, 0])
    remove[:, 0] = False  # always keep the most likely token
    mask = torch.ones_like(x, dtype=torch.bool).scatter_(1, order, remove)  # [B, V] back to vocab order
    return mask & t.filt[:, None], inside  # greedy / unfiltered rows: nothing removed


CDF_CHUNK = 256  # the inverse-CDF search: chunk masses first, then a cumulative sum inside one chunk


def uniforms(generators, greedy: Sequence[bool], device) -> torch.Tensor:
    """One uniform [B] float64 per sampled row, from its RowRandom or generator (None: torch's global RNG), in
    row order; greedy rows draw nothing (0)."""
    us = []
    for i, gr in enumerate(greedy):
        g = generators[i] if generators is not None else None
        if gr:
            us.append(torch.zeros(1, dtype=torch.float64, device=device))
        elif isinstance(g, RowRandom):
            us.append(g.take(1))
        else:
            us.append(torch.rand(1, generator=g, device=device, dtype=torch.float64))
    return torch.cat(us)


def inverse_cdf(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of processed logits x [B, V]: the first whose cumulative probability exceeds u [B]
    times the row's total. The draw torch.multinomial(replacement=True) makes, without its pass per row (4.6 ms
    a row for 128k entries on a 2-core CPU) or a sequential sum over the vocabulary: the chunk holding the target
    is found from chunk masses, then the token inside it (cumulative sums in float64, so no tail token loses its
    mass to their rounding). A token of probability 0 (removed by a filter) is never drawn. No host sync."""
    b, v = x.shape
    dev = x.device
    c = CDF_CHUNK
    p = torch.softmax(x, dim=-1).contiguous()  # [B, V]
    mass = p.as_strided((b, v // c, c), (v, c, 1)).sum(dim=-1)  # [B, V // c] whole chunks (a view, no copy)
    if v % c:
        mass = torch.cat([mass, p[:, v // c * c :].sum(dim=-1, keepdim=True)], dim=1)  # the short last chunk
    mass = mass.double().cumsum(dim=-1)  # [B, C] mass up to each chunk's end
    target = u[:, None] * mass[:, -1:]  # [B, 1]
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


def pick(x: torch.Tensor, t: RowTensors, u: torch.Tensor | None) -> torch.Tensor:
    """Tokens [B] from processed logits x: argmax for greedy rows, the inverse-CDF draw at u for the others."""
    if t.all_greedy:
        return reductions.argmax(x)
    if not t.any_greedy:
        return inverse_cdf(x, u)
    return torch.where(t.greedy, reductions.argmax(x), inverse_cdf(x, u))


def _candidate_probs(x: torch.Tensor, t: RowTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows that all have a top-k (t.cand): the kmax best tokens of each row [B, kmax] (best first) and their
    probabilities after temperature, top-k, top-p and min-p, the rules of `filtered` (every other token is
    removed there): sampling them samples the processed logits, with one pass over the vocabulary (the top-k)
    instead of a dozen."""
    vals, order = x.topk(t.kmax, dim=-1)  # [B, kmax] descending
    if t.scale:
        vals = vals / t.temps
    rank = torch.arange(t.kmax, device=x.device)[None, :]  # [1, kmax]
    remove = rank >= t.k[:, None]
    if t.need_p:
        masked = vals.masked_fill(remove, float("-inf"))
        probs = (masked - masked.logsumexp(dim=-1, keepdim=True)).exp()  # over each row's top-k
        _cut(remove, probs, t)
        remove[:, 0] = False  # always keep the most likely token
    return torch.softmax(vals.masked_fill(remove, float("-inf")), dim=-1), order


def _draw_sorted(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[B] index into each row of probabilities p [B, n]: the first whose cumulative probability exceeds u times
    the row's total (float64 sums; never a token of probability 0)."""
    cum = p.double().cumsum(dim=-1)  # [B, n]
    j = torch.searchsorted(cum, u[:, None] * cum[:, -1:], right=True)  # [B, 1]
    last = torch.where(p > 0, torch.arange(p.shape[1], device=p.device), -1).amax(dim=-1, keepdim=True)
    return torch.minimum(j, last)[:, 0]


def choose(x: torch.Tensor, t: RowTensors, u: torch.Tensor | None, full: bool = False) -> torch.Tensor:
    """Tokens [B] of penalised logits x [B, V]. Greedy rows: the argmax. A sampled row with a top-k: the draw at
    its uniform u among its top-k, best first (`_candidate_probs`); one without: the inverse-CDF draw over the
    whole processed vocabulary, in vocabulary order. Which draw a row makes depends on its own parameters only,
    so a seeded row samples the same tokens whatever else is in the batch. No host sync with full=True (see
    `filtered`) or when every sampled row has a top-k (then no pass over the vocabulary but the top-k's)."""
    drawn = None
    if t.some_k and reductions.wide(x):  # the same draw, in one launch after the top-k
        drawn = reductions.candidate_draw(x, t, u)
    elif t.some_k:
        probs, order = _candidate_probs(x, t)
        drawn = order.gather(1, _draw_sorted(probs, u)[:, None])[:, 0]
    if not t.cand:
        tokens = pick(filtered(x, t, full), t, u)
        return tokens if drawn is None else torch.where(t.ck, drawn, tokens)
    return torch.where(t.greedy, reductions.argmax(x), drawn) if t.any_greedy else drawn


def raw_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: int = 0, lse: torch.Tensor | None = None):
    """log p(token) [B] under the raw model distribution, and the top_n most likely (log-probabilities, ids)
    [B, top_n] (None, None when top_n is 0). lse: the rows' logsumexp, when known. On CUDA: logits minus their
    logsumexp (`reductions`: one wide pass, where log_softmax runs a block a row); elsewhere log_softmax, one
    fused pass (with a logsumexp, several: a CPU greedy step took 0.33-0.37 ms against 0.22-0.32,
    docs/PERF_LOG.md, 2026-12-02)."""
    if lse is None and reductions.wide(logits):
        lse = reductions.argmax_logsumexp(logits)[1]
    if lse is None:
        raw = torch.log_softmax(logits.float(), dim=-1)
        lp = raw.gather(1, tokens[:, None])[:, 0]
        if not top_n:
            return lp, None, None
        top = raw.topk(min(top_n, raw.shape[1]), dim=-1)
        return lp, top.values, top.indices
    lp = logits.gather(1, tokens[:, None])[:, 0].float() - lse
    if not top_n:
        return lp, None, None
    vals, ids = logits.topk(min(top_n, logits.shape[1]), dim=-1)
    return lp, vals.float() - lse[:, None], ids


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[RowRandom | torch.Generator | None] | None = None,
    prompt_tokens: Sequence | None = None,
    output_tokens: Sequence | None = None,
    num_top_logprobs: int = 0,
    allowed: Sequence[torch.Tensor | None] | None = None,
) -> SampleOutput:
    """Sample one token per row of `logits` [B, V] with that row's params and random stream (a RowRandom, a
    generator, or None for torch's global RNG), among the tokens its `allowed` bitmask allows (see
    `apply_allowed`; structured output)."""
    b, v = logits.shape
    x = _penalised(logits, params, prompt_tokens, output_tokens, allowed)
    greedy = [p.greedy for p in params]
    if all(greedy):  # (what choose gives, without building the row tensors)
        tokens = reductions.argmax(x)
    else:
        tokens = choose(x, row_tensors(params, v, x.device), uniforms(generators, greedy, x.device))
    lp, top_lp, top_ids = raw_logprobs(logits, tokens, num_top_logprobs)
    return SampleOutput(tokens=tokens, logprobs=lp, top_ids=top_ids, top_logprobs=top_lp)
