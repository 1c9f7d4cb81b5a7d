#!/usr/bin/env python3
"""smollm2-135m-1.58-draft: a draft model for speculative decoding with smollm2-135m-1.58, distilled on the CPU.

Recipe (sequence-level distillation: a draft is accepted where its argmax is the target's, on the text the target
writes, so it learns from that text):
  * data: `scripts/smollm2_draft_data.py` writes prompts (copy, edit, restate code, repeat a list, continue prose;
    from five Austen novels and the Python standard library, none of the speculative benchmark's text) with the
    target's greedy continuations. The last 5% of the sequences is held out;
  * student: a few of the target's own layers (by default 0 and the three that copy from the context; ternary, taken
    as latent weights that ternarize back exactly), its final norm, and a reduced vocabulary: the `--vocab` ids most
    frequent in the continuations, then in the prompts (config.json's `vocab_subset`). The tied embedding / head
    holds the target's rows of those ids plus one row, the mean of all the others, for every id outside them. The
    head is what costs: 49,152 x 576 in the target, `--vocab` x 576 here;
  * loss: cross-entropy against the target's greedy tokens, on the continuations' positions (an id outside the
    reduced vocabulary is skipped). The held-out share of those positions where the student's argmax is the
    target's token is what greedy acceptance sees, measured before and after;
  * a copy task (`repeats`: random ids, a segment of them written twice): trained on alone (`--copy-steps`), the
    draft learns to copy from its context, which the distillation data alone does not teach (the copy loss stays at
    chance); then it is kept beside every distillation batch (`--copies`). The target's greedy text loops, and a
    draft that copies follows it;
  * AdamW, linear warm-up then linear decay to 10% (the copy task alone: constant), fixed seed.

    python scripts/smollm2_draft_data.py --out runs/draft-data.jsonl --prompts 2400
    python scripts/train_smollm2_draft.py --data runs/draft-data.jsonl --out runs/draft1
    python scripts/train_smollm2_draft.py --data runs/draft-data.jsonl --init runs/draft1 --lr 5e-4 --seed 1 \
        --out runs/draft2
    python scripts/train_smollm2_draft.py --data runs/draft-data.jsonl --init runs/draft2 --lr 3e-4 --seed 2 \
        --out runs/draft3
    python scripts/train_smollm2_draft.py --data runs/draft-data.jsonl --init runs/draft3 --copy-steps 400 \
        --copy-length 48 --lr 1e-3 --epochs 0 --out runs/copy1
    python scripts/train_smollm2_draft.py --data runs/draft-data.jsonl --init runs/copy1 --copy-steps 650 \
        --lr 2e-3 --epochs 0 --out runs/copy2
    python scripts/train_smollm2_draft.py --data runs/draft-data.jsonl --init runs/copy2 --copies 8 --lr 5e-4 \
        --seed 4 --out runs/draft4
    python scripts/train_smollm2_draft.py --data runs/draft-data.jsonl --init runs/draft4 --copies 8 --lr 3e-4 \
        --seed 5 --out runs/draft5

On a shared 2-vCPU Intel Xeon (2026-12-07/08): 30, 15, 15 and 16 minutes, then 10, 11, 16 and 16; held-out
agreement 51%, 60%, 65%, then 77% and 79%. The copy task's loss stays at chance (9.0, ln 6144 = 8.7) through
copy1's 400 steps and copy2's first 450, then falls to 0.1 within 150. What the draft gains is in
docs/performance.md ("a draft model for smollm2").
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch
import torch.nn.functional as F

from bitnetlm.formats.hf import load_hf
from bitnetlm.models import build_model
from bitnetlm.zoo import resolve


def read_data(path: str) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the target's greedy continuation) per line of the data file."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(r["prompt"], r["output"]) for r in rows]


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


def batch_of(seqs, rows: torch.Tensor):
    """Right-padded inputs [B, T] and labels [B, T]: each continuation token's head row at the position before
    it, -100 elsewhere (the prompt, padding, ids outside the reduced vocabulary)."""
    n = max(len(p) + len(o) - 1 for p, o in seqs)
    other = int(rows.max())  # the row every id outside the reduced vocabulary shares
    x = torch.zeros(len(seqs), n, dtype=torch.long)
    y = torch.full((len(seqs), n), -100, dtype=torch.long)
    for b, (p, o) in enumerate(seqs):
        ids = torch.tensor(p + o)
        x[b, : len(ids) - 1] = ids[:-1]
        lab = rows[torch.tensor(o)]
        y[b, len(p) - 1 : len(ids) - 1] = torch.where(lab < other, lab, -100)
    return x, y


def repeats(n: int, length: int, head_ids: torch.Tensor, g: torch.Generator):
    """Inputs [n, 3 * length] and labels (head rows) of n random reduced-vocabulary sequences: a random prefix,
    then a segment, then the segment again (prefix and segment of random lengths up to `length`, so that only the
    content can tell where the copy comes from). Only the second copy's tokens after its first are labelled: they
    follow from the first copy alone, so the loss there teaches the draft to copy from its context (an induction
    head), which the target's loops reward."""
    x = torch.zeros(n, 3 * length, dtype=torch.long)
    y = torch.full((n, 3 * length), -100, dtype=torch.long)
    for b in range(n):
        pre, m = (int(v) for v in torch.randint(0, length, (2,), generator=g))
        m = max(m, 4)
        r = torch.randint(0, len(head_ids), (pre + m,), generator=g)
        seq = torch.cat([r, r[pre:]])  # [pre + 2m] head rows
        x[b, : len(seq) - 1] = head_ids[seq[:-1]]
        y[b, pre + m : len(seq) - 1] = seq[pre + m + 1 :]
    return x, y


def student_logits(student, x: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, head rows] over the reduced vocabulary only (no full-vocabulary scatter)."""
    w = student.embed_tokens.weight
    return F.linear(student.hidden_states(x), w[: len(w) - 1])


def loss_of(student, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the student's reduced-vocabulary logits against head-row labels y (-100: none)."""
    return F.cross_entropy(student_logits(student, x).flatten(0, 1).float(), y.flatten())


@torch.no_grad()
def agreement(student, seqs, rows: torch.Tensor, batch: int) -> float:
    """Share of the continuations' positions (in the reduced vocabulary) where the student's argmax is the
    target's greedy token."""
    student.eval()
    hit = tot = 0
    for i in range(0, len(seqs), batch):
        x, y = batch_of(seqs[i : i + batch], rows)
        keep = y != -100
        hit += int((student_logits(student, x).argmax(-1) == y)[keep].sum())
        tot += int(keep.sum())
    student.train()
    return hit / max(1, tot)


def copy_phase(student, a, t0: float) -> None:
    """--copy-steps steps on the copy task alone (`repeats`, --copy-batch sequences, constant --lr): where the draft
    learns to copy from its context. On the distillation data alone it does not (the copy loss stays at chance), and
    the target's loops are what the draft then fails to follow."""
    opt = torch.optim.AdamW(student.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(a.seed + 1)
    for step in range(a.copy_steps):
        loss = loss_of(student, *repeats(a.copy_batch, a.copy_length, student.head_ids, g))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 25 == 0 or step == a.copy_steps - 1:
            print(
                f"[{time.time() - t0:.0f}s] copy step {step}/{a.copy_steps} loss {loss.item():.4f}",
                flush=True,
            )


def distill(student, train, rows: torch.Tensor, a, t0: float) -> None:
    """--epochs over the distillation data (cross-entropy on the target's tokens), each batch with --copies
    copy-task sequences beside it so that the copying stays; warm-up, then linear decay to 10%."""
    opt = torch.optim.AdamW(student.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(a.seed)
    steps = int(a.epochs * len(train) / a.batch)
    order = torch.cat([torch.randperm(len(train), generator=g) for _ in range(int(a.epochs) + 1)])
    warm = max(1, steps // 20)
    for step in range(steps):
        lr = a.lr * min((step + 1) / warm, 1.0 - 0.9 * step / steps)
        for grp in opt.param_groups:
            grp["lr"] = lr
        x, y = batch_of([train[i] for i in order[step * a.batch : (step + 1) * a.batch].tolist()], rows)
        loss = loss_of(student, x, y)
        copy_loss = torch.zeros(())
        if a.copies:
            copy_loss = loss_of(student, *repeats(a.copies, a.copy_length, student.head_ids, g))
        opt.zero_grad(set_to_none=True)
        (loss + copy_loss).backward()
        opt.step()
        if step % 20 == 0 or step == steps - 1:
            print(
                f"[{time.time() - t0:.0f}s] step {step}/{steps} loss {loss.item():.4f} copy {copy_loss.item():.4f} "
                f"lr {lr:.2e}",
                flush=True,
            )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-1.58")
    ap.add_argument("--data", required=True, help="the file scripts/smollm2_draft_data.py wrote")
    ap.add_argument(
        "--layers",
        default="0,16,17,18",
        help="the target layers the draft starts from (default: 0,16,17,18: layer 0, and the previous-token and "
        "induction heads of scripts/attention_heads.py, which copy from the context)",
    )
    ap.add_argument("--vocab", type=int, default=6144, help="reduced vocabulary size (default: 6144)")
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--copies",
        type=int,
        default=0,
        help="copy-task sequences beside every distillation batch (default: 0)",
    )
    ap.add_argument(
        "--copy-length",
        type=int,
        default=32,
        help="the copy task's prefix and segment lengths, at most (default: 32)",
    )
    ap.add_argument(
        "--copy-steps", type=int, default=0, help="steps of the copy task alone first (default: 0)"
    )
    ap.add_argument("--copy-batch", type=int, default=16, help="sequences a copy-task step (default: 16)")
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
    target = load_hf(tdir, mode="train")  # latent floats that ternarize back to the target exactly
    seqs = read_data(a.data)
    cut = int(len(seqs) * 0.95)
    train, held = seqs[:cut], seqs[cut:]
    counts = Counter(t for _, o in train for t in o)
    specials = [i for i in (target.config.bos_token_id, *target.config.eos_token_ids) if i is not None]
    # the continuations' ids by frequency, then the prompts' (the text users copy from), to --vocab ids
    prompted = Counter(t for p, _ in train for t in p)
    ranked = [i for i, _ in counts.most_common()] + [i for i, _ in prompted.most_common()]
    subset = list(dict.fromkeys(specials + ranked))[: a.vocab]
    if a.init:  # latent weights that ternarize back to the saved draft exactly
        student = load_hf(a.init, mode="train")
        subset = student.config.vocab_subset
    else:
        student = student_of(target, [int(x) for x in a.layers.split(",")], subset)
    rows = student.token_rows
    del target
    covered = sum(counts[i] for i in subset) / sum(counts.values())
    print(
        f"[{time.time() - t0:.0f}s] {len(seqs)} sequences; the {len(subset)} ids cover {covered:.1%}",
        flush=True,
    )
    print(
        f"[{time.time() - t0:.0f}s] agreement before: {agreement(student, held, rows, a.batch):.3f}",
        flush=True,
    )
    if a.copy_steps:
        copy_phase(student, a, t0)
    if a.epochs:
        distill(student, train, rows, a, t0)
    agree = agreement(student, held, rows, a.batch)
    print(f"[{time.time() - t0:.0f}s] agreement after: {agree:.3f}", flush=True)
    from bitnetlm.train.export import export_model

    out = export_model(student, a.out, tokenizer_dir=tdir, dtype=torch.bfloat16)
    info = {
        "layers": a.layers,
        "vocab": a.vocab,
        "coverage": covered,
        "heldout_agreement": agree,
        "sequences": len(train),
        "epochs": a.epochs,
    }
    (out / "train_info.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"[{time.time() - t0:.0f}s] wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
