"""Perplexity cost of the int8 (per-row scaled) embedding + LM head option, on a real pretrained model.

    python benchmarks/gpu_int8_head_ppl.py [--model .assets/smollm2-gguf/SmolLM2-135M-Instruct.Q4_1.gguf]

The engine's int8 head stores q = round(w / s) with s = max|w_row| / 127 (bitnetlm.runtime.cuda.weights.int8_rows). Its
input is the final RMSNorm's output rounded to the activations' dtype (bf16), and it computes logits either from
those bf16 values, bf16(h) @ q^T * s (head.w8_linear), or from int16 codes of them, c = round(h * 32639 /
max|h|) per row, as (c @ q^T) / a * s (head.w8a16_linear, what the engine runs). This
script applies exactly those roundings to the model's embedding, final norm output and head and measures
perplexity on the last --tokens tokens of each Austen novel (held out), against the same model with a bf16 head
and bf16 activations (the default). Runs on the CPU: the arithmetic is the kernels', up to fp32 summation order.
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
    ap.add_argument(
        "--tokenizer", default="", help="directory with tokenizer.json (default: the model file's own)"
    )
    ap.add_argument("--texts", default=".assets/austen")
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens per novel (the last ones)")
    ap.add_argument(
        "--narrow-heads",
        default="",
        help="gpu_int8_head_ppl.py: also LM heads of BITS-bit weights (symmetric, one scale per G weights of a row), "
        "comma-separated BITS:G, with the int8 embedding and int16 activation codes (not engine options)",
    )
    args = ap.parse_args()
    from bitnetlm.loading import load
    from bitnetlm.text.tokenizer import Tokenizer

    model, tok = load(args.model)
    model.eval()
    if args.tokenizer:
        tok = Tokenizer.from_dir(args.tokenizer)
    ids = []
    for f in sorted(os.listdir(args.texts)):
        t = tok.encode(open(os.path.join(args.texts, f), encoding="utf-8").read())
        ids.append(torch.tensor(t[-args.tokens :]))
    return args, model, torch.cat(ids)


def codes16(h: torch.Tensor) -> torch.Tensor:
    """The values the engine's int16-code head multiplies (quant._quant16_kernel): c / a with
    a = rcp(max|h|) * 32639 and c = round-half-even(h * a), per row."""
    a = (1.0 / h.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)) * 32639.0
    return torch.round(h * a).clamp(-32639, 32639) / a


def narrow_groups(w: torch.Tensor, bits: int, g: int) -> torch.Tensor:
    """w [N, K] -> its round trip through BITS-bit integers: q = round(w / s) in [-L, L], L = 2^(BITS-1) - 1,
    s = max|w| / L over each G weights of a row."""
    lim = float(2 ** (bits - 1) - 1)
    wg = w.float().reshape(w.shape[0], -1, g)  # [N, K/G, G]
    s = wg.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / lim
    return (torch.round(wg / s).clamp(-lim, lim) * s).reshape(w.shape)


class _Head(torch.nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = w

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(h, self.w)


def main() -> int:
    from bitnetlm.runtime.cuda.weights import int8_rows

    args, model, ids = model_and_heldout(__doc__.splitlines()[0])
    emb = model.embed_tokens.weight.data.clone()
    head = None if model.lm_head is None else model.lm_head.weight.data.clone()
    norm = model.norm.forward
    rows = []
    variants = (
        ("bf16", "bf16 head, bf16 activations (default)", None),
        ("int8", "int8, bf16 activations (w8_linear)", None),
        ("int8", "int8, int16 activation codes (w8a16_linear, the engine's)", codes16),
    )
    for weights, name, act in variants:
        for w, p in (
            (emb, model.embed_tokens.weight),
            (head, None if head is None else model.lm_head.weight),
        ):
            if w is None:
                continue
            if weights == "bf16":
                p.data.copy_(w.bfloat16().float())
            else:
                q, s = int8_rows(w)
                p.data.copy_(q.float() * s[:, None])

        def final_norm(x, act=act):
            h = norm(x).bfloat16().float()  # the engine's activations
            return h if act is None else act(h)

        model.norm.forward = final_norm
        rows.append((name, ppl(model, ids)))
    for spec in filter(None, args.narrow_heads.split(",")):  # the embedding stays int8 (above)
        bits, g = (int(v) for v in spec.split(":"))
        model.compact_head = _Head(narrow_groups(emb if head is None else head, bits, g))
        name = f"int{bits} LM head, groups of {g}; int8 embedding; int16 activation codes"
        rows.append((name, ppl(model, ids)))
        model.compact_head = None
    model.norm.forward = norm
    report(args, ids, "embedding + LM head", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
