"""The serving engine: the engine core (scheduler + worker over a runner) stepped on a thread of its own.

`submit` and `cancel` come from any thread (the HTTP layer's event loop): they queue, and the engine thread
applies them at the start of its next step. Every generated sequence holds one KV row of the runner from
admission to finish (continuous batching: requests join and leave between steps). Callers never touch tensors:
they submit token ids + sampling settings and receive plain Python events (text deltas, token ids, logprobs,
usage) through a callback that the engine thread invokes.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from bitnetlm.engine.core import EngineCore
from bitnetlm.engine.metrics import Metrics
from bitnetlm.engine.scheduler import ContextShift
from bitnetlm.engine.sequence import Group, Token
from bitnetlm.engine.speculative import SpeculativeConfig
from bitnetlm.engine.worker import emit
from bitnetlm.runtime import config_for, make_runner, serving_config
from bitnetlm.runtime.config import RuntimeConfig
from bitnetlm.serve.requests import (  # (the request and event types, also imported from here)
    Chunk,
    ContextTooLong,
    EngineClosed,
    Failed,
    Finished,
    GenerationRequest,
    NeverFits,
    QueueFull,
)

log = logging.getLogger("bitnetlm.serve")

__all__ = [
    "Chunk",
    "ContextTooLong",
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "Failed",
    "Finished",
    "GenerationRequest",
    "NeverFits",
    "QueueFull",
]


@dataclass
class EngineConfig:
    """The server's queueing options (how the model runs is the RuntimeConfig's: max_batch, max_seq_len, ...)."""

    max_queue: int = 64  # sequences allowed to wait for a row; beyond that submit() raises QueueFull
    prefill_chunk: int = 512  # prompt tokens prefilled per engine step (bounds decode stalls)
    retry_after_s: int = 1  # Retry-After sent with 429
    prefix_caching: bool = True  # prompts skip the prefix a KV row already holds (engine/scheduler.py)
    # speculative decoding (engine/speculative.py): a draft model (path, zoo name or loaded model) or prompt
    # lookup's longest n-gram (0: off), down to lookup_min; at most draft_max tokens drafted a step
    draft_model: Any = None
    draft_max: int = 4
    lookup: int = 0
    lookup_min: int = 1
    # context shift (engine/scheduler.py's ContextShift): a sequence that reaches the end of the context goes on
    context_shift: bool = False
    n_keep: int = 0

    def shift(self, model) -> ContextShift | None:
        return ContextShift(self.n_keep).check(model.config) if self.context_shift else None

    def speculative(self, runtime: RuntimeConfig, tokenizer) -> SpeculativeConfig | None:
        """The SpeculativeConfig these options ask for (a draft model given by name is loaded), or None."""
        from bitnetlm.loading import load_speculative

        spec = SpeculativeConfig(self.draft_max, self.lookup, self.lookup_min, self.draft_model)
        return load_speculative(spec, runtime, tokenizer) if spec.enabled else None


class Engine:
    """Owns `model` (a bitnetlm CausalLM) on its own thread; `submit`/`cancel` are thread-safe."""

    def __init__(
        self,
        model,
        tokenizer,
        config: EngineConfig | None = None,
        model_name: str = "model",
        runtime: RuntimeConfig | None = None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.config = cfg = config or EngineConfig()
        rt = config_for(model, runtime)
        self.max_model_len = rt.max_seq_len or model.config.max_position_embeddings
        self.max_batch = rt.max_batch
        rt = serving_config(model, rt, rt.max_batch, self.max_model_len)
        self.runner = make_runner(model, rt, rt.max_batch, self.max_model_len)
        if hasattr(self.runner, "warm"):  # every graph captured before /health says ready
            self.runner.warm()
        self.vocab_size = model.config.vocab_size
        eos = set(model.config.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", []) or [])
        self.metrics = Metrics(model_name)
        spec = cfg.speculative(rt, tokenizer)
        self.core = EngineCore(
            self.runner,
            tokenizer,
            eos,
            cfg.prefill_chunk,
            self.metrics,
            spec,
            context=self.max_model_len,
            context_shift=cfg.shift(model),
            prefix_reuse=cfg.prefix_caching,
        )
        sched = self.core.scheduler
        self.metrics.gauges["num_requests_running"] = lambda: self.stats()["running"]
        self.metrics.gauges["num_requests_waiting"] = lambda: self.stats()["waiting"]
        self.metrics.gauges["kv_rows_in_use"] = lambda: self.max_batch - len(sched.free_rows)
        positions = self.max_batch * self.max_model_len
        self.metrics.gauges["kv_cache_usage_perc"] = lambda: (
            sum(min(len(s.tokens), self.max_model_len) for s in list(sched.running.values())) / positions
        )
        if hasattr(self.runner, "usage"):  # a paged KV cache: its blocks in use
            self.metrics.gauges["kv_cache_usage_perc"] = self.runner.usage

        self._lock = threading.Condition()
        self._incoming: list[tuple[int, GenerationRequest, Callable]] = []
        self._cancel: dict[int, int] = {}  # gid -> engine step when cancel() was called
        self._groups: dict[int, Group] = {}  # gid -> its group (engine thread)
        self._live: set[int] = set()  # gids submitted and not yet ended
        self._calls: list[tuple[Callable, tuple, Future]] = []  # `call`s not yet run
        self._owed = 0.0  # seconds of steps owed to the running sequences for the last call's time
        self._ids = itertools.count(1)
        self.max_cancel_lag_steps = 0  # most steps any cancellation waited before its rows were freed
        self._accepting = True
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="bitnet-engine", daemon=True)
        self._thread.start()

    # ---- public API (any thread) ---------------------------------------------------------------
    def submit(self, req: GenerationRequest, sink: Callable[[Any], None]) -> int:
        """Queue `req`; `sink(event)` is called from the engine thread with Chunk / Finished / Failed events."""
        self._validate(req)
        self.check_fits(req.n)
        with self._lock:
            if not self._accepting:
                raise EngineClosed("server is shutting down")
            sched = self.core.scheduler
            waiting = len(sched.waiting) + sum(r.n for _, r, _ in self._incoming)
            if waiting + req.n - len(sched.free_rows) > self.config.max_queue:
                self.metrics.inc("request_rejected_total")
                raise QueueFull(self.config.retry_after_s)
            gid = next(self._ids)
            self._incoming.append((gid, req, sink))
            self._live.add(gid)
            self._lock.notify_all()
        return gid

    def call(self, fn: Callable, *args) -> Future:
        """Run `fn(*args)` on the engine thread between two steps; its result (or error) in the future.

        For work on the model that must not overlap a step, as an embedding's forward: the runner's kernels,
        scratch buffers and CUDA streams are used from this thread only. While sequences run, calls take at
        most half the thread's time: after a call, steps run for as long as it took before the next call."""
        fut: Future = Future()
        with self._lock:
            if not self._accepting:
                raise EngineClosed("server is shutting down")
            self._calls.append((fn, args, fut))
            self._lock.notify_all()
        return fut

    @property
    def capacity(self) -> int:
        """The most sequences the engine holds at once: a row for each running one, the queue full."""
        return self.max_batch + self.config.max_queue

    def check_fits(self, sequences: int, what: str = "") -> None:
        """NeverFits when `sequences` exceed `capacity`: such a request would get QueueFull even from an idle
        engine, forever."""
        if sequences > self.capacity:
            raise NeverFits(
                f"the request needs {sequences} sequences{what}, more than this server ever holds at once: "
                f"{self.capacity} (--max-batch {self.max_batch} + --max-queue {self.config.max_queue})"
            )

    def _validate(self, req: GenerationRequest) -> None:
        n_prompt, p = len(req.prompt_ids), req.params
        if n_prompt == 0:
            raise ContextTooLong("the prompt is empty (0 tokens)")
        bad = next((t for t in req.prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if req.n < 1 or p.max_tokens < 1:
            raise ValueError(f"n and max_tokens must be >= 1, found n={req.n}, max_tokens={p.max_tokens}")
        past = n_prompt + p.max_tokens > self.max_model_len and not self.config.context_shift
        if past or n_prompt >= self.max_model_len:
            raise ContextTooLong(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n_prompt + p.max_tokens} tokens ({n_prompt} in the prompt, {p.max_tokens} for the "
                "completion). Please reduce the length of the prompt or the completion."
            )
        self.core.check_blocks(n_prompt, p.max_tokens)  # (a paged KV cache: the request fits it at all)
        if p.logit_bias and any(not 0 <= t < self.vocab_size for t in p.logit_bias):
            raise ValueError(
                f"logit_bias token ids must be in [0, {self.vocab_size}), found {sorted(p.logit_bias)}"
            )

    def cancel(self, gid: int) -> None:
        """Drop request `gid` (client went away): queued sequences leave the queue, running ones free their row."""
        with self._lock:
            if gid in self._live:
                self._cancel.setdefault(gid, self.core.steps)
                self._lock.notify_all()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting; with drain=True let queued and running requests finish first."""
        with self._lock:
            self._accepting = False
            if not drain:
                for gid in self._live:
                    self._cancel.setdefault(gid, self.core.steps)
            self._lock.notify_all()
            deadline = None if timeout is None else time.monotonic() + timeout
            while (self._live or self._calls) and self._thread.is_alive():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    for gid in self._live:
                        self._cancel.setdefault(gid, self.core.steps)
                    self._lock.notify_all()
                    break
                self._lock.wait(0.05 if left is None else min(left, 0.05))
            self._stop = True
            self._lock.notify_all()
        self._thread.join(timeout=30)

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def steps(self) -> int:
        return self.core.steps

    @property
    def batched_prefills(self) -> int:
        return self.core.worker.batched_prefills

    def stats(self) -> dict[str, int]:
        sched = self.core.scheduler
        waiting_g = {s.group.id for s in list(sched.waiting)} | {gid for gid, _, _ in list(self._incoming)}
        running_g = {s.group.id for s in list(sched.running.values())}
        return {
            "running": len(running_g - waiting_g),
            "waiting": len(waiting_g),
            "rows_in_use": self.max_batch - len(sched.free_rows),
            "steps": self.core.steps,
            "max_cancel_lag_steps": self.max_cancel_lag_steps,
            "preemptions": sched.preemptions,
        }

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                while not (
                    self._stop or self._cancel or self._incoming or self._calls or self.core.has_work()
                ):
                    self._lock.wait()
                if self._stop:
                    break
                incoming, self._incoming = self._incoming, []
                cancels, self._cancel = self._cancel, {}
                due = self._calls and (self._owed <= 0 or not self.core.has_work())
                call = self._calls.pop(0) if due else None
            if call is not None:
                t0 = time.perf_counter()
                _run_call(*call)
                self._owed = time.perf_counter() - t0
            for gid, req, sink in incoming:
                self._admit(gid, req, sink)
            self._apply_cancels(cancels)
            t0 = time.perf_counter()
            try:
                self.core.step()
            except Exception as e:  # fail the running requests, keep serving
                log.error("engine step failed:\n%s", traceback.format_exc())
                self._fail_running(f"internal error during generation: {type(e).__name__}: {e}")
            self._owed = max(self._owed - (time.perf_counter() - t0), 0.0)
        with self._lock:
            calls, self._calls = self._calls, []
            self._lock.notify_all()
        for _, _, fut in calls:  # (only when shutdown gave up waiting for them)
            fut.set_exception(EngineClosed("server is shutting down"))

    def _admit(self, gid: int, req: GenerationRequest, sink: Callable[[Any], None]) -> None:
        """A submitted request into the core; one it cannot take fails alone, and the engine goes on."""
        try:
            self._groups[gid] = self.core.add(req, self._sink(gid, sink))
        except Exception as e:
            log.error("engine: request %d could not start:\n%s", gid, traceback.format_exc())
            self._ended(gid)
            try:
                sink(Failed(f"the request could not start: {type(e).__name__}: {e}", status=400))
            except Exception:  # a broken client callback must not stop the engine
                log.exception("engine: event sink failed for request %d", gid)

    def _sink(self, gid: int, sink: Callable[[Any], None]) -> Callable[[Any], None]:
        """The core's events for request `gid` as the server's: a Chunk per token, then Finished or Failed."""

        def relay(ev) -> None:
            if isinstance(ev, Token):
                s = ev.seq
                entry = None
                if (
                    s.params.logprobs and ev.token not in s.stop_ids
                ):  # (the end token is not part of the text)
                    entry = {"token": self._piece(ev.token), "logprob": ev.logprob, "token_id": ev.token}
                    if ev.top:
                        entry["top"] = [(self._piece(j), v) for j, v in ev.top]
                detail = s.finish_detail if ev.finish_reason else None
                sink(
                    Chunk(s.index, ev.text, [ev.token], [entry] if entry else None, ev.finish_reason, detail)
                )
                return
            if isinstance(ev, (Finished, Failed)):
                self._ended(gid)
            sink(ev)

        return relay

    def _ended(self, gid: int) -> None:
        self._groups.pop(gid, None)
        with self._lock:
            self._live.discard(gid)
            self._lock.notify_all()

    def _piece(self, t: int) -> str:
        return self.tokenizer.decode([t], skip_special_tokens=False)

    def _apply_cancels(self, cancels: dict[int, int]) -> None:
        for gid, asked in cancels.items():
            self.max_cancel_lag_steps = max(self.max_cancel_lag_steps, self.core.steps - asked)
            g = self._groups.get(gid)
            if g is None or g.cancelled or gid not in self._live:
                continue
            self.core.abort(g)
            self.metrics.inc("request_cancelled_total")
            emit(g, Failed("request cancelled", status=499))  # every request ends with Finished or Failed

    def _fail_running(self, message: str) -> None:
        self.core.inflight = None  # (its sequences fail below)
        groups = {s.group.id: s.group for s in self.core.running()}
        for g in groups.values():
            self.core.abort(g)
            emit(g, Failed(message))


def _run_call(fn: Callable, args: tuple, fut: Future) -> None:
    if not fut.set_running_or_notify_cancel():
        return
    try:
        fut.set_result(fn(*args))
    except BaseException as e:  # the caller's to report; the engine goes on
        fut.set_exception(e)
