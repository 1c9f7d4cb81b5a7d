"""The scheduler: which sequences get a KV row, which prompt tokens prefill this step, which rows decode.

Pure bookkeeping over plain sequence records (no tensors, no model): `schedule()` returns a `Plan` and advances
each planned sequence's `n_cached` as if the plan ran, so the next plan builds on it. The worker executes plans
on a runner and reports back only what the scheduler cannot know: a sequence that finished (`finish`).

Each step:
  1. admits waiting sequences into free rows, in arrival order. Prefix reuse: a row keeps the keys and values of
     the prompt it prefilled after its sequence ends, so a new prompt that starts with the same tokens as a row's
     prompt (running or ended) skips them: it takes that row as it is (an ended one), or a copy of its first
     tokens (a running one). Only prefilled prompt positions are reused, so the reused keys and values are those
     the prompt's own prefill would write. Otherwise an empty row is taken (lowest first), else the row that
     ended longest ago;
  2. prefills prompts FIFO, `prefill_chunk` tokens per step in total (bounding the stall of the decoding rows);
     whole prompts that fit together run as one forward where the runner can batch them, and the other choices
     of a request (n > 1) wait for the first's prefill, then copy it (a copy gives bit-identical keys and values);
  3. decodes every sequence that has a next token: its last sampled token, known on the host or still on its way
     there (a pipelined step), or its first token, sampled in this same step from its prompt's last logits. A
     sequence whose token would land past the context window shifts its row first (llama.cpp's context shift:
     its first `keep` positions stay, the oldest half of the rest goes, `Shift` in the plan), when it may.

Over a paged KV cache (`kv_blocks` > 0) a row holds only the blocks its positions fill, and prefix reuse is the
runner's block cache instead of rows held after their sequence ends: a new prompt skips the leading full blocks
that `lookup` finds cached (kept from any prompt prefilled before, running or ended), which the worker maps into
its row (`PagedCpuRunner.adopt`). As vLLM, a sequence is admitted when the blocks its prompt needs now (and its
first decode) are free beside those that the prompts being prefilled still need, keeping a watermark of 1% of the
pool for the running rows to grow; blocks are then taken as tokens arrive. When a step finds no free block, the
worker preempts the most recently admitted running sequence (`preempt`, vLLM's recompute mode): its row is freed,
and it goes back to the front of the queue with every token it has, to be prefilled again (mostly from the block
cache) and go on; its stream only pauses. A row that ends gives its blocks back at once (`released`, for the
worker).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

from bitnetlm.engine.sequence import Sequence


@dataclass
class SchedulerConfig:
    rows: int
    prefill_chunk: int = 512  # prompt tokens prefilled per step
    batched_prefill: bool = True  # whole prompts may share one forward (else one prompt per forward)
    split_first_only: bool = (
        False  # only a step's first prompt may be split into chunks (fewer prefill shapes)
    )
    prefix_reuse: bool = True  # a prompt skips the tokens a row already holds (see above)
    context: int = 0  # positions a row holds (0: unbounded); a sequence with shift_keep set shifts at the end
    # the runner's sliding-window rings (`models.cache.Ring`: which held prefixes they keep), or None
    ring: object = None
    kv_blocks: int = 0  # a paged KV cache's blocks (0: a static cache, a whole context per row)
    block_size: int = 16
    lookup: Callable[[list[int]], int] | None = None  # paged: prompt positions the block cache holds
    # paged: blocks free or evictable now (None: all of them), and the blocks a new row of these tokens (then one
    # decode) takes from them (None: all it fills; a paged runner counts the cached ones that rows share)
    free: Callable[[], int] | None = None
    cost: Callable[[list[int]], int] | None = None

    def blocks(self, n: int) -> int:
        return -(-n // self.block_size)

    @property
    def watermark(self) -> int:
        """Blocks admission leaves free for the running rows to grow (vLLM's default: 1% of the pool)."""
        return max(1, self.kv_blocks // 100)


REUSE_MIN = 16  # shorter common prefixes are recomputed: a copy is not worth its bookkeeping below this


@dataclass(frozen=True)
class ContextShift:
    """llama.cpp's context shift (`--context-shift`, `--keep`): a row that reaches the end of the context window
    keeps its first positions (n_keep prompt tokens after a leading BOS; -1: the whole prompt), drops the oldest
    half of the rest and goes on, instead of ending with "length"."""

    n_keep: int = 0

    def __post_init__(self):
        if isinstance(self.n_keep, bool) or not isinstance(self.n_keep, int) or self.n_keep < -1:
            raise ValueError(f"--keep {self.n_keep!r}: expected an integer >= 0, or -1 for the whole prompt")

    def check(self, model_config) -> ContextShift:
        why = model_config.shift_unsupported
        if why is not None:
            raise ValueError(f"--context-shift: not available for {model_config.arch} models ({why})")
        return self

    def keep(self, prompt: list[int], bos: int | None, context: int) -> int:
        """Positions a row of `prompt` keeps (at most context - 2: every shift drops at least one)."""
        n = len(prompt) if self.n_keep < 0 else self.n_keep + int(bos is not None and prompt[:1] == [bos])
        return max(0, min(n, len(prompt), context - 2))


@dataclass
class Shift:
    """Context shift of `seq`'s row before its decode: positions keep..keep+drop-1 go, the later ones move down."""

    seq: Sequence
    keep: int
    drop: int


@dataclass
class Chunk:
    """Prompt tokens [start, end) of `seq` into its row."""

    seq: Sequence
    start: int
    end: int


@dataclass
class Plan:
    admitted: list[Sequence] = field(default_factory=list)  # got a row this step (the worker resets it)
    # id(seq) -> (source row, n): an admitted sequence's row starts with the source row's first n positions (its
    # own row: kept; another: copied; None: the paged cache's cached blocks of its prompt's first n tokens)
    reused: dict[int, tuple[int, int]] = field(default_factory=dict)
    prefills: list[list[Chunk]] = field(default_factory=list)  # each inner list: one forward
    copies: list[tuple[Sequence, Sequence]] = field(
        default_factory=list
    )  # (prefilled, sibling): share its prompt
    decode: list[Sequence] = field(default_factory=list)  # candidates: the worker drops those that have ended
    shifts: list[Shift] = field(default_factory=list)  # run before the decode

    def __bool__(self) -> bool:
        return bool(self.admitted or self.prefills or self.copies or self.decode)


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: dict[int, Sequence] = {}  # row -> sequence
        self.free_rows = list(range(config.rows))  # kept sorted: lowest row first
        self.held: dict[
            int, tuple[int, ...]
        ] = {}  # free row -> the prompt prefix whose keys and values it holds
        self.written: dict[int, int] = {}  # free row -> the most positions its last sequence wrote
        self.ended = 0  # counts sequences that gave a row back (the order in which held rows were freed)
        self.freed_at: dict[int, int] = {}
        self.promised = 0  # paged: blocks this step's admissions and unfinished prompts will take
        self.released: list[int] = []  # paged: rows ended whose blocks the runner has not been told to free
        self.preemptions = 0

    # ---- state --------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """`seq` ended (stopped, or cancelled): its row is free again, or it leaves the queue."""
        seq.done = True
        if seq.row is not None and self.running.get(seq.row) is seq:
            del self.running[seq.row]
            self.free_rows.append(seq.row)
            self.free_rows.sort()
            if self.config.kv_blocks:
                self.released.append(seq.row)
            elif self.config.prefix_reuse:
                self.held[seq.row] = tuple(self._computed(seq))
                self.written[seq.row] = self._written(seq)
                self.ended += 1
                self.freed_at[seq.row] = self.ended
            seq.row = None
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def newest(self) -> Sequence | None:
        """The running sequence admitted last (the one a paged step preempts first, as vLLM's), or None."""
        return next(reversed(self.running.values()), None)

    def preempt(self, s: Sequence) -> int:
        """Paged, recompute mode: running `s` gives its row back (returned: the worker frees its blocks now) and
        waits at the front of the queue to prefill every token its row held again. Its sampling stream, grammar
        state and speculation stay with it, so it goes on as it would have. (A row that shifted past the context
        window is prefilled from the tokens it held, whose keys are then computed at their new positions rather
        than moved there: its output may differ from a run without preemption.)"""
        if s.pending:
            raise RuntimeError(f"row {s.row}: preempted with {s.pending} sampled tokens not yet read")
        row = s.row
        del self.running[row]
        self.free_rows.append(row)
        self.free_rows.sort()
        s.row, s.n_cached, s.written = None, 0, 0
        s.n_fill = len(s.tokens) - s.shifted
        s.preemptions += 1
        self.waiting.appendleft(s)
        self.preemptions += 1
        return row

    # ---- planning -----------------------------------------------------------------------------------
    def schedule(self) -> Plan:
        plan = Plan()
        self.promised = self._owed()
        while (
            self.waiting
            and self.free_rows
            and self._fits(self.waiting[0])
            and not self._defer(self.waiting[0])
        ):
            s = self.waiting.popleft()
            self._admit(s, plan)
        completing = self._plan_prefill(plan)
        for s in self.running.values():
            if s.done:
                continue
            fed = len(s.tokens) + s.pending - s.shifted  # positions once its last token is fed
            if s in completing or (s.n_cached >= s.n_fill and fed == s.n_cached + 1):
                if s.budget > 0 or s in completing:
                    self._maybe_shift(s, plan)
                    plan.decode.append(s)
                    s.n_cached += 1
        plan.decode.sort(key=lambda s: s.row)
        return plan

    def _maybe_shift(self, s: Sequence, plan: Plan) -> None:
        """s's next token would be fed at position n_cached: past the window, its row shifts first (half of what
        follows its kept positions goes, as llama.cpp's n_discard = n_left / 2)."""
        ctx = self.config.context
        if not ctx or s.shift_keep is None or s.n_cached < ctx:
            return
        drop = (s.n_cached - s.shift_keep) // 2
        if self.config.ring is not None:
            drop = self.config.ring.shift_drop(s.n_cached, s.shift_keep, drop)
        s.written = max(
            s.written, s.n_cached + 1
        )  # (positions before the shift: what the ring may have lost)
        plan.shifts.append(Shift(s, s.shift_keep, drop))
        s.n_cached -= drop
        s.shifted += drop

    # ---- admission and prefix reuse -------------------------------------------------------------------
    @staticmethod
    def _written(s: Sequence) -> int:
        """The most positions s's row has had written: planned decodes included, and the padding that a decode
        step of other rows writes at its next position."""
        return max(s.written, s.n_cached + 1)

    @staticmethod
    def _computed(s: Sequence) -> list[int]:
        """The prompt tokens whose keys and values s's row holds, computed by a prefill (a shifted row: only its
        kept positions are still at their own places)."""
        n = min(s.n_cached, s.n_prompt)
        return s.tokens[: min(n, s.shift_keep) if s.shifted else n]

    def _fits(self, s: Sequence) -> bool:
        """Paged: s's row (all it must prefill, then one decode) fits the free blocks beside what this step's
        admissions and the unfinished prompts will take, and the watermark (none when nothing runs: the queue
        never waits on an empty pool)."""
        cfg = self.config
        if not cfg.kv_blocks:
            return True
        free = cfg.kv_blocks if cfg.free is None else cfg.free()
        room = free - self.promised - (cfg.watermark if self.running else 0)
        return self._cost(s) <= room

    def _cost(self, s: Sequence) -> int:
        cfg = self.config
        tokens = s.row_tokens(0, s.n_fill)
        return cfg.cost(tokens) if cfg.cost is not None else cfg.blocks(len(tokens) + 1)

    def _owed(self) -> int:
        """Paged: blocks that running prompts still being prefilled will take (and their first decode's)."""
        if not self.config.kv_blocks:
            return 0
        b = self.config.blocks
        return sum(
            max(0, b(s.n_fill + 1) - b(s.n_cached)) for s in self.running.values() if s.n_cached < s.n_fill
        )

    def _defer(self, s: Sequence) -> bool:
        """Paged: s waits while a running prompt that starts with more of s's full blocks than the block cache
        holds is still being prefilled (requests that arrive together with one system prompt compute it once)."""
        cfg = self.config
        if not cfg.kv_blocks or not cfg.prefix_reuse or cfg.lookup is None:
            return False
        prompt, bs = s.row_tokens(0, s.n_fill - 1), cfg.block_size
        ahead = [t for t in self.running.values() if t.group is not s.group and t.n_cached < t.n_fill]
        if len(prompt) < bs or not any(t.row_tokens(0, bs) == prompt[:bs] for t in ahead):
            return False
        have = cfg.lookup(prompt)
        for t in ahead:
            m = min(len(prompt), t.n_fill)
            theirs = t.row_tokens(0, m)
            common = next((i for i in range(m) if theirs[i] != prompt[i]), m) // bs * bs
            if common > have and t.n_cached < common:
                return True
        return False

    def _admit(self, s: Sequence, plan: Plan) -> None:
        """Give s a free row (reusing the longest held prefix of its prompt), and plan the row's reset."""
        if self.config.kv_blocks:
            self._admit_paged(s, plan)
            return
        src, n = self._longest_prefix(s) if self.config.prefix_reuse else (None, 0)
        if src is not None:  # (a kept or copied ring lacks what its source's writes overwrote)
            s.written = self.written[src] if src in self.held else self._written(self.running[src])
        if src is not None and src in self.held:  # an ended row: take it as it is
            row = src
        else:
            empty = [r for r in self.free_rows if not self.held.get(r)]
            row = empty[0] if empty else min(self.free_rows, key=lambda r: self.freed_at.get(r, 0))
        self.free_rows.remove(row)
        self.held.pop(row, None)
        self.written.pop(row, None)
        s.row = row
        self.running[row] = s
        plan.admitted.append(s)
        if src is not None:
            plan.reused[id(s)] = (src, n)
            s.n_cached = n

    def _admit_paged(self, s: Sequence, plan: Plan) -> None:
        """Give s the lowest free row (the blocks it will take: promised); its cached leading blocks (all it must
        prefill but the last token at most) are reused: `plan.reused` (None, n)."""
        cfg = self.config
        self.promised += self._cost(s)
        row = self.free_rows.pop(0)
        s.row = row
        self.running[row] = s
        plan.admitted.append(s)
        reuse = cfg.prefix_reuse and cfg.lookup is not None
        n = cfg.lookup(s.row_tokens(0, s.n_fill - 1)) if reuse else 0
        if n:
            plan.reused[id(s)] = (None, n)
            s.n_cached = n

    def _longest_prefix(self, s: Sequence) -> tuple[int | None, int]:
        """The row (free or running) holding the longest prefix of s's prompt, and its length; at most all of
        the prompt but its last token (whose logits the first sample needs); (None, 0) below REUSE_MIN."""
        prompt, limit = tuple(s.tokens[: s.n_prompt]), s.n_prompt - 1
        best, best_n = None, REUSE_MIN - 1
        held = [(r, h, self.written.get(r, 0)) for r, h in self.held.items()]
        running = [(r, tuple(self._computed(t)), self._written(t)) for r, t in self.running.items()]
        ring = self.config.ring
        for r, h, written in [*held, *running]:
            m = min(len(h), limit)
            if m <= best_n or h[: best_n + 1] != prompt[: best_n + 1]:
                continue
            n = next((i for i in range(m) if h[i] != prompt[i]), m)
            # (a sliding layer's ring may have overwritten the window before position n: its keys are gone)
            if n > best_n and (ring is None or ring.keeps(written, n)):
                best, best_n = r, n
        return (best, best_n) if best is not None else (None, 0)

    def _plan_prefill(self, plan: Plan) -> set:
        """Prompt chunks for this step (FIFO); returns the sequences whose prompt becomes complete."""
        cfg = self.config
        budget = cfg.prefill_chunk
        chunks: list[Chunk] = []
        for s in sorted(self.running.values(), key=lambda s: (s.group.arrival, s.group.id, s.index)):
            if budget <= 0:
                break
            todo = s.n_fill - s.n_cached
            if (
                s.done
                or todo <= 0
                or (s.n_cached == 0 and not s.generated and self._sibling_prefilling(s, chunks))
            ):
                continue  # done, or a sibling's prefill will be copied into this row
            c = min(todo, budget)
            if cfg.split_first_only and c < todo and chunks:
                break
            budget -= c
            chunks.append(Chunk(s, s.n_cached, s.n_cached + c))
        completing = set()
        whole = [c for c in chunks if c.start == 0 and c.end == c.seq.n_fill] if cfg.batched_prefill else []
        batch: list[Chunk] = []
        for c in whole:  # fresh prompts that fit whole go through one forward (left-padded)
            if (len(batch) + 1) * max([b.end for b in batch] + [c.end]) <= cfg.prefill_chunk:
                batch.append(c)
        if len(batch) > 1:
            plan.prefills.append(batch)
        in_batch = {id(c) for c in batch} if len(batch) > 1 else set()
        plan.prefills += [[c] for c in chunks if id(c) not in in_batch]
        for c in chunks:
            c.seq.n_cached = c.end
            if c.end == c.seq.n_fill:
                completing.add(c.seq)
                for t in self._siblings_waiting(c.seq):
                    plan.copies.append((c.seq, t))
                    t.n_cached = t.n_prompt
                    completing.add(t)
        return completing

    @staticmethod
    def _sibling_prefilling(s: Sequence, chunks: list[Chunk]) -> bool:
        planned = {id(c.seq) for c in chunks}
        return any(
            t is not s and not t.done and t.row is not None and (t.n_cached > 0 or id(t) in planned)
            for t in s.group.seqs
        )

    @staticmethod
    def _siblings_waiting(s: Sequence) -> list[Sequence]:
        """The other choices of s's request that hold a row and have not started: they copy s's prompt."""
        if s.generated:
            return []
        return [
            t
            for t in s.group.seqs
            if t is not s and t.row is not None and t.n_cached == 0 and not t.done and not t.generated
        ]
