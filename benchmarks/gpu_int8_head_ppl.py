"""Perplexity cost of the int8 (per-row scaled) embedding + LM head option, on a real pretrained model.

    python benchmarks/gpu_int8_head_ppl.py [--model .assets/smollm2-gguf/SmolLM2-135M-Instruct.Q4_1.gguf]

The engine's int8 head stores q = round(w / s) with s = max|w_row| / 127 (bitnetlm.engine_cuda._int8_rows) and
computes logits = bf16(h) @ q^T * s. This script applies exactly that quantization to the model's embedding and
head and measures perplexity on the last 4096 tokens of each Austen novel (held out), against the same model with
a bf16-rounded head (the default). Runs on the CPU: the arithmetic is the kernel's, up to fp32 summation order.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@torch.no_grad()
def ppl(model, ids: torch.Tensor, ctx: int = 512, cached: bool = False) -> float:
    """Perplexity over windows of `ctx` tokens; cached: through a KV cache (model.new_cache), so the queries
    attend over the keys and values as the cache stores them."""
    nll, n = 0.0, 0
    for i in range(0, ids.numel() - 1, ctx):
        x = ids[i : i + ctx + 1]
        if x.numel() < 2:
            break
        kw = {}
        if cached:
            kw = dict(positions=torch.arange(x.numel() - 1)[None], cache=model.new_cache(1, x.numel()))
        logits = model(x[None, :-1], **kw)[0].float()
        nll += torch.nn.functional.cross_entropy(logits, x[1:], reduction="sum").item()
        n += x.numel() - 1
    return math.exp(nll / n)


def report(args, ids, what: str, rows, note: str = "") -> None:
    """The markdown table of `rows` [(name, perplexity)], each against the first."""
    print(
        f"model: {args.model} (real pretrained weights); text: last {args.tokens} tokens of each of "
        f"{len(os.listdir(args.texts))} Austen novels ({ids.numel()} tokens), context 512{note}\n"
    )
    print(f"| {what} | perplexity | vs {rows[0][0]} |\n| --- | ---: | ---: |")
    for name, v in rows:
        print(f"| {name} | {v:.3f} | {100 * (v / rows[0][1] - 1):+.2f}% |")


def model_and_heldout(description: str):
    """(args, model, held-out token ids) of the command line shared with kv_fp8_ppl.py: a real model, the last
    --tokens tokens of each text in --texts."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default=".assets/smollm2-gguf/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--tokenizer", default=".assets/carry/teacher_tok", help="directory with tokenizer.json")
    ap.add_argument("--texts", default=".assets/austen")
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens per novel (the last ones)")
    args = ap.parse_args()
    from bitnetlm.generate.tokenizer import Tokenizer
    from bitnetlm.loading import load_model

    model = load_model(args.model).eval()
    tok = Tokenizer.from_dir(args.tokenizer)
    ids = []
    for f in sorted(os.listdir(args.texts)):
        t = tok.encode(open(os.path.join(args.texts, f), encoding="utf-8").read())
        ids.append(torch.tensor(t[-args.tokens :]))
    return args, model, torch.cat(ids)


def main() -> int:
    from bitnetlm.engine_cuda import _int8_rows

    args, model, ids = model_and_heldout(__doc__.splitlines()[0])
    emb = model.embed_tokens.weight.data.clone()
    head = None if model.lm_head is None else model.lm_head.weight.data.clone()
    rows = []
    for name in ("bf16", "int8"):
        for w, p in (
            (emb, model.embed_tokens.weight),
            (head, None if head is None else model.lm_head.weight),
        ):
            if w is None:
                continue
            if name == "bf16":
                p.data.copy_(w.bfloat16().float())
            else:
                q, s = _int8_rows(w)
                p.data.copy_(q.float() * s[:, None])
        rows.append((name, ppl(model, ids)))
    report(args, ids, "embedding + LM head", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
