"""The engine core: one generation loop (a scheduler and a worker over a runner), driven one step at a time.

Offline generation (`bitnetlm.generate`) steps it in the caller's thread until its requests end; the server
(`bitnetlm.serve.engine.Engine`) steps it on a thread of its own while requests come and go. Every request is a
`Group` of choices; its events (`Token`, `Finished`, `Failed`) go to its sink on the stepping thread.
"""

from __future__ import annotations

import torch

from bitnetlm.engine import grammar
from bitnetlm.engine.metrics import Metrics
from bitnetlm.engine.scheduler import ContextShift, Scheduler, SchedulerConfig
from bitnetlm.engine.sequence import GenerationRequest, Group, Sequence
from bitnetlm.engine.speculative import SpeculativeConfig, Speculator
from bitnetlm.engine.worker import Worker
from bitnetlm.sampling import RowRandom
from bitnetlm.text.detok import StreamDetokenizer


class EngineCore:
    def __init__(
        self,
        runner,
        tokenizer,
        eos_ids=(),
        prefill_chunk: int = 512,
        metrics: Metrics | None = None,
        speculative: SpeculativeConfig | None = None,
        prefix_reuse: bool = True,
        context: int | None = None,
        context_shift: ContextShift | None = None,
    ):
        """context: the window a sequence's positions stay in (default: the runner's); a request that would
        pass it ends there with "length" (and says so), or with `context_shift` shifts its row and goes on."""
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, found {prefill_chunk}")
        self.runner, self.tokenizer = runner, tokenizer
        self.eos_ids = {int(i) for i in eos_ids if i is not None}
        self.context = context or runner.max_seq_len
        self.context_shift = context_shift
        batched = runner.batched_prefill
        pool = getattr(runner, "pool", None)  # a paged KV cache's blocks (runtime/blocks.py)
        self.scheduler = Scheduler(
            SchedulerConfig(
                runner.rows,
                prefill_chunk,
                batched,
                not batched,
                context=self.context,
                prefix_reuse=prefix_reuse,
                ring=runner.ring,
                kv_blocks=pool.num_blocks if pool is not None else 0,
                block_size=pool.block_size if pool is not None else 16,
                lookup=runner.cached_prefix if pool is not None else None,
                free=pool.available if pool is not None else None,
                cost=runner.admission_cost if pool is not None and prefix_reuse else None,
            )
        )
        self.speculator = speculator(runner, speculative, metrics, min(self.context, runner.max_seq_len))
        self.worker = Worker(runner, self.scheduler, metrics, self.speculator)
        self.inflight = None  # the decode step whose tokens are still on their way to the host
        self.steps = 0
        self.overlapped = 0  # steps queued before the last step's tokens (or a prompt's first) were read

    def add(self, req: GenerationRequest, sink, max_tokens: int | None = None) -> Group:
        """Queue `req` (its `n` choices); `sink(event)` gets its events. Choice i of a seeded request draws from
        seed + i (choice 0 is what offline `generate` samples with that seed)."""
        g = Group(req, sink, max_tokens)
        n, ctx = len(req.prompt_ids), self.context
        if n >= ctx:
            raise ValueError(f"the prompt has {n} tokens but the context window holds {ctx} positions")
        self.check_blocks(n, g.max_tokens)
        keep = None
        if self.context_shift is not None:
            keep = self.context_shift.keep(req.prompt_ids, getattr(self.tokenizer, "bos_token_id", None), ctx)
        elif n + g.max_tokens >= ctx:
            g.max_tokens = ctx - n
            g.length_detail = (
                f"the context window is full ({n} prompt + {g.max_tokens} generated tokens of {ctx} positions); "
                "context shift (--context-shift) generates past it"
            )
        p = req.params
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
        compiled = self.compile(p.structured, stop_ids) if p.structured is not None else None
        dev = self.runner.device
        for i in range(req.n):
            gen = None if p.seed is None else torch.Generator(device=dev).manual_seed(int(p.seed) + i)
            detok = StreamDetokenizer(self.tokenizer, skip_special_tokens=p.skip_special_tokens)
            c = grammar.Constraint(compiled) if compiled is not None else None
            s = Sequence(g, i, detok, stop_ids, RowRandom(gen, dev), keep, c)
            g.seqs.append(s)
            self.scheduler.add(s)
        return g

    def check_blocks(self, n_prompt: int, max_tokens: int) -> None:
        """ValueError for a request whose sequence could fill more blocks than a paged KV cache holds: alone in
        the pool it could not finish (vLLM refuses at start a cache that cannot hold one request of the context;
        here a smaller pool refuses only the requests it cannot hold)."""
        cfg = self.scheduler.config
        if not cfg.kv_blocks:
            return
        n = min(n_prompt + max_tokens, self.context)
        if -(-n // cfg.block_size) > cfg.kv_blocks:
            raise ValueError(
                f"the request may fill {n} KV positions ({n_prompt} prompt + up to {max_tokens} generated), more "
                f"than the paged KV cache holds: {cfg.kv_blocks * cfg.block_size} (--kv-tokens)"
            )

    def compile(self, structured, stop_ids=None):
        """`structured` (a StructuredOutput) compiled for this engine's tokenizer, its sequences ending on
        `stop_ids` (default: the end-of-sequence ids); ValueError naming what cannot be enforced (the server calls
        it before it accepts a request)."""
        ends = self.eos_ids if stop_ids is None else stop_ids
        return grammar.compile_grammar(structured, self.tokenizer, ends, self.runner.vocab_size)

    def abort(self, g: Group) -> None:
        """End request `g` now: its queued choices leave the queue, running ones give their row back."""
        g.cancelled = True
        for s in g.seqs:
            self.scheduler.finish(s)
            self.worker.forget(s)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.inflight is not None

    def step(self) -> None:
        """Plan and run one step. A pipelined step queues its decode before it reads the last step's tokens."""
        self.steps += 1
        w = self.worker
        plan = self.scheduler.schedule()
        # (penalties and grammars need every step's tokens on the host; so does a speculating step's acceptance)
        pipelined = (
            self.runner.pipelined
            and self.speculator is None
            and not any(
                s.params.needs_penalties or s.constraint is not None for s in self.scheduler.running.values()
            )
        )
        if self.inflight is not None and not pipelined:  # this step's decode needs the tokens on the host
            old, self.inflight = self.inflight, None
            w.collect(old)
        with torch.inference_mode():
            first, step = w.execute(plan, pipelined)
        old, self.inflight = self.inflight, step
        if pipelined and step is not None and (old is not None or first is not None):
            self.overlapped += 1
        if old is not None:
            w.collect(old)
        if first is not None:
            w.collect(first)

    def drain(self) -> None:
        """Read the step still in flight (its tokens reach their sequences, or are dropped for ended ones)."""
        if self.inflight is not None:
            old, self.inflight = self.inflight, None
            self.worker.collect(old)

    def running(self) -> list[Sequence]:
        return list(self.scheduler.running.values())


def speculator(
    runner, config: SpeculativeConfig | None, metrics: Metrics | None = None, context: int | None = None
) -> Speculator | None:
    """The speculator of `config` over `runner` (a draft model gets a runner of its own with the same rows), or
    None when it speculates not; no draft reaches past `context` positions (default: the runner's)."""
    if config is None or not config.enabled:
        return None
    draft = None
    if config.draft is not None:
        from bitnetlm.runtime import config_for, make_runner

        dm = config.draft
        if dm.config.vocab_size != runner.vocab_size:
            raise ValueError(
                f"draft model: its vocabulary has {dm.config.vocab_size} tokens, the target's {runner.vocab_size}; "
                "a draft model must share the target's tokenizer"
            )
        # (a static cache: only the target's KV cache is paged, and only its blocks preempt)
        draft = make_runner(dm, config_for(dm).replace(kv_tokens=None), runner.rows, runner.max_seq_len)
    return Speculator(config, runner, draft, metrics, context)
