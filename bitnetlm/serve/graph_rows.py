"""The serving engine's KV-cache rows on CUDA: the CUDA-graph engine (`bitnetlm.engine_cuda.CudaEngine`) in place
of the model's eager forward and cache.

The serving engine (engine.py) keeps its scheduling: rows, chunked prefill, prompt sharing between the choices
of one request, and one decode forward over rows [0, hi). Only the three tensor operations change:
- prefill: a chunk of one row's prompt, at the position where its cached part ends: the first chunk through
  a captured prefill (`CudaEngine.prefill`), later ones through `CudaEngine.forward` with row0 / start;
- copy_prompt: a prefilled prompt's keys and values into a sibling's row;
- decode: one replay of a captured step over the smallest captured batch that covers rows [0, hi), built for
  the shortest key range that holds their contexts (`attention.key_range`: fewer attention splits while short);
- sample: the decoded rows' next tokens through a captured sampler (`graph_sampler.ContinuousSampler`: one
  replay over the step's logits, each row's draws loaded once, when it starts decoding, that also stores its
  outputs into pinned host memory: `graph_sampler.HostRing`, no copies queued) in place of the host sampler's
  some 30 launches a step; rows with penalties stay on the host sampler (engine.py). A prompt's first
  token comes from the host sampler's kernels over its last logits (`sample_first`: its first draw, as offline
  `generate` takes it), left on the device like a step's tokens.

Pipelining (PIPELINE): a step's sampled tokens stay on the device and feed the next step (`decode`'s carried
rows), which the engine queues before it reads them (`sample_async`, then `collect`), so the host's work on one
step's tokens (detokenizing, stop strings, events to the clients) overlaps the GPU's next step, as in
`generate`'s loop. So do a prompt's first tokens (`sample_first`), so that a request that starts does not drain
the pipeline either. The steps' token and position uploads come from a ring of pinned host rows (`_Staging`).
A row that the tokens read then end (a stop token or string) has decoded one token too many, which nobody
reads: its cache row attends to slots 0..pos only, and a new occupant starts from its prefill.

Every batch size, and each short key range of it, is captured when the server starts, before any row holds a
sequence: a capture's eager warm-up runs write KV slots 0-2 of each row. So is the prefill of the shortest
prompts: a GEMM shape the tuner meets for the first time on a GPU costs seconds of timing, better spent before
/health says ready. For the same reason the scheduler (engine.py) splits only the first prompt of a step, at
`prefill_chunk` boundaries: chunks that continue a prompt (the eager `forward` with a start) then come in few
shapes.

Rows that are free or still prefilling decode a padding token at their next free slot, which their own prefill
or next token overwrites, as in the eager engine.

The engine is the server's own (not the one `generate` caches on the model), so a `generate` call in another
thread never shares its KV cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from bitnetlm.engine_cuda import PREFILL_ALIGN, PREFILL_SHORT
from bitnetlm.generate import reductions

# Queue each step before reading the last one's tokens (engine.py); BITNETLM_SERVE_PIPELINE=0 (benchmarks' A/B):
# read every step's tokens before the next is queued.
PIPELINE = os.environ.get("BITNETLM_SERVE_PIPELINE", "1") != "0"


class _Staging:
    """Pinned host rows for the steps' token and position uploads, a ring of them: a slot is written again only
    once the copies that read it have run (an event; long since, in a ring this deep), so that a step queued
    ahead of the GPU never changes what an earlier one uploads. Saves a step two pinned allocations."""

    def __init__(self, n: int, slots: int = 4):
        self.tok = torch.zeros((slots, n), dtype=torch.long).pin_memory()
        self.pos = torch.zeros((slots, n), dtype=torch.int32).pin_memory()
        self.tok_np, self.pos_np = self.tok.numpy(), self.pos.numpy()  # (numpy fills a row from a list fast)
        self.used = [torch.cuda.Event() for _ in range(slots)]  # (an event never recorded has completed)
        self.i = 0

    def next(self) -> int:
        i, self.i = self.i, (self.i + 1) % len(self.used)
        self.used[i].synchronize()
        return i


@dataclass
class Pending:
    """A queued step's sampled tokens on their way to the host: `collect` reads them."""

    seqs: list
    rows: list[int]  # their rows then (a sequence that ends gives its row back before its last step is read)
    host: list  # tok, lp[, top_i, top_v] [size] pinned host tensors, filled before `done`
    done: torch.cuda.Event
    top_n: int
    ring: tuple | None = None  # (HostRing, the export's number): `host` is that export's slot of the ring


class GraphRows:
    def __init__(self, eng, max_batch: int):
        self.eng = eng
        self.device = eng.device
        from bitnetlm.kernels.triton.attention import key_ranges  # (Triton: only once a CUDA engine exists)

        self.sizes = sorted({min(1 << i, max_batch) for i in range(max_batch.bit_length() + 1)})
        self.logits = None  # the last decode step's logits [size, V] (all of its captured batch)
        self.sampler = None  # graph_sampler.ContinuousSampler over max_batch rows, made on first use
        self.inflight: Pending | None = None  # the queued step whose tokens the host has not read (engine.py)
        self.overlapped = 0  # steps queued before the last one's tokens (or a prompt's first) were read
        self.staging = _Staging(max(self.sizes))
        for b in self.sizes:  # capture now, while no row is in use: every size, and its short-context steps
            for keys in [0, *key_ranges()]:
                eng.logits_state(b, max_keys=keys)
        # and the samplers' kernels, compiled for every batch up to the largest: the host sampler meets any number
        # of prompts ready at once (32 prompts at once waited 0.6-0.9 s for it, docs/PERF_LOG.md stop 57)
        reductions.warm(torch.zeros_like(eng.logits_state(max(self.sizes)).logits))  # [max size, V]
        # and the short prompts' prefills (each length a graph and a cuDNN plan; tuning its GEMMs on a new GPU)
        for tp in (*PREFILL_SHORT, PREFILL_ALIGN):
            if tp < eng.ecfg.max_seq_len:  # (longer ones prefill eagerly: CudaEngine.prefill)
                eng.prefill_state(tp)

    @classmethod
    def create(cls, model, max_batch: int, max_len: int) -> GraphRows | None:
        """The rows over a new engine for `model`, or None when the engine cannot run it (eager serving)."""
        from bitnetlm.generate.graph import build_engine

        eng = build_engine(model, max_batch, max_len, next(model.parameters()).device)
        return None if eng is None else cls(eng, max_batch)

    def prefill(self, row: int, ids: list[int], start: int) -> torch.Tensor:
        """Prompt tokens `ids` at positions start.. into `row` -> float32 logits [V] after the last one."""
        if start == 0:  # a captured prefill (one graph per padded length)
            return self.eng.prefill(ids, row)
        tok = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, T]
        pos = torch.full((1,), start, dtype=torch.int32, device=self.device)
        return self.eng.forward(tok, pos, row0=row, start=start)[0]

    def copy_prompt(self, src: int, dst: int, n: int) -> None:
        for c in self.eng.k_cache + self.eng.v_cache:
            c[dst, :, :n] = c[src, :, :n]

    def decode(self, rows: dict, dec: list, hi: int, carried: tuple = ()) -> torch.Tensor:
        """One step of rows [0, hi): each sequence of `dec` feeds its last token at its next slot, those also in
        `carried` the token the last `sample_async` left on the device; the other rows (free, prefilling) feed
        token 0 at their next free slot -> logits [hi, V]."""
        size = next(s for s in self.sizes if s >= hi)
        toks, at = [0] * size, [0] * size
        for r, s in rows.items():
            if r < size:
                at[r] = min(s.n_cached, self.eng.ecfg.max_seq_len - 1)
        st = self.eng.logits_state(size, max_keys=max(at) + 1)  # a captured one: each size's ranges exist
        for s in dec:
            toks[s.row] = s.tokens[-1]
        for s in carried:
            toks[s.row] = -1  # (its token is the sampler's, below)
        g, i = self.staging, self.staging.next()
        g.tok_np[i, :size], g.pos_np[i, :size] = toks, at
        st.tok.copy_(g.tok[i, :size, None], non_blocking=True)  # [size, 1]
        st.pos.copy_(g.pos[i, :size], non_blocking=True)
        g.used[i].record(torch.cuda.current_stream(self.device))
        if carried:  # the rows of the last sample (all below its batch size) from its output [b, 1]
            nt = self.sampler.next_tok[:size]
            torch.where(st.tok < 0, nt, st.tok, out=st.tok)
        st.graph.replay()
        self.logits = st.logits
        return st.logits[:hi]

    def sample(self, seqs: list) -> tuple[list[int], list[float], list | None, list | None]:
        """The next token of each of `seqs` (sequences of the last `decode`, without penalties) from that step's
        logits, through the captured sampler: (tokens, log-probabilities, top-logprob ids, top log-probabilities;
        the last two None when no row asks for them), each a list in the order of `seqs`."""
        return self.collect(self.sample_async(seqs))[1:]

    def sample_async(self, seqs: list) -> Pending:
        """`sample` queued: its tokens stay on the device for the next `decode`'s carried rows, and their copies
        to the host are queued behind them; `collect` waits for those."""
        self._make_sampler(self.logits)
        rows = {}
        for s in seqs:
            p = s.group.req.params
            rows[s.row] = (s, p, s.generator, p.max_tokens - len(s.generated))  # the draws it may still need
        gs, n = self.sampler.sample(self.logits, rows)  # (on CUDA, as these rows are: n is never None)
        # every row's, picked on the host; the replay stored them into slot n % 2 of its pinned ring itself
        r, k = gs.host, n % 2
        host = [r.tok[k], r.lp[k], *((r.top_i[k], r.top_v[k]) if gs.top_n else ())]
        return self._pending(seqs, [s.row for s in seqs], host, gs.top_n, ring=(r, n))

    def sample_first(self, ready: list) -> Pending:
        """The first token of each (sequence, its prompt's last logits [V]) of `ready`, through the host sampler
        (`sampling.sample`: its one draw of the row's stream, as when it ran synchronously) but left on the
        device, in the captured sampler's `next_tok` rows, for the next `decode` to carry; `collect` reads it."""
        from bitnetlm.generate.sampling import sample

        seqs = [s for s, _ in ready]
        params = [s.group.req.params for s in seqs]
        top_n = max((p.top_logprobs for p in params if p.logprobs), default=0)
        logits = torch.stack([lg for _, lg in ready])  # [R, V]
        out = sample(logits, params, [s.generator for s in seqs], num_top_logprobs=top_n)
        rows = torch.tensor([s.row for s in seqs], dtype=torch.long).pin_memory()
        self._make_sampler(logits).next_tok.index_copy_(
            0, rows.to(self.device, non_blocking=True), out.tokens[:, None]
        )
        sampled = (out.tokens, out.logprobs, *((out.top_ids, out.top_logprobs) if top_n else ()))
        host = [t.to("cpu", non_blocking=True) for t in sampled]  # (pinned: one wait for all, in collect)
        return self._pending(seqs, list(range(len(seqs))), host, top_n)

    def _pending(
        self, seqs: list, rows: list[int], host: list, top_n: int, ring: tuple | None = None
    ) -> Pending:
        """Pinned host tensors `host` that the work queued so far fills (copies, or a ring's export)."""
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return Pending(list(seqs), rows, host, done, top_n, ring)

    def _make_sampler(self, logits: torch.Tensor):
        """The captured sampler, made on first use (for logits [*, V] of this dtype: every step's and prompt's)."""
        from bitnetlm.generate.graph_sampler import ContinuousSampler

        if self.sampler is None:
            b, cap = self.eng.ecfg.max_batch, self.eng.ecfg.max_seq_len
            self.sampler = ContinuousSampler(b, logits.shape[-1], cap, self.device, logits.dtype)
        return self.sampler

    @staticmethod
    def collect(p: Pending) -> tuple[list, list[int], list[float], list | None, list | None]:
        """A queued sample's (sequences, tokens, log-probabilities, top-logprob ids, top log-probabilities; the
        last two None when no row asked for them), each a list in the order of its sequences."""
        p.done.synchronize()
        if p.ring is not None:
            p.ring[0].slot(p.ring[1])  # (raises if the ring's slot was filled again, or never)
        lists = [[v[r] for r in p.rows] for v in (t.tolist() for t in p.host)]
        return (p.seqs, lists[0], lists[1], *(lists[2:] if p.top_n else (None, None)))
