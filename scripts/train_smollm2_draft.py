#!/usr/bin/env python3
"""smollm2-135m-1.58-draft: a draft model for speculative decoding with smollm2-135m-1.58, distilled on the CPU.

Recipe:
  * student = a few of the target's own layers (ternary, taken as latent weights that ternarize back exactly),
    its final norm, and a reduced vocabulary: the `--vocab` token ids most frequent in the training text
    (config.json's `vocab_subset`). The tied embedding / head holds the target's rows of those ids plus one row,
    the mean of all the others, for every id outside them. The head is what costs: 49,152 x 576 in the target,
    `--vocab` x 576 here;
  * loss: KL(target || student) over the reduced vocabulary (the target's distribution renormalised over it);
  * text: five Austen novels (Pride and Prejudice is left out: the speculative benchmark's prompts come from it)
    and the Python standard library's top-level modules; the last 5% of the tokens is held out, where the share of
    positions whose argmax agrees with the target's is measured before and after (greedy acceptance's proxy);
  * AdamW, linear warm-up then linear decay to 10%, fixed seed.

    python scripts/train_smollm2_draft.py --out runs/draft                      # 240 steps
    python scripts/train_smollm2_draft.py --init runs/draft --steps 260 --lr 5e-4 --seed 1 --out runs/draft2

The two calls took 32 and 14 minutes on a shared 2-vCPU Intel Xeon (2026-12-07); held-out agreement 27%, then 30%.
The draft they make does not pay yet (docs/performance.md, "a draft model for smollm2"): it needs more distillation.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sysconfig
import time
from collections import Counter

import torch
import torch.nn.functional as F

import bitnetlm
from bitnetlm.formats.hf import load_hf
from bitnetlm.models import build_model
from bitnetlm.text.tokenizer import Tokenizer
from bitnetlm.zoo import resolve

NOVELS = ("emma", "mansfieldpark", "northangerabbey", "persuasion", "sensesensibility")


def corpus_ids(tok: Tokenizer, assets: str) -> torch.Tensor:
    """The training text's token ids: the novels, then the standard library's modules (sorted by name)."""
    texts = [open(os.path.join(assets, "austen", f"{n}.txt"), encoding="utf-8").read() for n in NOVELS]
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        texts.append(open(path, encoding="utf-8", errors="replace").read())
    ids: list[int] = []
    for t in texts:
        ids += tok.encode(t, add_special_tokens=False)
    return torch.tensor(ids, dtype=torch.long)


def student_of(target, layers: list[int], subset: list[int]):
    """The draft: target layers `layers`, its final norm, the reduced tied embedding / head (see the docstring)."""
    cfg = target.config.replace(num_hidden_layers=len(layers), vocab_subset=subset)
    s = build_model(cfg, mode="train")
    with torch.no_grad():
        for i, j in enumerate(layers):
            s.layers[i].load_state_dict(target.layers[j].state_dict())
        s.norm.load_state_dict(target.norm.state_dict())
        emb = target.embed_tokens.weight.float()
        ids = torch.tensor(subset)
        rest = torch.ones(len(emb), dtype=torch.bool)
        rest[ids] = False
        s.embed_tokens.weight.copy_(torch.cat([emb[ids], emb[rest].mean(0, keepdim=True)]))
    return s


def head_logits(model, x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """`model`'s logits for the batch x [B, T] through the head rows `head` only (no full-vocabulary scatter)."""
    pos = torch.arange(x.shape[1]).expand(x.shape)
    h = model.embed(x)
    cos, sin = model.rope(pos, h.dtype)
    for i, layer in enumerate(model.layers):
        h = layer(h, cos, sin, i, None, None, None)
    return F.linear(model.norm(h), head)


@torch.no_grad()
def target_logits(target, x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """The target's logits over the reduced vocabulary (`head`: its rows of those ids)."""
    return head_logits(target, x, head)


def student_logits(student, x: torch.Tensor) -> torch.Tensor:
    w = student.embed_tokens.weight
    return head_logits(student, x, w[: len(w) - 1])


@torch.no_grad()
def agreement(student, target, ids: torch.Tensor, head: torch.Tensor, seq: int) -> float:
    """Share of positions of `ids` where the student's argmax is the target's (over the reduced vocabulary)."""
    student.eval()
    n = len(ids) // seq * seq
    x = ids[:n].view(-1, seq)
    hit = tot = 0
    for b in x.split(8):
        t = target_logits(target, b, head).argmax(-1)
        s = student_logits(student, b).argmax(-1)
        hit += int((t == s).sum())
        tot += t.numel()
    student.train()
    return hit / tot


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-1.58")
    ap.add_argument("--assets", default=".assets")
    ap.add_argument(
        "--layers", default="0,1,2,3", help="the target layers the draft starts from (default: 0,1,2,3)"
    )
    ap.add_argument("--vocab", type=int, default=4096, help="reduced vocabulary size (default: 4096)")
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--init", default=None, help="continue from this draft directory (its layers and vocabulary)"
    )
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    t0 = time.time()
    tdir = resolve(a.target)
    tok = Tokenizer.from_dir(tdir)
    target = bitnetlm.load(tdir)[0].eval()  # packed ternary: the C kernels score the batches
    latent = load_hf(tdir, mode="train")  # the same weights as latent floats, to train from
    ids = corpus_ids(tok, a.assets)
    cut = int(len(ids) * 0.95)
    train_ids, held = ids[:cut], ids[cut:]
    counts = Counter(train_ids.tolist())
    specials = [i for i in (target.config.bos_token_id, *target.config.eos_token_ids) if i is not None]
    subset = list(dict.fromkeys(specials + [i for i, _ in counts.most_common(a.vocab)]))[: a.vocab]
    if a.init:  # latent weights that ternarize back to the saved draft exactly
        student = load_hf(a.init, mode="train")
        subset = student.config.vocab_subset
    else:
        student = student_of(latent, [int(x) for x in a.layers.split(",")], subset)
    del latent
    covered = sum(counts[i] for i in subset) / len(train_ids)
    print(
        f"[{time.time() - t0:.0f}s] {len(ids)} tokens; the {len(subset)} ids cover {covered:.1%}", flush=True
    )
    head = target.embed_tokens.weight.float()[torch.tensor(subset)].contiguous()
    evals = held[: 16 * a.seq_len]
    print(
        f"[{time.time() - t0:.0f}s] agreement before: {agreement(student, target, evals, head, a.seq_len):.3f}"
    )
    opt = torch.optim.AdamW(student.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(a.seed)
    warm = max(1, a.steps // 20)
    for step in range(a.steps):
        lr = a.lr * min((step + 1) / warm, 1.0 - 0.9 * step / a.steps)
        for grp in opt.param_groups:
            grp["lr"] = lr
        starts = torch.randint(0, len(train_ids) - a.seq_len, (a.batch,), generator=g)
        x = torch.stack([train_ids[s : s + a.seq_len] for s in starts.tolist()])
        t = F.log_softmax(target_logits(target, x, head).float(), -1)
        s = F.log_softmax(student_logits(student, x).float(), -1)
        loss = F.kl_div(s.flatten(0, 1), t.flatten(0, 1), log_target=True, reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 10 == 0 or step == a.steps - 1:
            print(f"[{time.time() - t0:.0f}s] step {step} loss {loss.item():.4f} lr {lr:.2e}", flush=True)
    agree = agreement(student, target, evals, head, a.seq_len)
    print(f"[{time.time() - t0:.0f}s] agreement after: {agree:.3f}", flush=True)
    from bitnetlm.train.export import export_model

    out = export_model(student, a.out, tokenizer_dir=tdir, dtype=torch.bfloat16)
    info = {
        "layers": a.layers,
        "vocab": a.vocab,
        "coverage": covered,
        "heldout_agreement": agree,
        "steps": a.steps,
    }
    (out / "train_info.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"[{time.time() - t0:.0f}s] wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
