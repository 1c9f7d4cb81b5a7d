#!/usr/bin/env python3
"""Which layers of a model copy from their context: per layer, its strongest previous-token head and its strongest
induction head (attention from the second copy of a repeated random sequence to the token after the same token's
first occurrence). A draft model that starts from such layers can learn to copy (scripts/train_smollm2_draft.py).

    python scripts/attention_heads.py -m smollm2-135m-1.58
"""

from __future__ import annotations

import argparse

import torch


def attention_maps(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's attention probabilities [heads, T, T] for the single sequence ids [1, T] (causal)."""
    from bitnetlm.models.transformer import Attention

    maps, attend = [], Attention._attend

    def record(self, q, k, v, mask):
        t = q.shape[2]
        kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = (q.float() @ kk.float().transpose(-1, -2)) * (self.scale or q.shape[-1] ** -0.5)
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        maps.append(s.softmax(-1)[0])
        return attend(self, q, k, v, mask)

    Attention._attend = record
    try:
        with torch.no_grad():
            model(ids)
    finally:
        Attention._attend = attend
    return maps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m-1.58")
    ap.add_argument("--length", type=int, default=60, help="tokens of the random sequence (default: 60)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    import bitnetlm

    model, tok = bitnetlm.load(a.model)
    g = torch.Generator().manual_seed(a.seed)
    n = a.length
    seq = torch.randint(1000, model.config.vocab_size // 2, (n,), generator=g)
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    ids = torch.cat([torch.tensor(bos, dtype=torch.long), seq, seq])[None]
    first = len(bos)
    pos = torch.arange(first + n + 1, first + 2 * n)  # the second copy, after its first token
    print("| layer | previous-token head | score | induction head | score |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for i, a_ in enumerate(attention_maps(model.eval(), ids)):
        prev = a_[:, pos, pos - 1].mean(-1)
        ind = a_[:, pos, pos - n + 1].mean(-1)
        p, j = int(prev.argmax()), int(ind.argmax())
        print(f"| {i} | {p} | {prev[p]:.2f} | {j} | {ind[j]:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
