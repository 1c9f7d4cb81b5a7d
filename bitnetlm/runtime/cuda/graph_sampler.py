"""The sampler of generate's CUDA-graph loop (generate/graph.py), captured in a CUDA graph of its own.

The ops of `sampling.sample` (logit_bias, temperature, top-k / top-p / min-p, the inverse-CDF draw, the raw
log-probabilities) over the step graph's logits, reading every row's parameters and its uniforms from device
tensors: one replay a step instead of some 30 launches and their Python, which made the host, not the GPU, the
bound of a sampled decode (benchmarks/gpu.py). The tokens equal the host sampler's for the same
logits and the same uniforms (each row's RowRandom hands the whole request's draws over up front). Requests
with penalties keep the host sampler: those need the growing output on the host.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from bitnetlm.sampling.reductions import argmax_logsumexp, greedy_sample, wide
from bitnetlm.sampling.sampler import (
    RowRandom,
    RowTensors,
    SamplingParams,
    bias_tensors,
    choose,
    raw_logprobs,
    row_tensors,
)

_FIELDS = ("temps", "k", "top_p", "min_p", "filt", "greedy", "ck")


@dataclass
class Draws:
    """Every row's uniforms and its place in them, and its logit_bias: what a sampler's replays read and advance,
    kept apart from the samplers so that several (one per kind of rows) can share them."""

    u: torch.Tensor  # [B, cap] float64: row i's uniform of its draw j is u[i, j]
    step: torch.Tensor  # [B] long: row i's next draw
    bias: torch.Tensor | None  # [B, V] float32 logit_bias (0 elsewhere), or None: no row has one

    @classmethod
    def new(cls, b: int, v: int, cap: int, device, bias: bool = True) -> Draws:
        z = torch.zeros
        return cls(
            z((b, cap), dtype=torch.float64, device=device),
            z((b,), dtype=torch.long, device=device),
            z((b, v), device=device) if bias else None,
        )

    def rows(self, b: int) -> Draws:
        """The first b rows (views: samplers of a smaller batch share the rows' draws)."""
        return Draws(self.u[:b], self.step[:b], None if self.bias is None else self.bias[:b])

    def reset(self) -> None:
        """Every row back to its first draw, with no uniforms and no bias."""
        for t in (self.u, self.step, self.bias):
            if t is not None:
                t.zero_()

    def load_row(self, i: int, p: SamplingParams, r: RowRandom | None, n: int, cleared: bool = False) -> None:
        """Row i from its next draw on: p's logit_bias and, for a sampled row, the next n uniforms of r.
        cleared: the row is already reset (a whole batch's load: one zeroing for all rows, not three a row)."""
        if not cleared:
            if self.bias is not None:
                self.bias[i].zero_()
            self.u[i].zero_()
            self.step[i] = 0
        if p.logit_bias:
            ids, vals = bias_tensors(p, self.bias.shape[1], self.bias.device)
            self.bias[i, ids] = vals
        if not p.greedy and n > 0:
            self.u[i, :n].copy_(r.take(n))


class GraphSampler:
    """Samples one token for each of the B rows of `logits` [B, V] (a step graph's static output) into `tok`
    [B], `lp` [B] (and `top_v` / `top_i` [B, top_n]), writes them into `next_tok` [B, 1] (the step graph's
    input) and advances every row's draw index: all in `graph`, replayed by `run` once a step after `load` (on a
    CPU, where there are no graphs, `run` runs the ops). `draws`: the rows' uniforms and biases, when shared with
    other samplers (ContinuousSampler); else its own. `pool`: a CUDA graph memory pool shared with samplers that
    are only ever replayed one after another on one stream (else one of its own). `export`: the graph also
    stores its outputs into `self.host` (a HostRing), so that the host reads them with no copy queued; `run`
    then returns the export's number, whose slot `host.slot` gives."""

    def __init__(
        self,
        logits,
        next_tok,
        t: RowTensors,
        top_n: int,
        cap: int,
        bias: bool,
        draws: Draws | None = None,
        pool=None,
        export: bool = False,
    ):
        b, v = logits.shape
        dev = logits.device
        self.logits, self.next_tok, self.top_n = logits, next_tok, top_n
        self.t = t  # the rows' parameters (row_tensors on logits' device), refreshed in place by set_params()
        self.draws = draws if draws is not None else Draws.new(b, v, cap, dev, bias)
        self.u, self.step = self.draws.u, self.draws.step
        self.bias = self.draws.bias if bias else None
        self.tok = torch.zeros((b,), dtype=torch.long, device=dev)
        self.lp = torch.zeros((b,), dtype=torch.float32, device=dev)
        self.top_v = torch.zeros((b, top_n), dtype=torch.float32, device=dev)
        self.top_i = torch.zeros((b, top_n), dtype=torch.long, device=dev)
        self.graph = self._step_graph = self.host = None
        # (a CPU has no graph to export from: `run` runs the ops)
        self.exports = export and dev.type == "cuda"
        if dev.type == "cuda":
            from bitnetlm.runtime.cuda.graphs import capture

            body = self._body
            if self.exports:
                self.host = HostRing(b, top_n, dev)

                def body():
                    self._body()
                    self.host.export(self)

            at = self.step.clone()  # the eager warm-up runs advance the (maybe shared) draw indices: undone
            self.graph, _ = capture(body, before_capture=lambda: self.step.copy_(at), pool=pool)
            if self.exports:
                self.host.reset()  # (and the warm-up runs' exports)

    def run(self) -> int | None:
        """One sampling step; with `export`, the number of its export into `host` (else None)."""
        if self.graph is None:
            self._body()
            return None
        self.graph.replay()
        if not self.exports:
            return None
        n, self.host.queued = self.host.queued, self.host.queued + 1
        return n

    def step_graph(self, st) -> torch.cuda.CUDAGraph:
        """The decode step `st` (the logits_state whose logits and input this sampler was made over), this
        sampler over that step's logits and the export of its outputs into `self.host` (a HostRing), in one
        graph: a replay does what `st.graph.replay()`, `run()` and the host's copies did, in one launch and with
        no copy queued by the host (their gaps were most of what `generate` spent a token beyond the step).
        Captured on first use into st's memory pool (the two are replayed one at a time on one stream, and only
        st's logits outlive a replay); like st, capture it before prefilling."""
        if self._step_graph is None:
            from bitnetlm.runtime.cuda.graphs import capture

            if self.exports:
                raise RuntimeError("GraphSampler.step_graph: this sampler's own graph exports already")
            body, at = st.extra["body"], self.step.clone()
            self.host = HostRing(self.tok.shape[0], self.top_n, self.tok.device)

            def both():
                self._body(body())
                self.host.export(self)

            def rewind():  # the eager warm-up runs advanced the positions and the draw indices
                st.pos.zero_()
                self.step.copy_(at)

            self._step_graph, _ = capture(both, before_capture=rewind, pool=st.graph.pool())
        return self._step_graph

    def _body(self, logits: torch.Tensor | None = None):
        x = self.logits if logits is None else logits
        greedy = self.t.all_greedy and self.bias is None and not self.top_n
        if not (greedy and greedy_sample(x, self.tok, self.lp, self.next_tok, self.step)):
            self._ops(x)

    def _ops(self, logits: torch.Tensor):
        x = logits.float()
        if self.bias is not None:
            x = x + self.bias  # (the host sampler adds a row's few biases in place: the same sums)
        # [B] each row's next uniform (a free row of the server's keeps stepping: clamped)
        u = self.u.gather(1, self.step.clamp(max=self.u.shape[1] - 1)[:, None])[:, 0]
        lse = None
        if self.t.all_greedy and self.bias is None and wide(logits):  # tokens and log-probs in one pass
            tokens, lse = argmax_logsumexp(logits)
        else:
            tokens = choose(x, self.t, u, full=True)
        lp, top_v, top_i = raw_logprobs(logits, tokens, self.top_n, lse=lse)
        self.tok.copy_(tokens)
        self.lp.copy_(lp)
        if self.top_n:
            self.top_v.copy_(top_v)
            self.top_i.copy_(top_i)
        self.next_tok.copy_(tokens[:, None])
        self.step.add_(1)

    def load(
        self,
        t: RowTensors,
        params: Sequence[SamplingParams],
        randoms: Sequence[RowRandom],
        n_draws: Sequence[int],
    ):
        """This call's rows: their parameters (t = row_tensors(params, ...)), and the next n_draws[i] uniforms of
        every sampled row's stream."""
        self.set_params(t)
        self.draws.reset()
        for i, (p, r, n) in enumerate(zip(params, randoms, n_draws, strict=True)):
            self.draws.load_row(i, p, r, n, cleared=True)

    def set_params(self, t: RowTensors) -> None:
        """The rows' parameters (row_tensors of this sampler's kind), into the tensors its ops read."""
        if t.key() != self.t.key():
            raise ValueError(f"GraphSampler: captured for {self.t.key()}, loaded with {t.key()}")
        if t is not self.t:
            for f in _FIELDS:
                getattr(self.t, f).copy_(getattr(t, f))


class HostRing:
    """Two slots of pinned host memory for a sampler's outputs (tok, lp, top_v, top_i), filled alternately by
    one launch that stores into them directly (`kernels.triton.sampler.export_rows`), and the exports' count,
    on the device and, after each export, on the host: the n-th export since `reset` fills slot n % 2, which
    the host reads once an event after it has passed while the next replay fills the other. `queued`: the
    exports the host has queued since reset (GraphSampler.run of an exporting graph counts them)."""

    def __init__(self, b: int, top_n: int, device):
        def pinned(shape, dt):
            return torch.zeros(shape, dtype=dt, pin_memory=True)

        self.tok, self.lp = pinned((2, b), torch.long), pinned((2, b), torch.float32)
        self.top_v, self.top_i = pinned((2, b, top_n), torch.float32), pinned((2, b, top_n), torch.long)
        self.seq_h = pinned((1,), torch.long)
        self.seq = torch.zeros((1,), dtype=torch.long, device=device)
        self.queued = 0

    def reset(self) -> None:
        self.seq.zero_()
        self.seq_h.zero_()
        self.queued = 0

    def export(self, gs: GraphSampler) -> None:
        from bitnetlm.kernels.triton.sampler import export_rows

        export_rows(
            gs.tok, gs.lp, gs.top_v, gs.top_i, self.seq, self.tok, self.lp, self.top_v, self.top_i, self.seq_h
        )

    def slot(self, n: int) -> int:
        """The slot of the n-th export since reset, once it has run (the next one may have run too)."""
        seen = int(self.seq_h[0])
        if not n + 1 <= seen <= n + 2:
            raise RuntimeError(f"HostRing: export {n} read after {seen} exports (a replay missed or doubled)")
        return n % 2


# Captured samplers kept per engine (each kind of rows -- batch size, top-k, flags -- has its own graph and memory
# pool); past this many the least recently used one is dropped.
MAX_SAMPLERS = 16


def graph_sampler(
    eng,
    st,
    params: Sequence[SamplingParams],
    randoms: Sequence[RowRandom],
    n_draws: Sequence[int],
    top_n: int,
) -> GraphSampler:
    """The engine's GraphSampler over the step state `st` for rows of this kind (captured on first use and
    cached on the engine beside its step graphs, the MAX_SAMPLERS most recently used), loaded with these rows
    (GraphSampler.load)."""
    b, v = st.logits.shape
    bias = any(p.logit_bias for p in params)
    t = row_tensors(params, v, st.logits.device)
    key = ("sampler", id(st), t.key(), bias, top_n)
    gs = _cached(
        eng._graphs,
        key,
        lambda: GraphSampler(st.logits, st.tok, t, top_n, eng.ecfg.max_seq_len, bias),
        lambda k: k[0] == "sampler",
    )
    gs.load(t, params, randoms, n_draws)
    return gs


def _cached(cache: dict, key, make: Callable, counts: Callable = lambda k: True, bound: int = MAX_SAMPLERS):
    """cache[key], made on first use; a dict's order is its order of use here, and past `bound` keys that
    `counts` the least recently used go."""
    gs = cache.pop(key, None)
    if gs is None:
        gs = make()
        old = [k for k in cache if counts(k)]
        for k in old[: max(0, len(old) - bound + 1)]:
            del cache[k]
    cache[key] = gs  # (re)inserted last
    return gs


GREEDY = SamplingParams(temperature=0.0)  # what a free row samples (nothing it draws, its token unseen)


class ContinuousSampler:
    """The captured sampler of continuous batching (the server's CUDA-graph rows, serve/graph_rows.py): rows whose
    occupants join and leave between steps, decoded in batches of any captured size up to `max_batch`.

    An occupant's draws (its RowRandom's next uniforms, as many as it may still sample) and its logit_bias are
    loaded once, when it joins; every later step reads and advances them inside the replay. They live in one
    `Draws` over max_batch rows that every captured kind (batch size, occupants' kinds of parameters) shares
    through views, so a change of kind or of batch size never moves a row in its stream: a seeded request
    samples what offline `generate` samples. Rows without an occupant sample as greedy, unseen.

    The captured kinds share one memory pool (they replay one at a time on the server's one stream, and keep
    nothing in it between replays): their memory is that of the largest, so up to `max_samplers` of them stay
    (a server meets each batch size with several mixes of requests)."""

    def __init__(self, max_batch: int, v: int, cap: int, device, dtype=torch.float32, max_samplers: int = 64):
        self.v, self.cap, self.device = v, cap, torch.device(device)
        self.x = torch.zeros((max_batch, v), dtype=dtype, device=device)  # the step's logits, copied in
        # (the step graph's input is the server's to fill)
        self.next_tok = torch.zeros((max_batch, 1), dtype=torch.long, device=device)
        self.draws = Draws.new(max_batch, v, cap, device)
        self.occupant: list[object | None] = [None] * max_batch
        self.params: list[SamplingParams] = [GREEDY] * max_batch
        self.samplers: OrderedDict = OrderedDict()  # (b, kind) -> GraphSampler
        self._version = 0  # bumped when an occupant changes
        self._set: tuple | None = None  # (version, b, sampler) of the last set_params
        self.max_samplers = max_samplers
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None

    def load(self, rows: dict[int, tuple]) -> bool:
        """Rows' occupants: rows maps a row to (occupant, SamplingParams, RowRandom, draws it may still need),
        identified by the occupant (`is`): a new one is loaded, and a row missing from `rows` samples as greedy.
        Returns whether any row changed."""
        changed = False
        for i in range(len(self.occupant)):
            occ = rows.get(i)
            who = None if occ is None else occ[0]
            if who is self.occupant[i]:
                continue
            changed = True
            self.occupant[i] = who
            self.params[i] = GREEDY if occ is None else occ[1]
            self._version += 1
            if occ is None:
                self.draws.bias[i].zero_()
            else:
                self.draws.load_row(i, occ[1], occ[2], occ[3])
        return changed

    @property
    def version(self) -> int:
        """Bumped whenever a row's occupant changes."""
        return self._version

    def kind(self, b: int) -> tuple[RowTensors, bool, int]:
        """The first b rows' parameters as tensors, whether any has a logit_bias, and their top-logprobs count."""
        params = self.params[:b]
        t = row_tensors(params, self.v, self.device)
        bias = any(p.logit_bias for p in params)
        top_n = max((p.top_logprobs for p in params if p.logprobs or p.top_logprobs), default=0)
        return t, bias, top_n

    def sample(self, logits: torch.Tensor, rows: dict[int, tuple]) -> tuple[GraphSampler, int | None]:
        """One token for every row of `logits` [b, V] (rows: as `load` takes them). Returns the sampler whose
        tok / lp / top_v / top_i [b] hold the result (device tensors, valid until the next call), and the number
        of the replay's export into the sampler's HostRing (on CUDA; else None)."""
        b = logits.shape[0]
        self.load(rows)
        gs = self._sampler(b)
        self.x[:b].copy_(logits)
        return gs, gs.run()

    def _sampler(self, b: int) -> GraphSampler:
        if self._set is not None and self._set[:2] == (self._version, b):
            return self._set[2]
        t, bias, top_n = self.kind(b)
        x, nt, d = self.x[:b], self.next_tok[:b], self.draws.rows(b)
        gs = _cached(
            self.samplers,
            (b, t.key(), bias, top_n),
            lambda: GraphSampler(x, nt, t, top_n, self.cap, bias, d, self.pool, export=True),
            bound=self.max_samplers,
        )
        gs.set_params(t)
        self._set = (self._version, b, gs)
        return gs
