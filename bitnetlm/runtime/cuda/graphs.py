"""The CUDA engine's captured graphs: `capture`, and the steps a `CudaEngine` captures once and replays
(`CapturedSteps`): the decode step of a batch size and sampler, a prompt's prefill padded to `prefill_len`, a
speculative verification of a (row, length, key span), and `generate`'s loop. The forward they capture is
engine.py's.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch

# prefill attention (engine.prefill_attention) runs on lengths padded to a multiple of this ...
PREFILL_ALIGN = 128
# ... or, for prompts this short, to the first of these that holds them: a 49-token prompt padded to 128 rows
# took 3.0 ms to prefill on an H200, as long as 128 tokens (int8 head, float8 cache; docs/PERF_LOG.md, 2026-12-03)
PREFILL_SHORT = (16, 32, 64)


def prefill_len(t: int) -> int:
    """The padded length a prefill of t tokens from position 0 runs at (one captured graph, one cuDNN plan each)."""
    return next((s for s in PREFILL_SHORT if t <= s), -(-t // PREFILL_ALIGN) * PREFILL_ALIGN)


@dataclass
class DecodeState:
    graph: torch.cuda.CUDAGraph
    tok: torch.Tensor  # [B, 1] next input token
    pos: torch.Tensor  # [B] its position
    step: torch.Tensor  # [1] output slot to write
    out: torch.Tensor  # [B, max_seq_len] generated tokens
    logits: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)


def capture(fn, before_capture=None, warmup: int = 2, pool=None):
    """Run `fn` eagerly (Triton compiles and tunes here, never while capturing), then capture it in a CUDA graph.

    Returns (graph, output of the captured call); replaying the graph recomputes that output in place.
    """
    fn()
    dev = torch.cuda.current_device()
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(dev).wait_stream(s)
    if before_capture is not None:
        before_capture()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    except RuntimeError as e:  # name the graph and the other threads (in global mode their CUDA calls end it)
        others = sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
        raise RuntimeError(
            f"capturing {getattr(fn, '__qualname__', fn)!s} failed: {e} (other threads: {others})"
        ) from e
    return graph, out


class CapturedSteps:
    """The captured steps of a `CudaEngine` (its base: they run its forward, caches and plan)."""

    def decode_state(
        self, batch: int, temperature: float = 0.0, top_k: int = 0, sample: bool = True, max_keys: int = 0
    ) -> DecodeState:
        """The captured decode step for this batch size and sampler (captured on first use); sample=False:
        see logits_state. max_keys: the most keys (prompt + generated tokens) a row will reach while this step
        is replayed, or 0 (unknown); a short one picks faster attention splits, and any context stays exact."""
        from bitnetlm.kernels.triton.attention import key_range

        keys = key_range(batch, max_keys, self.plan)
        key = (batch, float(temperature), int(top_k), sample, keys)
        if key in self._graphs:
            return self._graphs[key]
        self._check_batch(batch, 1)
        dev = self.device
        tok = torch.zeros((batch, 1), dtype=torch.long, device=dev)
        pos = torch.zeros((batch,), dtype=torch.int32, device=dev)
        step = torch.zeros((1,), dtype=torch.long, device=dev)
        out = torch.zeros((batch, self.ecfg.max_seq_len), dtype=torch.long, device=dev)

        def body():
            if sample and temperature <= 0:  # argmax + the bookkeeping below, one launch
                from bitnetlm.kernels.triton.ends import greedy_step

                if self.head is None:  # the int8 head samples itself: no logits stored
                    self.forward(tok, pos, keys=keys, greedy=(tok, out, step, pos))
                    return None
                logits = self.forward(tok, pos, keys=keys)
                greedy_step(logits, tok, out, step, pos, plan=self.plan)
                return logits
            logits = self.forward(tok, pos, keys=keys)
            if sample:
                nxt = self.sample(logits, temperature, top_k)  # [B]
                out.index_copy_(1, step, nxt[:, None])
                tok.copy_(nxt[:, None])
                step.add_(1)
            pos.add_(1)
            return logits

        with self.kept_slots(batch):
            graph, logits = capture(body, before_capture=pos.zero_)
        # the body stays: graph_sampler captures it again, followed by a sampler, in one graph
        st = DecodeState(graph, tok, pos, step, out, logits, extra={"body": body})
        self._graphs[key] = st
        return st

    @contextlib.contextmanager
    def kept_slots(self, batch: int):
        """Inside, KV positions 0-2 of rows 0..batch-1 may be overwritten: the eager warm-up runs of a decode
        step's capture (3 runs from position 0) write there. They are restored on exit, so that a step can be
        captured while rows hold sequences."""
        n = min(3, self.ecfg.max_seq_len)
        rows = slice(0, batch)  # (a paged cache: the blocks those rows' tables name for positions 0..n-1)
        if self.table is not None:
            rows = self.table[:batch, : -(-n // self.ecfg.kv_block_size)].flatten().long()
            n = self.ecfg.kv_block_size
        kept = [c[rows, :, :n].clone() for c in self.k_cache + self.v_cache]
        try:
            yield
        finally:
            for c, k in zip(self.k_cache + self.v_cache, kept, strict=True):
                c[rows, :, :n] = k

    def prefill(self, ids: list[int], row: int) -> torch.Tensor:
        """Prefill one prompt from position 0 into cache row `row` -> float32 logits [V] after its last token.

        Through a captured graph of the prompt padded to `prefill_len` tokens (the pad tokens' keys and
        values land past the prompt, where the decode steps overwrite them before any query reaches them):
        one replay instead of some 300 launches from Python for a 2B4T model."""
        t = len(ids)
        tp = prefill_len(t)
        if tp >= self.ecfg.max_seq_len:  # (padded to the whole context: prefill_state's limit)
            zero = torch.zeros((1,), dtype=torch.int32, device=self.device)
            return self.forward(torch.tensor([ids], device=self.device), zero, row0=row)[0]
        st = self.prefill_state(tp)
        host = torch.zeros((tp + 2,), dtype=torch.long)
        host[:t] = torch.tensor(ids, dtype=torch.long)
        host[tp], host[tp + 1] = t - 1, row
        host = host.pin_memory()
        st.tok.copy_(host[None, :tp], non_blocking=True)
        st.extra["last"].copy_(host[tp : tp + 1], non_blocking=True)
        st.extra["row"].copy_(host[tp + 1 :], non_blocking=True)
        st.graph.replay()
        return st.logits[0].clone()  # the prefill graphs share one memory pool: the next replay may reuse it

    def prefill_state(self, tp: int) -> DecodeState:
        """The captured prefill of `tp` tokens from position 0 in the scratch row, whose RoPE + KV-write launches
        also store each layer's keys and values into the row held in extra["row"] ([1]; the scratch row itself
        during capture, so the warm-up runs touch no other row). All prefill graphs share one memory pool."""
        key = ("prefill", tp)
        if key in self._graphs:
            return self._graphs[key]
        if tp >= self.ecfg.max_seq_len:  # (such prompts prefill eagerly: `prefill`)
            raise ValueError(
                f"CudaEngine.prefill_state: a captured prefill needs fewer than max_seq_len "
                f"({self.ecfg.max_seq_len}) tokens, found {tp}"
            )
        dev = self.device
        tok = torch.zeros((1, tp), dtype=torch.long, device=dev)
        pos = torch.zeros((1,), dtype=torch.int32, device=dev)
        last = torch.full((1,), tp - 1, dtype=torch.long, device=dev)
        row = torch.full((1,), self.scratch, dtype=torch.long, device=dev)
        if self._prefill_pool is None:
            self._prefill_pool = torch.cuda.graph_pool_handle()
        graph, logits = capture(lambda: self.scratch_prefill(tok, pos, last, row), pool=self._prefill_pool)
        st = DecodeState(graph, tok, pos, last, tok, logits, extra={"last": last, "row": row})
        self._graphs[key] = st
        return st

    def scratch_prefill(self, tok, pos, last, row) -> torch.Tensor:
        """A captured prefill's body: tok [1, T] from position 0 in the scratch row, its keys and values also into
        the cache row in row [1] (on the device) -> logits [1, V] after token last[0]. Over a paged cache the
        scratch row takes that row's block table, so the keys land in its blocks. (The second store replaces 60
        index_copy_ launches, 0.21 ms at 128 tokens on an H200.)"""
        sc = self.scratch
        if self.table is not None:
            self.table[sc : sc + 1].copy_(self.table.index_select(0, row))
            return self.forward(tok, pos, row0=sc, last_at=last)
        return self.forward(tok, pos, row0=sc, last_at=last, copy_to=row)

    def verify_inputs(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tok [1, t], pos [1]): the inputs of every verify graph of length t (verify_state)."""
        if ("verify", t) not in self._bufs:
            dev = self.device
            self._bufs[("verify", t)] = (
                torch.zeros((1, t), dtype=torch.long, device=dev),
                torch.zeros((1,), dtype=torch.int32, device=dev),
            )
        return self._bufs[("verify", t)]

    def verify_state(self, row: int, t: int, keys: int) -> DecodeState:
        """The captured forward of t tokens of cache row `row` at positions pos[0]..pos[0]+t-1 attending over
        cache slots 0..keys-1 -> logits [t, V]: speculative verification, one graph a (row, length, key span),
        in the prefill graphs' memory pool. Its inputs (`verify_inputs`) must hold the real tokens and position
        before the first call: the capture's eager warm-up runs write the keys and values the replay will."""
        key = ("verify", row, t, keys)
        if key in self._graphs:
            return self._graphs[key]
        if keys > self.ecfg.max_seq_len or t > keys:
            raise ValueError(f"CudaEngine.verify_state: {t} tokens over {keys} cache slots do not fit")
        tok, pos = self.verify_inputs(t)

        def body():
            return self.forward(tok, pos, last_only=False, row0=row, keys=keys)

        if self._prefill_pool is None:
            self._prefill_pool = torch.cuda.graph_pool_handle()
        graph, logits = capture(body, pool=self._prefill_pool)
        self._graphs[key] = DecodeState(graph, tok, pos, pos, tok, logits)
        return self._graphs[key]

    def logits_state(self, batch: int, max_keys: int = 0) -> DecodeState:
        """A captured step without sampling: logits [B, V] of tok [B, 1] at pos [B], then pos += 1. The caller
        samples (any sampler, on the host's schedule) and writes the next tokens into `tok`."""
        return self.decode_state(batch, sample=False, max_keys=max_keys)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0):
        """prompt [B, T0] (same length rows) -> generated tokens [B, max_new_tokens] (one host sync, at the end)."""
        prompt = prompt.to(self.device)
        b, t0 = prompt.shape
        self._check_batch(b, t0 + max_new_tokens)
        st = self.decode_state(b, temperature, top_k, max_keys=t0 + max_new_tokens)
        pos0 = torch.zeros((b,), dtype=torch.int32, device=self.device)
        first = self.sample(self.forward(prompt, pos0), temperature, top_k)  # [B]
        st.out[:, 0] = first
        st.tok.copy_(first[:, None])
        st.pos.fill_(t0)
        st.step.fill_(1)
        for _ in range(max_new_tokens - 1):
            st.graph.replay()
        return st.out[:, :max_new_tokens].clone()
