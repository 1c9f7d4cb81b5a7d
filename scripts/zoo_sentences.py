"""Sentences of the Austen corpus for the sentence-embedding zoo model, and its quality measures against a teacher.

Split: the last HELDOUT_FRAC of each novel's sentences is held out (it contains the novels' last 4096 tokens that
the language models of the zoo hold out too); training reads only the rest.
Quality: on held-out sentence pairs (each sentence with its next sentence, and with a sentence of another novel),
the Spearman correlation of the student's pair similarities with the teacher's, and recall@10 of retrieving a
sentence's next sentence among all held-out next sentences (for teacher and student alike).
"""

from __future__ import annotations

import os
import random
import re

import torch

NOVELS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")
HELDOUT_FRAC = 0.1
# after . ! ? (or one closing quote after them), not after a title's abbreviation
_SPLIT = re.compile(r"(?:(?<=[.!?])(?<!Mr\.)(?<!Mrs\.)(?<!Dr\.)(?<!St\.)|(?<=[.!?][\"']))\s+(?=[\"'A-Z])")


def novel_sentences(path: str, min_words: int = 4, max_words: int = 80) -> list[str]:
    """A novel's sentences in order: paragraphs joined, split after . ! ?, headings and fragments dropped."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    out = []
    for para in re.split(r"\n\s*\n", text):
        para = " ".join(para.split()).replace("_", "")
        for s in _SPLIT.split(para):
            n = len(s.split())
            if min_words <= n <= max_words and not s.isupper():
                out.append(s)
    return out


def austen_split(root: str) -> tuple[list[str], dict[str, list[str]]]:
    """(training sentences of all novels, {novel: held-out sentences in order})."""
    train, held = [], {}
    for name in NOVELS:
        s = novel_sentences(os.path.join(root, f"{name}.txt"))
        cut = int(len(s) * (1 - HELDOUT_FRAC))
        train += s[:cut]
        held[name] = s[cut:]
    return train, held


def heldout_pairs(held: dict[str, list[str]], n: int = 2000, seed: int = 0) -> list[tuple[str, str]]:
    """Pairs of held-out sentences: half neighbours (a sentence and the next), half from two different novels."""
    rng = random.Random(seed)
    names = sorted(held)
    pairs = []
    for i in range(n):
        a = rng.choice(names)
        j = rng.randrange(len(held[a]) - 1)
        if i % 2 == 0:
            pairs.append((held[a][j], held[a][j + 1]))
        else:
            b = rng.choice([x for x in names if x != a])
            pairs.append((held[a][j], rng.choice(held[b])))
    return pairs


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman rank correlation (no ties expected in float similarities)."""

    def ranks(v):
        r = torch.empty_like(v, dtype=torch.float64)
        r[v.argsort()] = torch.arange(len(v), dtype=torch.float64)
        return r

    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / (rx.norm() * ry.norm()))


def recall_at_k(q: torch.Tensor, d: torch.Tensor, k: int = 10) -> float:
    """Fraction of queries q[i] whose document d[i] is among the k most similar rows of d (cosine)."""
    q = torch.nn.functional.normalize(q, dim=-1)
    d = torch.nn.functional.normalize(d, dim=-1)
    top = (q @ d.T).topk(k, dim=-1).indices
    return float((top == torch.arange(len(q))[:, None]).any(-1).float().mean())


def quality(embed_fn, teacher_fn, held: dict[str, list[str]], n_pairs: int = 2000) -> dict:
    """Spearman of pair similarities vs the teacher's, and next-sentence recall@10 for both models."""
    pairs = heldout_pairs(held, n_pairs)
    a, b = [p[0] for p in pairs], [p[1] for p in pairs]
    queries = [s for name in sorted(held) for s in held[name][:-1]]
    docs = [s for name in sorted(held) for s in held[name][1:]]

    def sims(fn):
        x, y = fn(a), fn(b)
        return torch.nn.functional.cosine_similarity(x, y)

    st, ss = sims(teacher_fn), sims(embed_fn)
    return {
        "pairs": len(pairs),
        "spearman_vs_teacher": spearman(ss, st),
        "retrieval_queries": len(queries),
        "recall10_teacher": recall_at_k(teacher_fn(queries), teacher_fn(docs)),
        "recall10_student": recall_at_k(embed_fn(queries), embed_fn(docs)),
    }
