#!/usr/bin/env python3
"""smollm2-135m-1.58: SmolLM2-135M-Instruct converted to 1.58 bits by quantization warm-up + logit distillation.

Recipe (BitDistill-style, scaled down to minutes):
  * student = the teacher's weights as latent fp32 in BitNet b1.58 layers (arch "bitnet" with SiLU), with the
    BitNet sub-norms inserted before o_proj and down_proj; each sub-norm's weight is calibrated to the mean RMS of
    the activations it sees in the teacher, so the student starts close to the teacher's function;
  * the tied embedding / LM head stays the teacher's (frozen, bf16 when shipped);
  * quantization warm-up: BitLinear.quant_lambda ramps 0 -> 1 over `quant_warmup_steps`
    (w + lambda * (quant(w) - w), same for activations);
  * loss: KL(teacher || student) on the next-token distributions (temperature 1);
  * warm-up-stable-decay LR (`schedule: wsd`): linear warm-up, the peak rate, then a linear decay over the last
    `decay_frac` of the steps (floored at 0.05x).
The training is the library's loop (`bitnetlm.train.Trainer`: AdamW, gradient clipping, bf16 autocast on CUDA,
checkpoint / resume in OUT/train/checkpoints, torchrun DDP); this script builds the student, feeds the batches
and evaluates and exports the result.

    python scripts/train_smollm2.py examples/zoo_smollm2_135m_1.58.yaml --pack ... --teacher PART0 PART1 \
        --teacher-tokenizer DIR --out OUT --save-every 200

A call that stops early resumes from the last checkpoint when started again with the same arguments. On four
GPUs (DDP; batch_size is the global batch, split over the processes, so a step sees the rows it sees on one GPU),
with 4x the first release's tokens (2,131 steps of 8 x 2048):

    torchrun --nproc-per-node 4 scripts/train_smollm2.py examples/zoo_smollm2_135m_1.58.yaml --pack ... \
        --teacher PART0 PART1 --teacher-tokenizer DIR --out OUT --steps 8524 --save-every 500

Eval (same run, same code path for both models): perplexity on the last 4096 teacher tokens of the Austen corpus
(one window of 4096), the held-out Austen tails and the held-out play; greedy chat answers of teacher and student.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zoo_common as zc  # noqa: E402
from zoo_teacher_parts import load_parts  # noqa: E402

from bitnetlm.models import ModelConfig, build_model  # noqa: E402
from bitnetlm.train import TrainConfig, Trainer  # noqa: E402
from bitnetlm.train import distributed as D  # noqa: E402
from bitnetlm.train.qat import set_quant_lambda  # noqa: E402


def student_config(tcfg: ModelConfig) -> ModelConfig:
    return tcfg.replace(arch="bitnet", quant="ternary", hidden_act="silu", linear_class="autobitlinear")


def build_student(tcfg: ModelConfig, sd: dict, teacher, calib: torch.Tensor, device) -> torch.nn.Module:
    s = build_model(student_config(tcfg), mode="train")
    missing, unexpected = s.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert all("sub_norm" in k for k in missing), missing
    with torch.no_grad():  # the shipped embedding is bf16: train against exactly those values
        s.embed_tokens.weight.copy_(s.embed_tokens.weight.bfloat16().float())
    s = s.to(device)
    # sub-norm weights = mean RMS of the teacher's activations at that point (o_proj / down_proj inputs)
    rms = {}
    hooks = []
    for i, layer in enumerate(teacher.layers):
        for key, mod in (("attn", layer.self_attn.o_proj), ("ffn", layer.mlp.down_proj)):

            def hook(_m, inp, _out, _i=i, _k=key):
                x = inp[0].float()
                rms[(_i, _k)] = x.pow(2).mean(-1).sqrt().mean().item()

            hooks.append(mod.register_forward_hook(hook))
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        teacher(calib.to(device))
    for h in hooks:
        h.remove()
    with torch.no_grad():
        for i, layer in enumerate(s.layers):
            layer.self_attn.attn_sub_norm.weight.fill_(rms[(i, "attn")])
            layer.mlp.ffn_sub_norm.weight.fill_(rms[(i, "ffn")])
    s.embed_tokens.weight.requires_grad_(False)
    return s


@torch.no_grad()
def chat(model, tok, template, question: str, device, n: int = 60) -> str:
    text = template.render(messages=[{"role": "user", "content": question}], add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False).ids
    x = torch.tensor([ids], device=device)
    out = []
    for _ in range(n):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            t = int(model(x)[0, -1].argmax())
        if t in (0, 2):
            break
        out.append(t)
        x = torch.cat([x, torch.tensor([[t]], device=device)], 1)
    return tok.decode(out)


CALIB_ROWS = 8  # the token stream's first rows calibrate the sub-norms; training continues after them


def train_config(T: dict, out: str, steps: int, save_every: int) -> TrainConfig:
    """The library's options for the conversion: KL to the teacher only, quantization warm-up, WSD schedule."""
    return TrainConfig(
        quantize=True,
        seq_len=T["seq_len"],
        batch_size=T["batch_size"],
        micro_batch_size=T.get("micro_batch_size"),
        lr=T["lr"],
        betas=[0.9, 0.95],
        weight_decay=0.0,
        schedule="wsd",
        stage2_at=1 - T.get("decay_frac", 0.2),
        min_lr_ratio=0.05,
        warmup_steps=T.get("warmup_steps", 50),
        max_steps=steps,
        grad_clip=1.0,
        quant_warmup_steps=T.get("quant_warmup_steps", 400),
        kd_weight=1.0,
        seed=T.get("seed", 0),
        out_dir=os.path.join(out, "train"),
        save_every=save_every,
        log_every=T.get("log_every", 25),
        tensorboard=False,
        export=False,
    )


def evaluate(student, teacher, cfg: dict, split: str, a, tok_json: str, dev) -> dict:
    """Perplexities and greedy chat answers of teacher and student (same code path for both)."""
    from jinja2 import Template
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_json)
    with open(os.path.join(split, "austen_corpus.txt"), encoding="utf-8") as f:
        aus = torch.tensor(
            tok.encode(f.read(), add_special_tokens=False).ids[-a.eval_tokens :], dtype=torch.long
        )
    sets = zc.heldout_ids(split, tok_json) if a.eval_tokens >= 4096 else {}
    res = {}
    for name, m in (("teacher", teacher), ("student", student)):
        ppl, n = zc.perplexity(m, aus, len(aus), dev)
        res[f"{name}_austen_last4096_ppl"] = round(ppl, 3)
        if sets:
            res[f"{name}_heldout_ctx1024"] = zc.eval_heldout(m, sets, 1024, dev)
        print(f"{name}: austen last 4096 ppl {ppl:.3f} ({n} predictions)", flush=True)
    res["ratio"] = round(res["student_austen_last4096_ppl"] / res["teacher_austen_last4096_ppl"], 3)
    with open(os.path.join(a.teacher_tokenizer, "chat_template.jinja")) as f:
        tmpl = Template(f.read())
    res["chat"] = []
    for q in cfg.get("chat_prompts", []):
        res["chat"].append(
            {"q": q, "teacher": chat(teacher, tok, tmpl, q, dev), "student": chat(student, tok, tmpl, q, dev)}
        )
        print(json.dumps(res["chat"][-1]), flush=True)
    return res


def save_results(student, tcfg: ModelConfig, res: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    zc.save_sharded(
        zc.export_state(student, skip=("embed_tokens.",)), os.path.join(out, "smollm2-135m-1.58-state")
    )
    with open(os.path.join(out, "smollm2-config.json"), "w") as f:
        json.dump(student_config(tcfg).to_hf(), f, indent=1)
    with open(os.path.join(out, "smollm2-results.json"), "w") as f:
        json.dump(res, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--pack", required=True)
    ap.add_argument("--teacher", nargs="+", required=True, help="teacher_part*.safetensors")
    ap.add_argument(
        "--teacher-tokenizer", required=True, help="dir with tokenizer.json + chat_template.jinja"
    )
    ap.add_argument("--work", default="runs/zoo")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--steps", type=int, default=None, help="optimizer steps (default: the config's max_steps)"
    )
    ap.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: at the end)")
    ap.add_argument(
        "--eval-tokens", type=int, default=4096, help="Austen window (< 4096 skips the held-out sets)"
    )
    a = ap.parse_args(argv)
    with open(a.config) as f:
        cfg = yaml.safe_load(f)
    T = cfg["train"]
    torch.backends.cuda.matmul.allow_tf32 = True
    info = D.setup("auto", "auto")  # under torchrun: DDP over the group
    dev = info.device
    clock = zc.Timer()
    tok_json = os.path.join(a.teacher_tokenizer, "tokenizer.json")
    if info.is_main:  # one process unpacks and tokenizes; the others read its cache
        zc.tokenize_sources(zc.unpack_text(a.pack, a.work), tok_json, a.work, "smollm2")
    D.barrier(info)
    split = zc.unpack_text(a.pack, a.work)
    srcs = zc.tokenize_sources(split, tok_json, a.work, "smollm2")
    print(f"[{clock():.0f}s] tokens: { {k: len(v) for k, v in srcs.items()} }", flush=True)
    hf_cfg, sd = load_parts(a.teacher)
    tcfg = ModelConfig.from_hf(hf_cfg)
    teacher = build_model(tcfg, mode="fp")
    teacher.load_state_dict(sd, strict=True)
    teacher = teacher.to(dev, torch.bfloat16).eval().requires_grad_(False)
    weights, seq, seed = cfg["data"]["weights"], T["seq_len"], T.get("seed", 0)
    calib = zc.Batches(srcs, weights, seq, seed).next(CALIB_ROWS)[:, :-1]
    # (a resumed run overwrites these weights with its checkpoint's)
    student = build_student(tcfg, sd, teacher, calib, dev)
    del sd

    def batches(rank, world):
        b = zc.Batches(srcs, weights, seq, seed, T["batch_size"], rank, world, T.get("micro_batch_size"))
        b.next(CALIB_ROWS)
        return b

    steps = a.steps or T["max_steps"]
    trainer = Trainer(
        train_config(T, a.out, steps, a.save_every), model=student, teacher=teacher, batches=batches
    )
    t0 = time.time()
    trainer.fit()
    train_s = time.time() - t0
    if info.is_main:
        set_quant_lambda(student, 1.0)
        student.eval()
        rows = [json.loads(x) for x in (trainer.out / "metrics.jsonl").read_text().splitlines()]
        res = {
            "steps": trainer.step,
            "tokens_seen": trainer.tokens_seen,
            "train_seconds_this_call": round(train_s, 1),
            "resumed_from": trainer.resumed_from,
            "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
            "processes": info.world_size,
            "loss_curve": [(r["step"], round(r["loss"], 4)) for r in rows if "loss" in r],
            **evaluate(student, teacher, cfg, split, a, tok_json, dev),
        }
        save_results(student, tcfg, res, a.out)
        print(
            f"[{clock():.0f}s] done: student {res['student_austen_last4096_ppl']} "
            f"teacher {res['teacher_austen_last4096_ppl']}",
            flush=True,
        )
    D.barrier(info)
    D.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
