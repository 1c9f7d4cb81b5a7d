"""The sampler of generate's CUDA-graph loop (generate/graph.py), captured in a CUDA graph of its own.

The ops of `sampling.sample` (logit_bias, temperature, top-k / top-p / min-p, the inverse-CDF draw, the raw
log-probabilities) over the step graph's logits, reading every row's parameters and its uniforms from device
tensors: one replay a step instead of some 30 launches and their Python, which made the host, not the GPU, the
bound of a sampled decode (benchmarks/gpu_generate.py). The tokens equal the host sampler's for the same
logits and the same uniforms (each row's RowRandom hands the whole request's draws over up front). Requests
with penalties keep the host sampler: those need the growing output on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bitnetlm.generate.sampling import (
    RowRandom,
    RowTensors,
    SamplingParams,
    bias_tensors,
    choose,
    raw_logprobs,
    row_tensors,
)

_FIELDS = ("temps", "k", "top_p", "min_p", "filt", "greedy", "ck")


class GraphSampler:
    """Samples one token for each of the B rows of `logits` [B, V] (a step graph's static output) into `tok`
    [B], `lp` [B] (and `top_v` / `top_i` [B, top_n]), writes them into `next_tok` [B, 1] (the step graph's
    input) and advances its draw index: all in `graph`, replayed by `run` once a step after `load` (on a CPU,
    where there are no graphs, `run` runs the ops)."""

    def __init__(self, logits, next_tok, t: RowTensors, top_n: int, cap: int, bias: bool):
        b, v = logits.shape
        dev = logits.device
        self.logits, self.next_tok, self.top_n = logits, next_tok, top_n
        self.t = t  # the rows' parameters (row_tensors on logits' device), refreshed in place by load()
        self.bias = torch.zeros((b, v), device=dev) if bias else None
        self.u = torch.zeros((b, cap), dtype=torch.float64, device=dev)  # row i's uniform of step s: u[i, s]
        self.step = torch.zeros((1,), dtype=torch.long, device=dev)
        self.tok = torch.zeros((b,), dtype=torch.long, device=dev)
        self.lp = torch.zeros((b,), dtype=torch.float32, device=dev)
        self.top_v = torch.zeros((b, top_n), dtype=torch.float32, device=dev)
        self.top_i = torch.zeros((b, top_n), dtype=torch.long, device=dev)
        self.graph = None
        if dev.type == "cuda":
            from bitnetlm.engine_cuda import capture

            self.graph, _ = capture(self._body)

    def run(self) -> None:
        if self.graph is None:
            self._body()
        else:
            self.graph.replay()

    def _body(self):
        x = self.logits.float()
        if self.bias is not None:
            x = x + self.bias  # (the host sampler adds a row's few biases in place: the same sums)
        u = self.u.index_select(1, self.step)[:, 0]  # [B]
        tokens = choose(x, self.t, u, full=True)
        lp, top_v, top_i = raw_logprobs(self.logits, tokens, self.top_n)
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
        if t.key() != self.t.key():
            raise ValueError(f"GraphSampler: captured for {self.t.key()}, loaded with {t.key()}")
        if t is not self.t:
            for f in _FIELDS:
                getattr(self.t, f).copy_(getattr(t, f))
        if self.bias is not None:
            self.bias.zero_()
            for i, p in enumerate(params):
                if p.logit_bias:
                    ids, vals = bias_tensors(p, self.bias.shape[1], self.bias.device)
                    self.bias[i, ids] = vals
        self.u.zero_()
        for i, (p, r, n) in enumerate(zip(params, randoms, n_draws, strict=True)):
            if not p.greedy and n > 0:
                self.u[i, :n].copy_(r.take(n))
        self.step.zero_()


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
    gs = eng._graphs.pop(key, None)
    if gs is None:
        gs = GraphSampler(st.logits, st.tok, t, top_n, eng.ecfg.max_seq_len, bias)
        old = [k for k in eng._graphs if k[0] == "sampler"]
        for k in old[: max(0, len(old) - MAX_SAMPLERS + 1)]:
            del eng._graphs[k]
    eng._graphs[key] = gs  # (re)inserted last: the dict's order is the order of use
    gs.load(t, params, randoms, n_draws)
    return gs
