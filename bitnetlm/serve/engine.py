"""Continuous-batching engine: one worker thread owns the model and a static KV cache.

Every generated sequence (one choice of one request) holds one batch row of the cache from admission to finish.
Each engine step:
  1. applies cancellations (queued sequences are dropped, running ones give their row back at once);
  2. admits waiting sequences into free rows (lowest row first, so the rows in use stay packed at the top);
  3. prefills admitted prompts one row at a time, `prefill_chunk` tokens per step in total, through a
     one-row view of the shared cache (a slice, so the forward writes straight into the shared tensors);
  4. decodes one token for every row whose prompt is in the cache, in one forward over rows [0, hi) where
     rows that are free or still prefilling take a masked padding token. On CUDA-graph rows the step is queued
     before the host reads the previous step's tokens, which it then sends (graph_rows.py, Pipelining).
Callers (the HTTP layer) never touch tensors: they submit token ids + sampling settings and receive plain
Python events (text deltas, token ids, logprobs, usage) through a callback that the worker invokes.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bitnetlm.generate.graph import graph_sampler_on
from bitnetlm.generate.sampling import RowRandom, sample
from bitnetlm.serve.metrics import Metrics
from bitnetlm.serve.requests import (  # (the request and event types, also imported from here)
    Chunk,
    ContextTooLong,
    EngineClosed,
    Failed,
    Finished,
    GenerationRequest,
    QueueFull,
    _Group,
    _Seq,
)

log = logging.getLogger("bitnetlm.serve")


@dataclass
class EngineConfig:
    max_batch: int = 8  # KV-cache rows = sequences decoded together
    max_queue: int = 64  # sequences allowed to wait for a row; beyond that submit() raises QueueFull
    max_model_len: int | None = (
        None  # prompt + completion tokens; default: the model's max_position_embeddings
    )
    prefill_chunk: int = 512  # prompt tokens prefilled per engine step (bounds decode stalls)
    enforce_eager: bool = False  # CUDA: the model's eager forward, not the graph engine (graph_rows.py)
    retry_after_s: int = 1  # Retry-After sent with 429


class Engine:
    """Owns `model` (a bitnetlm CausalLM) on its own thread; `submit`/`cancel` are thread-safe."""

    def __init__(self, model, tokenizer, config: EngineConfig | None = None, model_name: str = "model"):
        self.model, self.tokenizer = model, tokenizer
        self.config = cfg = config or EngineConfig()
        mcfg = model.config
        self.max_model_len = cfg.max_model_len or mcfg.max_position_embeddings
        if cfg.max_batch < 1:
            raise ValueError(f"EngineConfig.max_batch must be >= 1, found {cfg.max_batch}")
        self.device = next(model.parameters()).device
        self.graph = None  # graph_rows.GraphRows: the CUDA-graph engine's rows (CUDA, unless enforce_eager)
        if self.device.type == "cuda" and not cfg.enforce_eager:
            from bitnetlm.serve.graph_rows import GraphRows

            self.graph = GraphRows.create(model, cfg.max_batch, self.max_model_len)
        self.cache = None if self.graph else model.new_cache(cfg.max_batch, self.max_model_len)
        self.vocab_size = mcfg.vocab_size
        eos = set(mcfg.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", []) or [])
        self.eos_ids = {i for i in eos if i is not None}
        self.metrics = Metrics(model_name)
        self.metrics.gauges["num_requests_running"] = lambda: self._count_groups(running=True)
        self.metrics.gauges["num_requests_waiting"] = lambda: self._count_groups(running=False)
        self.metrics.gauges["kv_rows_in_use"] = lambda: self.config.max_batch - len(self._free_rows)

        self._lock = threading.Condition()
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._groups: dict[int, _Group] = {}
        self._cancel: set[int] = set()
        self._cancel_step: dict[int, int] = {}  # gid -> engine step when cancel() was called
        self.max_cancel_lag_steps = 0  # most steps any cancellation waited before its rows were freed
        self._ids = itertools.count(1)
        self._free_rows = list(range(cfg.max_batch))  # kept sorted: lowest row first
        self._rows: dict[int, _Seq] = {}  # row -> running sequence (worker thread only)
        self._accepting = True
        self._stop = False
        self.steps = 0
        self.batched_prefills = 0  # forwards that prefilled several prompts at once
        self._thread = threading.Thread(target=self._run, name="bitnet-engine", daemon=True)
        self._thread.start()

    # ---- public API (any thread) ---------------------------------------------------------------
    def submit(self, req: GenerationRequest, sink: Callable[[Any], None]) -> int:
        """Queue `req`; `sink(event)` is called from the engine thread with Chunk / Finished / Failed events."""
        n_prompt = len(req.prompt_ids)
        if n_prompt == 0:
            raise ContextTooLong("the prompt is empty (0 tokens)")
        if any(not 0 <= t < self.vocab_size for t in req.prompt_ids):
            bad = next(t for t in req.prompt_ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        p = req.params
        if req.n < 1 or p.max_tokens < 1:
            raise ValueError(f"n and max_tokens must be >= 1, found n={req.n}, max_tokens={p.max_tokens}")
        if n_prompt + p.max_tokens > self.max_model_len or n_prompt >= self.max_model_len:
            raise ContextTooLong(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n_prompt + p.max_tokens} tokens ({n_prompt} in the prompt, {p.max_tokens} for the "
                "completion). Please reduce the length of the prompt or the completion."
            )
        if p.logit_bias and any(not 0 <= t < self.vocab_size for t in p.logit_bias):
            raise ValueError(
                f"logit_bias token ids must be in [0, {self.vocab_size}), found {sorted(p.logit_bias)}"
            )
        max_tokens = p.max_tokens
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
        with self._lock:
            if not self._accepting:
                raise EngineClosed("server is shutting down")
            must_wait = len(self._waiting) + req.n - len(self._free_rows)
            if must_wait > self.config.max_queue:
                self.metrics.inc("request_rejected_total")
                raise QueueFull(self.config.retry_after_s)
            g = _Group(next(self._ids), req, sink, max_tokens)
            for i in range(req.n):
                s = _Seq(g, i, self._new_detok(p.skip_special_tokens), stop_ids)
                gen = None  # unseeded: torch's global RNG
                if p.seed is not None:
                    # choice i of a seeded request draws from seed + i (choice 0 == the offline generate run)
                    # (in BLOCKs, as offline generate draws them: sampling.RowRandom)
                    gen = torch.Generator(device=self.device).manual_seed(int(p.seed) + i)
                s.generator = RowRandom(gen, self.device)
                g.seqs.append(s)
                self._waiting.append(s)
            self._groups[g.id] = g
            self._lock.notify_all()
        return g.id

    def cancel(self, gid: int) -> None:
        """Drop request `gid` (client went away): queued sequences leave the queue, running ones free their row."""
        with self._lock:
            if gid in self._groups:
                self._cancel.add(gid)
                self._cancel_step.setdefault(gid, self.steps)
                self._lock.notify_all()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting; with drain=True let queued and running requests finish first."""
        with self._lock:
            self._accepting = False
            if not drain:
                self._cancel.update(self._groups)
            self._lock.notify_all()
            deadline = None if timeout is None else time.monotonic() + timeout
            while self._groups and self._thread.is_alive():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self._cancel.update(self._groups)
                    self._lock.notify_all()
                    break
                self._lock.wait(0.05 if left is None else min(left, 0.05))
            self._stop = True
            self._lock.notify_all()
        self._thread.join(timeout=30)

    @property
    def accepting(self) -> bool:
        return self._accepting

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "running": self._count_groups(True, locked=True),
                "waiting": self._count_groups(False, locked=True),
                "rows_in_use": self.config.max_batch - len(self._free_rows),
                "steps": self.steps,
                "max_cancel_lag_steps": self.max_cancel_lag_steps,
            }

    # ---- helpers -------------------------------------------------------------------------------
    def _count_groups(self, running: bool, locked: bool = False) -> int:
        def count():
            waiting_g = {s.group.id for s in self._waiting}
            if running:
                return sum(1 for g in self._groups if g not in waiting_g)
            return len(waiting_g)

        if locked:
            return count()
        with self._lock:
            return count()

    def _new_detok(self, skip_special: bool):
        from bitnetlm.generate.detok import StreamDetokenizer

        return StreamDetokenizer(self.tokenizer, skip_special_tokens=skip_special)

    def _emit(self, g: _Group, ev) -> None:
        try:
            g.sink(ev)
        except Exception:  # a broken sink must not kill the engine
            log.exception("engine: event sink failed for request %d", g.id)

    def _release(self, s: _Seq) -> None:
        if s.row is not None:
            self._reset_row(s.row)
            del self._rows[s.row]
            with self._lock:
                self._free_rows.append(s.row)
                self._free_rows.sort()
            s.row = None

    def _finish_group_if_done(self, g: _Group) -> None:
        if g.remaining == 0 and not g.cancelled:
            with self._lock:
                self._groups.pop(g.id, None)
                self._lock.notify_all()
            self.metrics.observe("e2e_request_latency_seconds", time.perf_counter() - g.arrival)
            self.metrics.finished(g.seqs[0].finish_reason or "stop")
            self._emit(g, Finished(len(g.req.prompt_ids), g.completion_tokens))

    # ---- worker --------------------------------------------------------------------------------
    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._lock:
                    while not (self._stop or self._cancel or self._waiting or self._rows):
                        self._lock.wait()
                    if self._stop:
                        break
                    cancels, self._cancel = self._cancel, set()
                    cancelled = self._apply_cancels(cancels)
                    admitted = self._admit()
                for g in cancelled:  # every submitted request ends with Finished or Failed
                    self._emit(g, Failed("request cancelled", status=499))
                try:
                    self._step(admitted)
                except Exception as e:  # fail the running requests, keep serving
                    log.error("engine step failed:\n%s", traceback.format_exc())
                    self._fail_running(f"internal error during generation: {type(e).__name__}: {e}")
        with self._lock:
            self._lock.notify_all()

    def _apply_cancels(self, gids: set[int]) -> list[_Group]:  # lock held
        if not gids:
            return []
        out = []
        self._waiting = collections.deque(s for s in self._waiting if s.group.id not in gids)
        for gid in gids:
            asked = self._cancel_step.pop(gid, self.steps)
            self.max_cancel_lag_steps = max(self.max_cancel_lag_steps, self.steps - asked)
            g = self._groups.pop(gid, None)
            if g is None:
                continue
            g.cancelled = True
            out.append(g)
            self.metrics.inc("request_cancelled_total")
            for s in g.seqs:
                s.done = True
                if s.row is not None:
                    self._reset_row(s.row)
                    del self._rows[s.row]
                    self._free_rows.append(s.row)
                    s.row = None
        self._free_rows.sort()
        self._lock.notify_all()
        return out

    def _admit(self) -> list[_Seq]:  # lock held
        out = []
        while self._waiting and self._free_rows:
            s = self._waiting.popleft()
            s.row = self._free_rows.pop(0)
            self._reset_row(s.row)
            self._rows[s.row] = s
            out.append(s)
        return out

    def _fail_running(self, message: str) -> None:
        if self.graph is not None:
            self.graph.inflight = None  # (its sequences fail below)
        groups = {s.group.id: s.group for s in self._rows.values()}
        for s in list(self._rows.values()):
            s.done = True
            self._release(s)
        for g in groups.values():
            with self._lock:
                self._groups.pop(g.id, None)
                self._lock.notify_all()
            g.cancelled = True
            self._emit(g, Failed(message))

    def _reset_row(self, row: int) -> None:
        if self.cache is not None:  # the graph engine attends to slots 0..pos only: nothing to invalidate
            self.cache.reset([row])

    def _view(self, lo: int, hi: int):
        """A KVCache over rows [lo, hi): slices share storage, so writes land in the engine's cache."""
        c = self.cache
        v = object.__new__(type(c))
        v.k = [t[lo:hi] for t in c.k]
        v.v = [t[lo:hi] for t in c.v]
        v.valid = c.valid[lo:hi]
        return v

    def _step(self, admitted: list[_Seq]) -> None:
        self.steps += 1
        budget = self.config.prefill_chunk
        ready: list[tuple[_Seq, torch.Tensor]] = []  # sequences with logits for their next token
        # prefill: FIFO over rows whose prompt is not fully cached yet
        plan: list[tuple[_Seq, int]] = []  # (sequence, prompt tokens to prefill now)
        for s in sorted(self._rows.values(), key=lambda s: (s.group.arrival, s.index)):
            if budget <= 0:
                break
            todo = s.n_prompt - s.n_cached
            if todo <= 0 or (s.n_cached == 0 and self._sibling_prefilling(s, plan)):
                continue  # done, or a sibling's prefill will be copied into this row
            c = min(todo, budget)
            if self.graph is not None and c < todo and plan:
                break  # graph rows split only the step's first prompt, at chunk boundaries (GraphRows.prefill)
            budget -= c
            plan.append((s, c))
        # fresh prompts that fit whole go through one batched forward (left-padded, like batch_generate)
        # (graph rows prefill each prompt in one replay of its own)
        whole = [s for s, c in plan if s.n_cached == 0 and c == s.n_prompt] if self.graph is None else []
        batch: list[_Seq] = []
        for s in whole:
            if (len(batch) + 1) * max(
                [t.n_prompt for t in batch] + [s.n_prompt]
            ) <= self.config.prefill_chunk:
                batch.append(s)
        if len(batch) > 1:
            for s, lg in zip(batch, self._prefill_batch(batch), strict=True):
                ready.append((s, lg))
                ready += [(t, lg) for t in self._share_prompt(s)]
        in_batch = {id(s) for s in batch} if len(batch) > 1 else set()
        for s, c in plan:
            if id(s) in in_batch:
                continue
            chunk = s.tokens[s.n_cached : s.n_cached + c]
            if self.graph is not None:
                last = self.graph.prefill(s.row, chunk, s.n_cached)  # [V]
            else:
                ids = torch.tensor([chunk], device=self.device)  # [1, c]
                pos = torch.arange(s.n_cached, s.n_cached + c, device=self.device)[None]  # [1, c]
                logits = self.model(ids, positions=pos, cache=self._view(s.row, s.row + 1), last_only=True)
                last = logits[0, -1]
            s.n_cached += c
            self.metrics.inc("prompt_tokens_total", c)
            if s.n_cached == s.n_prompt:
                ready.append((s, last))
                ready += [(t, last) for t in self._share_prompt(s)]
        if self.graph is not None:  # (which samples the prompts' first tokens: on the device, pipelined)
            self._graph_decode(self._decoding(), ready)
            return
        if ready:
            self._sample_and_emit(ready)
        dec = self._decoding()
        if not dec:
            return
        hi = max(s.row for s in dec) + 1
        ids = torch.zeros(hi, 1, dtype=torch.long)
        pos = torch.zeros(hi, 1, dtype=torch.long)
        mask = torch.zeros(hi, 1, dtype=torch.bool)
        for r in range(hi):
            s = self._rows.get(r)
            if s is None:
                continue
            # padding goes to the row's next free slot: masked now, overwritten by the row's next real token
            pos[r, 0] = s.n_cached
        for s in dec:
            ids[s.row, 0] = s.tokens[-1]
            mask[s.row, 0] = True
        dev = self.device
        logits = self.model(
            ids.to(dev),
            positions=pos.to(dev),
            cache=self._view(0, hi),
            input_mask=mask.to(dev),
            last_only=True,
        )  # [hi, 1, V]
        for s in dec:
            s.n_cached += 1
        self._sample_and_emit([(s, logits[s.row, -1]) for s in dec])

    def _decoding(self) -> list[_Seq]:
        """The rows to decode: every one with exactly one pending (uncached) token, in row order."""
        return [s for s in self._rows.values() if not s.done and s.n_cached == len(s.tokens) - 1]

    def _graph_decode(self, dec: list[_Seq], first: list[tuple[_Seq, torch.Tensor]]) -> None:
        """The decode of CUDA-graph rows: `dec`, the sequences of the step in flight that go on, and those of
        `first` (a prompt's last logits: its first token, sampled on the device by the host sampler's kernels,
        `GraphRows.sample_first`) are queued before the host reads the tokens of that step or of `first`
        (graph_rows.py, Pipelining). Rows with penalties need every step's outputs on the host (the host sampler):
        then each step's tokens are read before the next is queued."""
        from bitnetlm.serve import graph_rows

        g = self.graph
        fly = g.inflight
        carried = (
            [s for s in fly.seqs if not s.done and len(s.generated) + 1 < s.group.max_tokens] if fly else []
        )
        firsts = [s for s, _ in first]
        if (
            graph_rows.PIPELINE
            and graph_sampler_on()
            and not any(s.group.req.params.needs_penalties for s in dec + carried + firsts)
        ):
            pf = g.sample_first(first) if first else None
            carried += [s for s in firsts if s.group.max_tokens > 1]
            run = dec + carried
            if run:
                g.decode(self._rows, run, max(s.row for s in run) + 1, carried)
                for s in run:
                    s.n_cached += 1
                g.inflight = g.sample_async(run)
                g.overlapped += fly is not None or pf is not None
            # the last step's tokens out while the GPU runs this one (a row they end wasted its token here)
            if fly is not None:
                if not run:
                    g.inflight = None
                self._emit_collected(g.collect(fly))
            if pf is not None:
                self._emit_collected(g.collect(pf))
            return
        if first:  # the host sampler, then their first tokens decode below
            self._sample_and_emit(first)
            dec = self._decoding()
        if fly is not None:  # read the step in flight first: its rows decode below
            g.inflight = None
            self._emit_collected(g.collect(fly))
            dec = self._decoding()
        if not dec:
            return
        logits = g.decode(self._rows, dec, max(s.row for s in dec) + 1)  # [hi, V]
        for s in dec:
            s.n_cached += 1
        if not graph_sampler_on() or all(s.group.req.params.greedy for s in dec):
            # (all greedy: the host's argmax is as fast, benchmarks/serve_load.py; greedy rows draw nothing)
            self._sample_and_emit([(s, logits[s.row]) for s in dec])
            return
        # rows with penalties need their outputs on the host: the host sampler, the others a captured one
        host = [s for s in dec if s.group.req.params.needs_penalties]
        if host:
            self._sample_and_emit([(s, logits[s.row]) for s in host])
        cap = [s for s in dec if not s.group.req.params.needs_penalties]
        if cap:
            self._emit_sampled(cap, *g.sample(cap))

    def _emit_collected(self, got: tuple) -> None:
        """`GraphRows.collect`'s tokens out, but for sequences that ended (or were cancelled) since."""
        seqs, *cols = got
        keep = [i for i, s in enumerate(seqs) if not s.done]
        if keep:
            pick = [None if c is None else [c[i] for i in keep] for c in cols]
            self._emit_sampled([seqs[i] for i in keep], *pick)

    @staticmethod
    def _sibling_prefilling(s: _Seq, plan) -> bool:
        planned = {id(t) for t, _ in plan}
        return any(
            t is not s and not t.done and t.row is not None and (t.n_cached > 0 or id(t) in planned)
            for t in s.group.seqs
        )

    def _prefill_batch(self, seqs: list[_Seq]) -> list[torch.Tensor]:
        """Prefill several whole prompts in one forward; returns each one's last-position logits.

        Prompts are left-padded to a common length L in a temporary cache (token t of a prompt of length n sits
        at slot L - n + t with RoPE position t; padding is never attended to), then copied to slots [0, n) of
        each sequence's row: the same keys at the same positions as a prefill of that prompt alone.
        """
        dev = self.device
        self.batched_prefills += 1
        k, L = len(seqs), max(s.n_prompt for s in seqs)
        ids = torch.zeros(k, L, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, L - s.n_prompt :] = torch.tensor(s.tokens[: s.n_prompt])
        lens = torch.tensor([s.n_prompt for s in seqs])
        slots = torch.arange(L)
        offset = (L - lens)[:, None]  # [k, 1]
        mask = slots[None, :] >= offset  # [k, L]
        positions = (slots[None, :] - offset).clamp(min=0)  # [k, L]
        tmp = self.model.new_cache(k, L)
        logits = self.model(
            ids.to(dev),
            positions=positions.to(dev),
            cache=tmp,
            cache_pos=slots[None, :].expand(k, L).to(dev),
            input_mask=None if bool(mask.all()) else mask.to(dev),
            last_only=True,
        )  # [k, 1, V]
        for i, s in enumerate(seqs):
            n = s.n_prompt
            for main, t in zip(self.cache.k + self.cache.v, tmp.k + tmp.v, strict=True):
                main[s.row, :, :n] = t[i, :, L - n :]
            self.cache.valid[s.row, :n] = True
            s.n_cached = n
            self.metrics.inc("prompt_tokens_total", n)
        return [logits[i, -1] for i in range(k)]

    def _share_prompt(self, s: _Seq) -> list[_Seq]:
        """Copy `s`'s freshly prefilled prompt into the rows of its siblings (n > 1) that have not started.

        A copy gives bit-identical k/v, so each choice samples its first token from the same logits and
        then decodes exactly as if it had prefilled the prompt itself.
        """
        sibs = [
            t for t in s.group.seqs if t is not s and t.row is not None and t.n_cached == 0 and not t.done
        ]
        n = s.n_prompt
        for t in sibs:
            if self.graph is not None:
                self.graph.copy_prompt(s.row, t.row, n)
                t.n_cached = n
                continue
            for k in self.cache.k + self.cache.v:
                k[t.row, :, :n] = k[s.row, :, :n]
            self.cache.valid[t.row, :n] = self.cache.valid[s.row, :n]
            t.n_cached = n
        return sibs

    # ---- sampling and output -------------------------------------------------------------------
    def _sample_and_emit(self, ready: list[tuple[_Seq, torch.Tensor]]) -> None:
        """The host sampler (`sampling.sample`) over each sequence's logits [V], then its token out."""
        seqs = [s for s, _ in ready]
        params = [s.group.req.params for s in seqs]
        logits = torch.stack([lg for _, lg in ready])  # [R, V]
        pen = any(p.needs_penalties for p in params)
        k = max((p.top_logprobs for p in params if p.logprobs), default=0)
        out = sample(
            logits,
            params,
            generators=[s.generator for s in seqs],
            prompt_tokens=[s.tokens[: s.n_prompt] for s in seqs] if pen else None,
            output_tokens=[s.generated for s in seqs] if pen else None,
            num_top_logprobs=k,
        )
        tokens = out.tokens.tolist()
        want_lp = any(p.logprobs for p in params)
        lps = out.logprobs.tolist() if want_lp else None
        top_ids = out.top_ids.tolist() if k else None
        top_lps = out.top_logprobs.tolist() if k else None
        self._emit_sampled(seqs, tokens, lps, top_ids, top_lps)

    def _emit_sampled(self, seqs: list[_Seq], tokens, lps, top_ids, top_lps) -> None:
        """Each sequence's sampled token (and log-probabilities, lists in the order of seqs) out to its client."""
        params = [s.group.req.params for s in seqs]
        now = time.perf_counter()
        for i, s in enumerate(seqs):
            g = s.group
            t = tokens[i]
            s.tokens.append(t)
            g.completion_tokens += 1
            self.metrics.inc("generation_tokens_total")
            if g.first_token_at is None:
                g.first_token_at = now
                self.metrics.observe("time_to_first_token_seconds", now - g.arrival)
            if s.last_token_at is not None:
                self.metrics.observe("inter_token_latency_seconds", now - s.last_token_at)
            s.last_token_at = now
            entry = None
            if params[i].logprobs:
                entry = {"token": self._piece(t), "logprob": lps[i], "token_id": t}
                kk = params[i].top_logprobs
                if kk:
                    entry["top"] = [
                        (self._piece(j), v) for j, v in zip(top_ids[i][:kk], top_lps[i][:kk], strict=True)
                    ]
            self._advance(s, t, entry)

    def _piece(self, t: int) -> str:
        return self.tokenizer.decode([t], skip_special_tokens=False)

    def _advance(self, s: _Seq, t: int, entry: dict | None) -> None:
        g = s.group
        delta, finish = s.push(t)
        if t in s.stop_ids:
            entry = None  # the end-of-sequence token is not part of the returned text
        self._emit(g, Chunk(s.index, delta, [t], [entry] if entry else None, finish))
        if finish is not None:
            s.done = True
            s.finish_reason = finish
            self._release(s)
            g.remaining -= 1
            self._finish_group_if_done(g)
