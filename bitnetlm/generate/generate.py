"""Text generation: generate, stream_generate and batch_generate over one engine loop.

Batching: prompts of different lengths are LEFT-padded to a common length Lmax. Every row writes prompt token
t to cache slot t (padding slots are marked invalid through `input_mask`, so nothing ever attends to them), and
gets RoPE positions that start at 0 at its first real token. Decode step s writes all rows to slot Lmax + s at
position len(row) + s. A row therefore sees exactly the keys, at exactly the positions, that it would see
alone; a single prompt is just a batch of one through the same code.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from bitnetlm.generate.detok import StreamDetokenizer
from bitnetlm.generate.sampling import RowRandom, SamplingParams, sample
from bitnetlm.kernels import torch_threads_beside_c

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
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prompt_tps: float = 0.0  # prompt tokens / prefill seconds (all rows of the batch)
    generation_tps: float = 0.0  # decode tokens / s for this row, after the first token
    ttft_s: float = 0.0  # seconds from the start of the call to this row's first token
    top_logprobs: list[tuple[int, float]] | None = None


class GenerationResult(str):
    """The generated text (a str) carrying the run's details as attributes.

    tokens, finish_reason, prompt_tokens, generation_tokens, prompt_tps, generation_tps, ttft_s, total_s,
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


def _device(model) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def context_length(model, ctx_size: int | None = None) -> int:
    """Positions available: --ctx-size if given, else the model's max_position_embeddings."""
    cfg = getattr(model, "config", None)
    n = ctx_size or getattr(cfg, "max_position_embeddings", None)
    if not n:
        raise ValueError(
            "context length unknown: the model config has no max_position_embeddings; pass ctx_size"
        )
    return int(n)


class _Row:
    def __init__(self, index, ids, params, tok, eos_ids, max_new, device):
        self.index = index
        self.ids = ids
        self.params = params
        self.generator = RowRandom(params.make_generator(device), device)  # the row's uniforms
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.max_new = max_new
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.detok = StreamDetokenizer(tok, skip_special_tokens=params.skip_special_tokens)
        self.held = ""  # text withheld because it may be the start of a stop string
        self.text = ""  # visible output so far
        self.finish_reason: str | None = None
        self.t_first: float | None = None

    def _scan(self, delta: str, final: bool) -> str:
        """Add decoded text; return the part that is safe to show (stop strings are cut, never shown)."""
        buf = self.held + delta
        stops = self.params.stop
        if stops:
            hits = [(buf.find(s), s) for s in stops]
            hits = [h for h in hits if h[0] >= 0]
            if hits:
                at = min(h[0] for h in hits)
                self.held = ""
                self.finish_reason = "stop"
                return buf[:at]
            if not final:
                # hold back the longest tail of buf that could still grow into a stop string
                keep = 0
                for s in stops:
                    for n in range(min(len(s) - 1, len(buf)), keep, -1):
                        if buf.endswith(s[:n]):
                            keep = n
                            break
                self.held = buf[len(buf) - keep :] if keep else ""
                return buf[: len(buf) - keep]
        self.held = ""
        return buf

    def push(self, token: int) -> str:
        """Record a sampled token; return its visible text and set finish_reason when the row ends."""
        self.out.append(token)
        if token in self.stop_ids:
            # the stop token itself is never shown; flush any incomplete character held by the detokenizer
            self.finish_reason = "stop"
            text = self._scan(self.detok.finalize(), final=True)
        else:
            text = self._scan(self.detok.add(token), final=False)
            if self.finish_reason is None and len(self.out) >= self.max_new:
                self.finish_reason = "length"
                text += self._scan(self.detok.finalize(), final=True)
        self.text += text
        return text


def _rows(model, tok, prompts, params, ctx_size) -> tuple[list[_Row], torch.device, int]:
    """Validate the prompts against the context and build one _Row per prompt: (rows, device, context)."""
    device = _device(model)
    ctx = context_length(model, ctx_size)
    cfg = getattr(model, "config", None)
    eos_ids = list(getattr(tok, "eos_token_ids", []) or [])
    for i in getattr(cfg, "eos_token_ids", []) or []:
        if i not in eos_ids:
            eos_ids.append(i)
    rows = []
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        if not ids:
            raise ValueError(f"prompt {i} is empty (0 tokens); give some text or a tokenizer that adds BOS")
        if len(ids) >= ctx:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens but the context holds {ctx} positions "
                f"(max_position_embeddings or --ctx-size); shorten the prompt or raise --ctx-size"
            )
        rows.append(_Row(i, ids, p, tok, eos_ids, min(p.max_tokens, ctx - len(ids)), device))
    return rows, device, ctx


def _emit(active, out, toks, lps, now, t0, prompt_tps) -> Iterator[GenerationChunk]:
    """Push one sampled token into each active row and yield its chunk (out: the SampleOutput, for top ids)."""
    for j, r in enumerate(active):
        if r.t_first is None:
            r.t_first = now
        text = r.push(toks[j])
        r.logprobs.append(lps[j])
        top = None
        if r.params.top_logprobs and out.top_ids is not None:
            k = r.params.top_logprobs
            top = list(zip(out.top_ids[j, :k].tolist(), out.top_logprobs[j, :k].tolist(), strict=True))
        n = len(r.out)
        yield GenerationChunk(
            text=text,
            token=toks[j],
            logprob=lps[j],
            finish_reason=r.finish_reason,
            index=r.index,
            prompt_tokens=len(r.ids),
            generation_tokens=n,
            prompt_tps=prompt_tps,
            generation_tps=(n - 1) / (now - r.t_first) if n > 1 and now > r.t_first else 0.0,
            ttft_s=r.t_first - t0,
            top_logprobs=top,
        )


def _engine(
    model,
    tok,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    ctx_size: int | None = None,
    prefill_chunk: int = 2048,
    enforce_eager: bool = False,
) -> Iterator[GenerationChunk]:
    t0 = time.perf_counter()
    rows, device, ctx = _rows(model, tok, prompts, params, ctx_size)
    rows_todo = [r for r in rows if r.max_new > 0]
    if not rows_todo:
        return
    for r in rows:
        if r.max_new <= 0:
            r.finish_reason = "length"
    if device.type == "cuda" and not enforce_eager:
        from bitnetlm.generate.graph import graph_engine, run_graph

        eng = graph_engine(model, len(rows), max(len(r.ids) for r in rows) + max(r.max_new for r in rows))
        if eng is not None:
            yield from run_graph(eng, rows, t0)
            return
    b = len(rows)
    lens = torch.tensor([len(r.ids) for r in rows], device=device)  # [B]
    lmax = int(lens.max())
    pad = tok.pad_token_id if getattr(tok, "pad_token_id", None) is not None else 0
    input_ids = torch.full((b, lmax), int(pad), dtype=torch.long)
    for r in rows:
        input_ids[r.index, lmax - len(r.ids) :] = torch.tensor(r.ids, dtype=torch.long)
    input_ids = input_ids.to(device)
    slots = torch.arange(lmax, device=device)  # [Lmax]
    offset = (lmax - lens)[:, None]  # [B, 1] left padding per row
    input_mask = slots[None, :] >= offset  # [B, Lmax]
    positions = (slots[None, :] - offset).clamp(min=0)  # [B, Lmax]
    cache_pos = slots[None, :].expand(b, lmax)  # [B, Lmax]
    max_new = max(r.max_new for r in rows)
    cache = model.new_cache(b, lmax + max_new, device=device)
    n_prompt = int(lens.sum())
    top_n = max(r.params.top_logprobs for r in rows)

    with torch.inference_mode(), torch_threads_beside_c(model):
        for s in range(0, lmax, prefill_chunk):
            e = min(s + prefill_chunk, lmax)
            logits = model(
                input_ids[:, s:e],
                positions=positions[:, s:e],
                cache=cache,
                cache_pos=cache_pos[:, s:e],
                input_mask=None if bool(input_mask[:, s:e].all()) else input_mask[:, s:e],
                last_only=True,
            )
        t_prefill = time.perf_counter()
        prompt_tps = n_prompt / max(t_prefill - t0, 1e-9)
        step = 0
        while True:
            active = [r for r in rows if r.finish_reason is None]
            idx = torch.tensor([r.index for r in active], device=device)
            out = sample(
                logits[:, -1][idx],
                [r.params for r in active],
                [r.generator for r in active],
                prompt_tokens=[r.ids for r in active],
                output_tokens=[r.out for r in active],
                num_top_logprobs=top_n,
            )
            toks = out.tokens.tolist()
            lps = out.logprobs.tolist()
            yield from _emit(active, out, toks, lps, time.perf_counter(), t0, prompt_tps)
            if all(r.finish_reason is not None for r in rows):
                return
            # feed the sampled tokens; finished rows feed padding that is never attended to
            feed = torch.full((b, 1), int(pad), dtype=torch.long)
            live = torch.zeros(b, 1, dtype=torch.bool)
            for j, r in enumerate(active):
                if r.finish_reason is None:
                    feed[r.index, 0] = toks[j]
                    live[r.index, 0] = True
            pos = (lens + step)[:, None]  # [B, 1]
            slot = torch.full((b, 1), lmax + step, dtype=torch.long, device=device)  # [B, 1]
            logits = model(
                feed.to(device),
                positions=pos,
                cache=cache,
                cache_pos=slot,
                input_mask=None if bool(live.all()) else live.to(device),
                last_only=True,
            )
            step += 1


def stream_generate(
    model,
    tok,
    prompt,
    params: SamplingParams | None = None,
    *,
    system: str | None = None,
    chat: bool = False,
    ctx_size: int | None = None,
    prefill_chunk: int = 2048,
    enforce_eager: bool = False,
    **kwargs,
) -> Iterator[GenerationChunk]:
    """Yield one GenerationChunk per generated token; the last one has finish_reason set.

    prompt: text (encoded with BOS), chat messages (rendered by the chat template) or token ids.
    kwargs: SamplingParams fields (max_tokens, temperature, top_k, top_p, min_p, seed, stop, ...).
    On CUDA the decode steps replay a CUDA graph (bitnetlm.engine_cuda); enforce_eager=True runs the model's
    own forward instead (as vLLM's enforce_eager).
    """
    p = make_params(params, **kwargs)
    ids = prompt_to_ids(tok, prompt, system=system, chat=chat)
    yield from _engine(
        model, tok, [ids], [p], ctx_size=ctx_size, prefill_chunk=prefill_chunk, enforce_eager=enforce_eager
    )


def _result(chunks: list[GenerationChunk], n_prompt: int, t0: float) -> GenerationResult:
    text = "".join(c.text for c in chunks)
    last = chunks[-1] if chunks else None
    return GenerationResult(
        text,
        tokens=[c.token for c in chunks],
        logprobs=[c.logprob for c in chunks],
        finish_reason=last.finish_reason if last else "length",
        prompt_tokens=n_prompt,
        generation_tokens=len(chunks),
        prompt_tps=last.prompt_tps if last else 0.0,
        generation_tps=last.generation_tps if last else 0.0,
        ttft_s=last.ttft_s if last else 0.0,
        total_s=time.perf_counter() - t0,
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
    enforce_eager: bool = False,
    **kwargs,
) -> GenerationResult:
    """Generate a completion; returns the text (a str subclass with .tokens, .finish_reason, timings...)."""
    t0 = time.perf_counter()
    p = make_params(params, **kwargs)
    ids = prompt_to_ids(tok, prompt, system=system, chat=chat)
    chunks = []
    for c in _engine(model, tok, [ids], [p], ctx_size=ctx_size, enforce_eager=enforce_eager):
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
    enforce_eager: bool = False,
    **kwargs,
) -> list[GenerationResult]:
    """Generate for several prompts at once (left-padded batch); each result equals generating it alone."""
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
    for c in _engine(model, tok, ids, plist, ctx_size=ctx_size, enforce_eager=enforce_eager):
        per_row[c.index].append(c)
    return [_result(ch, len(i), t0) for ch, i in zip(per_row, ids, strict=True)]


def format_stats(r) -> str:
    """The --verbose line: prompt and generation throughput and time to first token."""
    return (
        f"prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.2f} tokens/s | "
        f"generation: {r.generation_tokens} tokens, {r.generation_tps:.2f} tokens/s | "
        f"time to first token: {r.ttft_s * 1000:.1f} ms | finish: {r.finish_reason}"
    )
