"""Text generation: generate, stream_generate and batch_generate.

Every call runs the engine core (`bitnetlm.engine.core`: the scheduler and worker the server uses too) over the
model's runner for its device (`bitnetlm.runtime.runner_for`), stepped in the caller's thread. Each prompt holds
a row of the runner's KV cache at its own positions, so a row computes what it would compute alone: a single
prompt is a batch of one through the same code.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from bitnetlm.engine.scheduler import ContextShift
from bitnetlm.engine.sequence import GenerationRequest, Token
from bitnetlm.engine.speculative import SpeculativeConfig
from bitnetlm.kernels import torch_threads_beside_c
from bitnetlm.runtime.config import RuntimeConfig
from bitnetlm.sampling import SamplingParams

PREFILL_CHUNK = 2048  # prompt tokens prefilled per step

_ALIASES = {
    "temp": "temperature",
    "max_new_tokens": "max_tokens",
    "repeat_penalty": "repetition_penalty",
    "stop_strings": "stop",
}


@dataclass
class GenerationChunk:
    """One generated token (streamed). `text` is what this token adds to the visible output (may be "")."""

    text: str
    token: int
    logprob: float
    finish_reason: str | None  # None while generating, then "stop" or "length"
    index: int = 0  # row of the batch
    finish_detail: str | None = None  # why it finished, where the reason alone does not say (a full context)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prompt_tps: float = 0.0  # prompt tokens / prefill seconds (all rows of the batch)
    generation_tps: float = 0.0  # decode tokens / s for this row, after the first token
    ttft_s: float = 0.0  # seconds from the start of the call to this row's first token
    top_logprobs: list[tuple[int, float]] | None = None
    draft_tokens: int = 0  # speculative decoding: this row's draft tokens scored so far ...
    accepted_tokens: int = 0  # ... and accepted


class GenerationResult(str):
    """The generated text (a str) carrying the run's details as attributes.

    tokens, finish_reason, finish_detail, prompt_tokens, generation_tokens, prompt_tps, generation_tps, ttft_s, total_s,
    logprobs (one per generated token).
    """

    def __new__(cls, text: str, **info):
        obj = super().__new__(cls, text)
        obj.__dict__.update(info)
        return obj

    @property
    def text(self) -> str:
        return str(self)

    def to_dict(self) -> dict:
        return {"text": str(self), **self.__dict__}


def make_params(params: SamplingParams | None = None, **kwargs) -> SamplingParams:
    """SamplingParams from an optional base plus keyword overrides (llama.cpp / mlx-lm aliases accepted)."""
    kw = {}
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    for k, v in kwargs.items():
        k = _ALIASES.get(k, k)
        if k not in names:
            raise TypeError(f"unknown generation parameter {k!r}; known: {', '.join(sorted(names))}")
        kw[k] = v
    if params is None:
        return SamplingParams(**kw)
    return dataclasses.replace(params, **kw) if kw else params


def prompt_to_ids(tok, prompt, system: str | None = None, chat: bool = False) -> list[int]:
    """Token ids for a prompt: ids as-is, a list of chat messages through the chat template, or text.

    Text is encoded with the tokenizer's special tokens (BOS); with chat=True (or a system prompt) it becomes
    one user message rendered by the chat template.
    """
    if isinstance(prompt, torch.Tensor):
        return [int(i) for i in prompt.reshape(-1).tolist()]
    if isinstance(prompt, str):
        if not (chat or system):
            return tok.encode(prompt, add_special_tokens=True)
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        msgs = list(prompt)
        if system and not any(m.get("role") == "system" for m in msgs):
            msgs = [{"role": "system", "content": system}, *msgs]
        return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(prompt, (list, tuple)) and all(isinstance(i, int) for i in prompt):
        return [int(i) for i in prompt]
    raise TypeError(
        "prompt must be a str, a list of chat messages ({'role', 'content'} dicts) or a list of token ids; "
        f"got {type(prompt).__name__}"
    )


def context_length(model, ctx_size: int | None = None) -> int:
    """Positions available: --ctx-size if given, else the model's max_position_embeddings."""
    cfg = getattr(model, "config", None)
    n = ctx_size or getattr(cfg, "max_position_embeddings", None)
    if not n:
        raise ValueError(
            "context length unknown: the model config has no max_position_embeddings; pass ctx_size"
        )
    return int(n)


def _check_prompts(prompts, ctx: int) -> None:
    """Errors for empty prompts and prompts that fill the context."""
    for i, ids in enumerate(prompts):
        if not ids:
            raise ValueError(f"prompt {i} is empty (0 tokens); give some text or a tokenizer that adds BOS")
        if len(ids) >= ctx:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens but the context holds {ctx} positions "
                f"(max_position_embeddings or --ctx-size); shorten the prompt or raise --ctx-size"
            )


def _eos_ids(model, tok) -> list[int]:
    eos = list(getattr(tok, "eos_token_ids", []) or [])
    for i in getattr(getattr(model, "config", None), "eos_token_ids", []) or []:
        if i not in eos:
            eos.append(i)
    return eos


def _chunk(ev: Token, index: int, t0: float, prompt_tps: float) -> GenerationChunk:
    s = ev.seq
    n = ev.count
    first = s.group.first_token_at
    return GenerationChunk(
        text=ev.text,
        token=ev.token,
        logprob=ev.logprob,
        finish_reason=ev.finish_reason,
        index=index,
        finish_detail=s.finish_detail if ev.finish_reason else None,
        prompt_tokens=s.n_prompt,
        generation_tokens=n,
        prompt_tps=prompt_tps,
        generation_tps=(n - 1) / (ev.time - first) if n > 1 and ev.time > first else 0.0,
        ttft_s=first - t0,
        top_logprobs=ev.top,
        draft_tokens=s.drafted,
        accepted_tokens=s.accepted,
    )


def _engine(
    model,
    tok,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    ctx_size: int | None = None,
    runtime: RuntimeConfig | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
    speculative: SpeculativeConfig | None = None,
    context_shift: ContextShift | None = None,
) -> Iterator[GenerationChunk]:
    """The generation loop of every offline call: the engine core over the model's runner, stepped here."""
    from bitnetlm.engine.core import EngineCore
    from bitnetlm.runtime import runner_for

    t0 = time.perf_counter()
    ctx = context_length(model, ctx_size)
    _check_prompts(prompts, ctx)
    todo = [i for i, p in enumerate(params) if p.max_tokens > 0]
    if not todo:
        return
    need = min(ctx, max(len(prompts[i]) + params[i].max_tokens for i in todo))
    runner = runner_for(model, runtime, rows=len(todo), max_seq_len=need)
    core = EngineCore(
        runner,
        tok,
        _eos_ids(model, tok),
        prefill_chunk=prefill_chunk,
        speculative=speculative,
        context=ctx,
        context_shift=context_shift,
    )
    events: list = []
    index = {}  # request id -> its prompt's index
    for i in todo:
        index[core.add(GenerationRequest(list(prompts[i]), params[i]), events.append).id] = i
    n_prompt = sum(len(prompts[i]) for i in todo)
    prompt_tps = 0.0
    with torch_threads_beside_c(model):
        try:
            while core.has_work():
                core.step()
                if not prompt_tps and any(isinstance(e, Token) for e in events):
                    prompt_tps = n_prompt / max(time.perf_counter() - t0, 1e-9)
                for ev in events:
                    if isinstance(ev, Token):
                        yield _chunk(ev, index[ev.seq.group.id], t0, prompt_tps)
                events.clear()
        finally:
            for g in {id(s.group): s.group for s in core.running()}.values():
                core.abort(g)  # an abandoned stream frees its rows
            core.drain()


def _runtime(runtime: RuntimeConfig | None, enforce_eager: bool) -> RuntimeConfig | None:
    if not enforce_eager:
        return runtime
    return (runtime or RuntimeConfig()).replace(enforce_eager=True)


def stream_generate(
    model,
    tok,
    prompt,
    params: SamplingParams | None = None,
    *,
    system: str | None = None,
    chat: bool = False,
    ctx_size: int | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
    runtime: RuntimeConfig | None = None,
    enforce_eager: bool = False,
    speculative: SpeculativeConfig | None = None,
    context_shift: bool = False,
    n_keep: int = 0,
    **kwargs,
) -> Iterator[GenerationChunk]:
    """Yield one GenerationChunk per generated token; the last one has finish_reason set.

    prompt: text (encoded with BOS), chat messages (rendered by the chat template) or token ids.
    kwargs: SamplingParams fields (max_tokens, temperature, top_k, top_p, min_p, seed, stop, ...).
    runtime: how to run the model (default: what `bitnetlm.load` was given for it); on CUDA the decode steps
    replay captured graphs, and enforce_eager=True runs the model's own forward instead (as vLLM's).
    speculative: draft and verify several tokens a step (prompt lookup, a draft model, or both; same outputs).
    context_shift: at the end of the context window keep the first n_keep prompt tokens (after BOS; -1: the whole
    prompt), drop the oldest half of the rest and go on (llama.cpp's context shift); without it generation ends
    there with finish_reason "length" and a finish_detail saying so.
    """
    p = make_params(params, **kwargs)
    ids = prompt_to_ids(tok, prompt, system=system, chat=chat)
    rt = _runtime(runtime, enforce_eager)
    yield from _engine(
        model,
        tok,
        [ids],
        [p],
        ctx_size=ctx_size,
        runtime=rt,
        prefill_chunk=prefill_chunk,
        speculative=speculative,
        context_shift=_context_shift(model, context_shift, n_keep),
    )


def _context_shift(model, on: bool, n_keep: int) -> ContextShift | None:
    return ContextShift(n_keep).check(model.config) if on else None


def _result(chunks: list[GenerationChunk], n_prompt: int, t0: float) -> GenerationResult:
    text = "".join(c.text for c in chunks)
    last = chunks[-1] if chunks else None
    return GenerationResult(
        text,
        tokens=[c.token for c in chunks],
        logprobs=[c.logprob for c in chunks],
        finish_reason=last.finish_reason if last else "length",
        finish_detail=last.finish_detail if last else None,
        prompt_tokens=n_prompt,
        generation_tokens=len(chunks),
        prompt_tps=last.prompt_tps if last else 0.0,
        generation_tps=last.generation_tps if last else 0.0,
        ttft_s=last.ttft_s if last else 0.0,
        total_s=time.perf_counter() - t0,
        draft_tokens=last.draft_tokens if last else 0,
        accepted_tokens=last.accepted_tokens if last else 0,
    )


def generate(
    model,
    tok,
    prompt,
    params: SamplingParams | None = None,
    *,
    system: str | None = None,
    chat: bool = False,
    ctx_size: int | None = None,
    verbose: bool = False,
    runtime: RuntimeConfig | None = None,
    enforce_eager: bool = False,
    speculative: SpeculativeConfig | None = None,
    context_shift: bool = False,
    n_keep: int = 0,
    **kwargs,
) -> GenerationResult:
    """Generate a completion; returns the text (a str subclass with .tokens, .finish_reason, timings...)."""
    t0 = time.perf_counter()
    p = make_params(params, **kwargs)
    ids = prompt_to_ids(tok, prompt, system=system, chat=chat)
    chunks = []
    rt = _runtime(runtime, enforce_eager)
    shift = _context_shift(model, context_shift, n_keep)
    for c in _engine(
        model, tok, [ids], [p], ctx_size=ctx_size, runtime=rt, speculative=speculative, context_shift=shift
    ):
        chunks.append(c)
        if verbose:
            print(c.text, end="", flush=True)
    res = _result(chunks, len(ids), t0)
    if verbose:
        print(file=sys.stdout)
        print(format_stats(res), file=sys.stderr)
    return res


def batch_generate(
    model,
    tok,
    prompts: Sequence,
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    system: str | None = None,
    chat: bool = False,
    ctx_size: int | None = None,
    runtime: RuntimeConfig | None = None,
    enforce_eager: bool = False,
    speculative: SpeculativeConfig | None = None,
    context_shift: bool = False,
    n_keep: int = 0,
    **kwargs,
) -> list[GenerationResult]:
    """Generate for several prompts at once (one KV row each); each result equals generating it alone."""
    t0 = time.perf_counter()
    prompts = list(prompts)
    if isinstance(params, (list, tuple)):
        if len(params) != len(prompts):
            raise ValueError(f"batch_generate: {len(prompts)} prompts but {len(params)} SamplingParams")
        plist = [make_params(p, **kwargs) for p in params]
    else:
        plist = [make_params(params, **kwargs)] * len(prompts)
    ids = [prompt_to_ids(tok, p, system=system, chat=chat) for p in prompts]
    per_row: list[list[GenerationChunk]] = [[] for _ in prompts]
    rt = _runtime(runtime, enforce_eager)
    shift = _context_shift(model, context_shift, n_keep)
    for c in _engine(
        model, tok, ids, plist, ctx_size=ctx_size, runtime=rt, speculative=speculative, context_shift=shift
    ):
        per_row[c.index].append(c)
    return [_result(ch, len(i), t0) for ch, i in zip(per_row, ids, strict=True)]


def format_stats(r) -> str:
    """The --verbose line: prompt and generation throughput, time to first token (and draft acceptance)."""
    line = (
        f"prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.2f} tokens/s | "
        f"generation: {r.generation_tokens} tokens, {r.generation_tps:.2f} tokens/s | "
        f"time to first token: {r.ttft_s * 1000:.1f} ms | finish: {r.finish_reason}"
    )
    drafted = getattr(r, "draft_tokens", 0)
    if drafted:
        line += f" | draft: {r.accepted_tokens}/{drafted} accepted ({r.accepted_tokens / drafted:.0%})"
    detail = getattr(r, "finish_detail", None)
    return f"{line} ({detail})" if detail else line
