"""The CUDA runner: the rows of a `CudaEngine` (fused Triton layers, each step a captured CUDA graph).

- prefill: a chunk of one row's prompt; from position 0 a captured prefill (`CudaEngine.prefill`), later chunks
  the engine's eager forward at their start position.
- decode: one replay of a captured step over the smallest captured batch that covers rows [0, hi), built for
  the shortest key range that holds the rows' contexts (`attention.key_range`: fewer attention splits while
  short). Rows that are not decoding (free, prefilling) feed a padding token at their next free slot, which their
  prefill or next token overwrites.
- sample: a prompt's first token from the host sampler's kernels over its last logits (one draw of its stream,
  as offline `generate` takes it); a step's tokens through a captured sampler (`graph_sampler.ContinuousSampler`:
  each row's draws loaded once, when its occupant joins). Rows with penalties take the host sampler: those need
  their output tokens on the host.

Pipelining (carry=True): the sampled tokens stay on the device and feed the next decode (its rows given None as
their token); their copies to the host are stored by the sampler's graph itself into pinned memory
(`graph_sampler.HostRing`) and read by `collect` after an event, so the host's work on one step (detokenizing,
stop strings, events to the clients) overlaps the GPU's next step. A row that those tokens then end has decoded
one token too many, which nobody reads: its row attends to positions 0..pos only, and a new occupant starts from
its prefill.

Steady decoding (every row of a captured batch decoding its own carried token, the same occupants as the step
before, as in `generate`'s loop): one replay of a graph that holds the step and its sampler together
(`GraphSampler.step_graph`), with the positions advanced on the device, instead of the uploads, the step's
replay and the sampler's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bitnetlm.models.cache import shift_rows
from bitnetlm.runtime.base import Pending, Sampled, SampleSpec, host_sample
from bitnetlm.runtime.config import KV_CACHE_DTYPES, RuntimeConfig
from bitnetlm.runtime.cuda.engine import CudaEngine, EngineConfig
from bitnetlm.runtime.cuda.graphs import PREFILL_ALIGN, PREFILL_SHORT
from bitnetlm.sampling import reductions, sample


class _Staging:
    """Pinned host rows for the steps' token and position uploads, a ring of them: a slot is written again only
    once the copies that read it have run (an event), so that a step queued ahead of the GPU never changes what
    an earlier one uploads."""

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


def verify_span(n: int, start: int, max_seq_len: int) -> tuple[int, int]:
    """(tokens, cache slots) of the captured verify of n tokens at positions start..start+n-1: n padded to a
    power of two (at least 2) and the slots to one (at least 64), so that a handful of graphs serve every
    draft length and context; (0, 0) where the padded tokens would pass the context's end."""
    t = max(2, 1 << (n - 1).bit_length())
    keys = min(max(64, 1 << (start + t - 1).bit_length()), max_seq_len)
    return (t, keys) if start + t <= keys else (0, 0)


def weights_kind(model) -> str | None:
    """ "ternary" when every projection is a BitLinear, "dense" when none is, None otherwise (mixed)."""
    from bitnetlm.quant.bitlinear import BitLinear

    projs = []
    for blk in model.layers:
        at, mlp = blk.self_attn, blk.mlp
        projs += [at.q_proj, at.k_proj, at.v_proj, at.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    n = sum(isinstance(m, BitLinear) for m in projs)
    return "ternary" if n == len(projs) else "dense" if n == 0 else None


def engine_config(
    model, config: RuntimeConfig, rows: int, max_seq_len: int, weights: str | None = None, plan=None
) -> EngineConfig:
    """The CudaEngine's options for `model` run as `config` says: its activation dtype, the int8 head for
    head_dtype="int8" (any other value keeps the float head), the KV-cache dtype, a paged cache of kv_tokens
    positions; weights: "ternary" or "dense" (default: what the model's projections are)."""
    kind = weights or weights_kind(model)
    if kind is None:
        raise TypeError("the projections mix BitLinear and full-precision layers")
    return EngineConfig(
        max_batch=rows,
        max_seq_len=max_seq_len,
        dtype=model.embed_tokens.weight.dtype,
        weights=kind,
        head="int8" if config.head_dtype == "int8" else "fp",
        kv_dtype=KV_CACHE_DTYPES[config.kv_cache_dtype],
        kv_blocks=max(1, config.kv_tokens // config.kv_block_size) if config.kv_tokens else 0,
        kv_block_size=config.kv_block_size,
        plan=plan,
    )


class CudaRunner:
    pipelined = True
    batched_prefill = False
    ring = None  # (the captured engine runs LLaMA-shaped layers: no sliding windows)

    def __init__(self, model, config: RuntimeConfig, rows: int, max_seq_len: int, plan=None):
        from bitnetlm.kernels.triton.attention import key_range  # (Triton: only once a CUDA engine exists)

        if not all(hasattr(model, a) for a in ("layers", "embed_tokens", "norm", "inv_freq", "config")):
            raise TypeError(f"{type(model).__name__} is not a bitnetlm CausalLM")
        if model.config.family != "llama":
            raise TypeError(f"the CUDA-graph engine runs LLaMA/BitNet layers, not {model.config.arch}")
        self.config = config
        self.device = next(model.parameters()).device
        ecfg = engine_config(model, config, rows, max_seq_len, plan=plan)
        self.eng = CudaEngine.from_model(model, ecfg, device=self.device, share=True)
        self.rows, self.max_seq_len = rows, max_seq_len
        self.vocab_size = model.config.vocab_size
        self._key_range = key_range
        self.sizes = sorted({min(1 << i, rows) for i in range(rows.bit_length() + 1)})
        self.lengths = [0] * rows
        self.logits = None  # the last decode's logits [size, V]
        self.sampler = None  # graph_sampler.ContinuousSampler over every row, made on first use
        self.staging = _Staging(max(self.sizes))
        self._steady: tuple | None = (
            None  # (graph key, positions after it, step state, b) of the last steady replay
        )
        self._fused: dict = {}  # steady graphs: (size, keys, sampler kind) -> GraphSampler with step_graph
        self._kind: tuple | None = None  # (sampler version, b, its kind) for the steady graphs' key
        # row -> [owner, key, draws left] of its loaded uniforms (_occupants)
        self._draws: dict[int, list] = {}

    def warm(self) -> None:
        """Capture every batch size and short key range now, while no row is in use (a capture's eager warm-up
        runs write KV slots 0-2 of each row), compile the samplers' kernels for every batch, and capture the short
        prompts' prefills: a server does this before it says it is ready, so no request waits for it."""
        from bitnetlm.kernels.triton.attention import key_ranges

        for b in self.sizes:
            for keys in [0, *key_ranges(self.eng.plan)]:
                self.eng.logits_state(b, max_keys=keys)
        reductions.warm(torch.zeros_like(self.eng.logits_state(max(self.sizes)).logits))
        for tp in (*PREFILL_SHORT, PREFILL_ALIGN):
            if tp < self.eng.ecfg.max_seq_len:  # (longer ones prefill eagerly: CudaEngine.prefill)
                self.eng.prefill_state(tp)

    # ---- rows -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, row: int, tokens: Sequence[int], start: int = 0) -> torch.Tensor:
        self._unsteady()
        if start == 0:  # a captured prefill (one graph per padded length)
            out = self.eng.prefill(list(tokens), row)
        else:
            tok = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # [1, T]
            pos = torch.full((1,), start, dtype=torch.int32, device=self.device)
            out = self.eng.forward(tok, pos, row0=row, start=start)[0]
        self.lengths[row] = start + len(tokens)
        return out

    @torch.no_grad()
    def verify(self, row: int, tokens: Sequence[int], start: int) -> torch.Tensor:
        """Through a captured graph of the tokens padded to a power of two, over a power-of-two span of the
        cache (`verify_span`); the pad tokens' keys land past the row's length, where nothing reads them."""
        self._unsteady()
        if start == 0:
            raise ValueError("verify continues a cached prompt (start > 0)")
        n = len(tokens)
        t, keys = verify_span(n, start, self.max_seq_len)
        if t == 0:  # (the padded span would pass the context's end: eagerly, at its exact length)
            tok = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # [1, T]
            pos = torch.full((1,), start, dtype=torch.int32, device=self.device)
            out = self.eng.forward(tok, pos, row0=row, start=start, last_only=False)  # [T, V]
        else:
            host = torch.zeros((t + 1,), dtype=torch.long)
            host[:n] = torch.tensor(list(tokens), dtype=torch.long)
            host[t] = start
            tok, pos = self.eng.verify_inputs(t)
            tok.copy_(host[None, :t].to(self.device))
            pos.copy_(host[t:].to(self.device, torch.int32))
            st = self.eng.verify_state(row, t, keys)  # (captured on first use, from these inputs)
            st.graph.replay()
            out = st.logits[:n].clone()  # (the graphs share a memory pool: the next replay may reuse it)
        self.lengths[row] = start + n
        return out

    def truncate(self, row: int, n: int) -> None:
        self.lengths[row] = min(self.lengths[row], n)  # (the row attends to positions 0..pos only)

    @torch.no_grad()
    def shift(self, row: int, keep: int, drop: int) -> None:
        # (queued on the stream after the steps that wrote the row; the next decode uploads the lower positions)
        self._unsteady()
        n, e = self.lengths[row], self.eng
        shift_rows(e.k_cache, e.v_cache, row, n, keep, drop, e.cos[drop], e.sin[drop])
        self.lengths[row] = n - drop

    def prefill_many(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.stack([self.prefill(r, p) for r, p in zip(rows, prompts, strict=True)])

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self._unsteady()
        for c in self.eng.k_cache + self.eng.v_cache:
            c[dst, :, :n] = c[src, :, :n]
        self.lengths[dst] = n

    def reset(self, row: int, keep: int = 0) -> None:
        self.lengths[row] = keep  # the row attends to positions 0..pos only: nothing to clear

    # ---- decode ---------------------------------------------------------------------------------------
    def decode(
        self, rows: Sequence[int], tokens: Sequence[int | None], positions: Sequence[int]
    ) -> torch.Tensor:
        self._decode(rows, tokens, positions)
        return self.logits[list(rows)]

    @torch.no_grad()
    def _decode(self, rows: Sequence[int], tokens: Sequence[int | None], positions: Sequence[int]) -> None:
        self._unsteady()
        hi = max(rows) + 1
        size = next(s for s in self.sizes if s >= hi)
        at = [min(n, self.max_seq_len - 1) for n in self.lengths[:size]]
        toks = [0] * size
        for r, t, p in zip(rows, tokens, positions, strict=True):
            if p >= self.max_seq_len:
                raise ValueError(f"position {p} exceeds the runner's context of {self.max_seq_len}")
            at[r], toks[r] = p, -1 if t is None else t
        st = self.eng.logits_state(size, max_keys=max(at) + 1)
        g, i = self.staging, self.staging.next()
        g.tok_np[i, :size], g.pos_np[i, :size] = toks, at
        st.tok.copy_(g.tok[i, :size, None], non_blocking=True)  # [size, 1]
        st.pos.copy_(g.pos[i, :size], non_blocking=True)
        g.used[i].record(torch.cuda.current_stream(self.device))
        if any(t is None for t in tokens):  # carried rows: the last sample's tokens, still on the device
            nt = self._make_sampler().next_tok[:size]
            torch.where(st.tok < 0, nt, st.tok, out=st.tok)
        st.graph.replay()
        for r, p in zip(rows, positions, strict=True):
            self.lengths[r] = p + 1
        self.logits = st.logits

    def decode_sample(self, rows, tokens, positions, specs: Sequence[SampleSpec], carry: bool) -> Pending:
        """decode, then sample its logits; a steady step (see the module docstring) is one replay."""
        if carry and self._steady_ok(rows, tokens, specs):
            return self._steady_step(rows, positions, specs)
        self._decode(rows, tokens, positions)
        return self.sample(specs, carry=carry)

    # ---- sampling -------------------------------------------------------------------------------------
    def sample(
        self, specs: Sequence[SampleSpec], logits: torch.Tensor | None = None, carry: bool = False
    ) -> Pending:
        if logits is not None:  # prompts' first tokens: the host sampler's kernels
            return (
                self._sample_first(specs, logits)
                if carry
                else Pending(list(specs), host_sample(logits, specs))
            )
        host = [s for s in specs if s.on_host]
        if host and carry:
            raise ValueError(
                "rows with penalties or a structured-output mask need their tokens on the host: sample them "
                "with carry=False"
            )
        if not carry:
            if len(host) == len(specs) or all(s.params.greedy for s in specs):
                return Pending(list(specs), host_sample(self.logits[[s.row for s in specs]], specs))
            cap = [s for s in specs if not s.on_host]
            got = {}
            if host:
                got.update(
                    zip((s.row for s in host), _rows(host_sample(self.logits[[s.row for s in host]], host)))
                )
            got.update(zip((s.row for s in cap), _rows(self.collect(self._sample_async(cap)))))
            return Pending(list(specs), _merge([got[s.row] for s in specs]))
        return self._sample_async(specs)

    def _sample_async(self, specs: Sequence[SampleSpec]) -> Pending:
        """The captured sampler over the last decode's logits; its outputs reach pinned host memory by the graph
        itself (slot n % 2 of its HostRing), read by `collect`."""
        cs = self._make_sampler()
        gs, n = cs.sample(self.logits, self._occupants(specs))
        r, k = gs.host, n % 2
        host = [r.tok[k], r.lp[k], *((r.top_i[k], r.top_v[k]) if gs.top_n else ())]
        return self._pending(specs, [s.row for s in specs], host, gs.top_n, ring=(r, n))

    def _sample_first(self, specs: Sequence[SampleSpec], logits: torch.Tensor) -> Pending:
        """The first token of each spec's row from its prompt's last logits [R, V], left on the device in the
        captured sampler's `next_tok` rows for the next decode to carry."""
        self._unsteady()
        params = [s.params for s in specs]
        top_n = max((p.top_logprobs for p in params), default=0)
        out = sample(logits, params, [s.random for s in specs], num_top_logprobs=top_n)
        rows = torch.tensor([s.row for s in specs], dtype=torch.long).pin_memory()
        self._make_sampler().next_tok.index_copy_(
            0, rows.to(self.device, non_blocking=True), out.tokens[:, None]
        )
        sampled = (out.tokens, out.logprobs, *((out.top_ids, out.top_logprobs) if top_n else ()))
        host = [t.to("cpu", non_blocking=True) for t in sampled]  # (pinned: one wait for all, in collect)
        return self._pending(specs, list(range(len(specs))), host, top_n)

    def _pending(self, specs, at: list[int], host: list, top_n: int, ring=None) -> Pending:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return Pending(
            list(specs), None, {"at": at, "host": host, "top_n": top_n, "done": done, "ring": ring}
        )

    def collect(self, pending: Pending) -> Sampled:
        if pending.result is not None:
            return pending.result
        d = pending.device
        d["done"].synchronize()
        if d["ring"] is not None:
            d["ring"][0].slot(d["ring"][1])  # (raises if the ring's slot was filled again, or never)
        lists = [[v[r] for r in d["at"]] for v in (t.tolist() for t in d["host"])]
        pending.result = Sampled(*lists[:2], *(lists[2:] if d["top_n"] else (None, None)))
        return pending.result

    def _occupants(self, specs: Sequence[SampleSpec]) -> dict[int, tuple]:
        """The captured sampler's rows for one sampling of `specs`: (occupant key, params, stream, draws to load).
        A row holds at most max_seq_len uniforms; an occupant that samples more (a context-shifting sequence)
        gets a new key when they run out, which loads the next ones of its stream."""
        out = {}
        for s in specs:
            d = self._draws.get(s.row)
            if d is None or d[0] is not s.owner or d[2] == 0:
                d = self._draws[s.row] = [s.owner, object(), min(s.budget, self.max_seq_len)]
            out[s.row] = (d[1], s.params, s.random, d[2])
            d[2] -= 1
        return out

    def _make_sampler(self):
        from bitnetlm.runtime.cuda.graph_sampler import ContinuousSampler

        if self.sampler is None:
            dt = self.eng.logits_state(self.sizes[0]).logits.dtype
            self.sampler = ContinuousSampler(self.rows, self.vocab_size, self.max_seq_len, self.device, dt)
        return self.sampler

    # ---- steady decoding: step and sampler in one replay ---------------------------------------------
    def _steady_ok(self, rows, tokens, specs) -> bool:
        b = len(rows)
        return (
            b in self.sizes
            and list(rows) == list(range(b))
            and all(t is None for t in tokens)
            and not any(s.on_host for s in specs)
        )

    def _steady_step(self, rows, positions, specs) -> Pending:
        from bitnetlm.runtime.cuda.graph_sampler import GraphSampler

        b, positions = len(rows), list(positions)
        cs = self._make_sampler()
        changed = cs.load(self._occupants(specs))
        if changed or self._kind is None or self._kind[:2] != (cs.version, b):
            self._kind = (cs.version, b, *cs.kind(b))  # (row_tensors: uploads, so only when rows change)
        t, bias, top_n = self._kind[2:]
        top = max(p + s.budget + 1 for p, s in zip(positions, specs, strict=True))
        keys = self._key_range(b, min(top, self.max_seq_len), self.eng.plan)  # (a shifting row stays inside)
        key = (b, keys, t.key(), bias, top_n)
        if self._steady is not None and self._steady[:2] != (key, positions):
            self._unsteady()
        st = self.eng.logits_state(b, max_keys=keys)
        gs = self._fused.get(key)
        if gs is None:
            gs = GraphSampler(st.logits, st.tok, t, top_n, self.max_seq_len, bias, cs.draws.rows(b))
            st.pos.zero_()  # the capture's eager warm-up runs step from position 0
            with self.eng.kept_slots(b):
                gs.step_graph(st)  # captured now, before it is replayed
            gs.host.reset()  # (and the warm-up runs' exports)
            self._fused[key] = gs
        if changed or self._steady is None:
            gs.set_params(t)
        if self._steady is None:  # entering: the carried tokens and the positions into the step's input
            st.tok.copy_(cs.next_tok[:b])
            st.pos.copy_(torch.tensor(positions, dtype=torch.int32).pin_memory(), non_blocking=True)
        gs.step_graph(st).replay()
        n, gs.host.queued = gs.host.queued, gs.host.queued + 1
        for r, p in zip(rows, positions, strict=True):
            self.lengths[r] = p + 1
        self._steady = (key, [p + 1 for p in positions], st, b)
        self.logits = st.logits
        r, k = gs.host, n % 2
        host = [r.tok[k], r.lp[k], *((r.top_i[k], r.top_v[k]) if top_n else ())]
        return self._pending(specs, list(rows), host, top_n, ring=(r, n))

    def _unsteady(self) -> None:
        """Leaving steady decoding: the carried tokens move from the step's input to the sampler's rows."""
        if self._steady is not None:
            _, _, st, b = self._steady
            self._make_sampler().next_tok[:b].copy_(st.tok)
            self._steady = None


def _rows(s: Sampled) -> list[tuple]:
    n = len(s.tokens)
    ids = s.top_ids or [None] * n
    lps = s.top_logprobs or [None] * n
    return list(zip(s.tokens, s.logprobs, ids, lps, strict=True))


def _merge(rows: list[tuple]) -> Sampled:
    tok, lp, ids, lps = (list(c) for c in zip(*rows, strict=True))
    top = any(i is not None for i in ids)
    return Sampled(tok, lp, ids if top else None, lps if top else None)
