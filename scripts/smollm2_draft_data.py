#!/usr/bin/env python3
"""The target's own greedy text, to distill a draft model on (sequence-level distillation).

A draft is accepted where its argmax equals the target's, on the text the target writes: so the draft learns from
that text. This script builds prompts of the kinds users ground generation in (copy a passage, copy it with a
name changed, restate a function, repeat a list, continue prose), from text the speculative benchmark does not use
(five Austen novels, Pride and Prejudice left out, and the Python standard library), with varied wording, and
writes each prompt's ids and the target's greedy continuation (--tokens ids, ignore_eos) as one JSON line.
Appends; stop it any time (each batch is written whole).

    python scripts/smollm2_draft_data.py --out runs/draft-data.jsonl --prompts 2000
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import sysconfig
import time

NOVELS = ("emma", "mansfieldpark", "northangerabbey", "persuasion", "sensesensibility")
NAMES = ("Lizzy", "Anne", "Harriet", "Fanny", "Marianne", "Edmund", "Henry", "Kitty", "Robert", "Mary")


def _para(rng: random.Random, texts: list[str], chars: int) -> str:
    t = rng.choice(texts)
    at = rng.randrange(0, len(t) - chars - 1)
    return " ".join(t[at : at + chars].split())


def _function(rng: random.Random, sources: list[str]) -> str:
    while True:
        src = rng.choice(sources)
        starts = [m.start() for m in re.finditer(r"(?m)^( {4})?def ", src)]
        if starts:
            at = rng.choice(starts)
            return src[at : at + rng.randrange(600, 1800)]


def make_prompt(rng: random.Random, texts: list[str], sources: list[str]) -> str:
    """One prompt of a random kind (copy, edit, code, list or free continuation)."""
    kind = rng.choices(("copy", "edit", "code", "list", "free"), (25, 20, 20, 15, 20))[0]
    if kind == "code":
        fn = _function(rng, sources)
        ask = rng.choice(
            (
                "The same method with a docstring:",
                "The same function, restated:",
                "The function again, with comments:",
                "Here is the same code:",
            )
        )
        return f"```python\n{fn}```\n\n{ask}\n\n```python\n{fn[: rng.randrange(20, 120)]}"
    para = _para(rng, texts, rng.randrange(300, 900))
    cut = rng.randrange(10, 80)
    if kind == "copy":
        head, ask = rng.choice(
            (
                ("Original text:", "The same text, copied exactly:"),
                ("Passage:", "The passage again, word for word:"),
                ("Text:", "Repeat the text:"),
            )
        )
        return f"{head}\n{para}\n\n{ask}\n{para[:cut]}"
    if kind == "edit":
        names = sorted(set(re.findall(r"\b[A-Z][a-z]{2,}\b", para)) - {"The", "She", "His", "Her"})
        old = rng.choice(names) if names else "the"
        new = rng.choice(NAMES)
        edited = para.replace(old, new)
        return f"Text:\n{para}\n\nThe text with {old} renamed {new}:\n{edited[:cut]}"
    if kind == "list":
        words = para.split()[: rng.randrange(15, 45)]
        again = rng.choice(("The list again:", "Same list:", "Repeat the list:"))
        return "".join(f"{i}. {w}\n" for i, w in enumerate(words, 1)) + f"\n{again}\n1."
    return para[: rng.randrange(150, 500)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-1.58")
    ap.add_argument("--assets", default=".assets")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    import bitnetlm
    from bitnetlm.generate import batch_generate
    from bitnetlm.generate.generate import prompt_to_ids

    model, tok = bitnetlm.load(a.target, bitnetlm.RuntimeConfig(threads=a.threads))
    texts = [open(os.path.join(a.assets, "austen", f"{n}.txt"), encoding="utf-8").read() for n in NOVELS]
    sources = [
        open(p, encoding="utf-8", errors="replace").read()
        for p in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    ]
    rng = random.Random(a.seed)
    t0, done = time.time(), 0
    with open(a.out, "a", encoding="utf-8") as f:
        while done < a.prompts:
            ids = [prompt_to_ids(tok, make_prompt(rng, texts, sources)) for _ in range(a.batch)]
            res = batch_generate(model, tok, ids, max_tokens=a.tokens, temperature=0, ignore_eos=True)
            for p, r in zip(ids, res):
                f.write(json.dumps({"prompt": p, "output": list(r.tokens)}) + "\n")
            f.flush()
            done += a.batch
            print(f"[{time.time() - t0:.0f}s] {done} prompts", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
