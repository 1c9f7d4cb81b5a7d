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
  * warmup-stable-decay LR: each call trains at the stable LR, saves a resumable checkpoint, then decays for the
    last `decay_frac` of its budget and exports, so every call ends with an annealed model and the next call resumes
    from the stable checkpoint.

    python scripts/train_smollm2.py examples/zoo_smollm2_135m_1.58.yaml --pack ... --teacher PART0 PART1 --out OUT

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
import torch.nn.functional as F
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zoo_common as zc  # noqa: E402
from zoo_teacher_parts import load_parts  # noqa: E402

from bitnetlm.models import ModelConfig, build_model  # noqa: E402
from bitnetlm.quant import BitLinear  # noqa: E402


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


def set_lambda(model, lam: float) -> None:
    for m in model.modules():
        if isinstance(m, BitLinear):
            m.quant_lambda = lam


def kl_loss(s_logits: torch.Tensor, t_logits: torch.Tensor) -> torch.Tensor:
    t = F.log_softmax(t_logits.float(), -1)
    s = F.log_softmax(s_logits.float(), -1)
    return (t.exp() * (t - s)).sum(-1).mean()


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
    ap.add_argument("--time-budget", type=float, default=None, help="training seconds in this call")
    ap.add_argument("--steps", type=int, default=None, help="fixed steps in this call (tests / CPU)")
    ap.add_argument(
        "--eval-tokens", type=int, default=4096, help="Austen window (< 4096 skips the held-out sets)"
    )
    a = ap.parse_args(argv)
    with open(a.config) as f:
        cfg = yaml.safe_load(f)
    T = cfg["train"]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    clock = zc.Timer()
    tok_json = os.path.join(a.teacher_tokenizer, "tokenizer.json")
    split = zc.unpack_text(a.pack, a.work)
    srcs = zc.tokenize_sources(split, tok_json, a.work, "smollm2")
    print(f"[{clock():.0f}s] tokens: { {k: len(v) for k, v in srcs.items()} }", flush=True)
    hf_cfg, sd = load_parts(a.teacher)
    tcfg = ModelConfig.from_hf(hf_cfg)
    teacher = build_model(tcfg, mode="fp")
    teacher.load_state_dict(sd, strict=True)
    teacher = teacher.to(dev, torch.bfloat16).eval().requires_grad_(False)
    batches = zc.Batches(srcs, cfg["data"]["weights"], T["seq_len"], seed=T.get("seed", 0))
    ckpt_path = os.path.join(a.work, "smollm2_stable.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        student = build_model(student_config(tcfg), mode="train")
        student.load_state_dict(ck["model"])
        student = student.to(dev)
        student.embed_tokens.weight.requires_grad_(False)
        step, tokens_seen, train_s_before = ck["step"], ck["tokens_seen"], ck["train_seconds"]
        batches.rng.bit_generator.state = json.loads(ck["rng"])
        print(f"[{clock():.0f}s] resumed at step {step}", flush=True)
    else:
        student = build_student(tcfg, sd, teacher, batches.next(8)[:, :-1], dev)
        step, tokens_seen, train_s_before, ck = 0, 0, 0.0, None
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=T["lr"], betas=(0.9, 0.95), weight_decay=0.0, fused=dev.type == "cuda")
    if ck is not None:
        opt.load_state_dict(ck["opt"])
    del ck
    bs, warm, qwarm = T["batch_size"], T.get("warmup_steps", 50), T.get("quant_warmup_steps", 400)
    budget = a.time_budget or T.get("time_budget_s", 300)
    decay_frac = T.get("decay_frac", 0.2)
    t0 = time.time()
    call_steps = 0
    decay_start_step = None
    losses = []
    student.train()
    while True:
        el = time.time() - t0
        if a.steps is not None:
            if call_steps >= a.steps:
                break
            frac_left = 1 - call_steps / a.steps
        else:
            if el >= budget:
                break
            frac_left = 1 - el / budget
        if decay_start_step is None and frac_left <= decay_frac:
            # save the resumable stable-phase checkpoint before decaying
            os.makedirs(a.work, exist_ok=True)
            torch.save(
                {
                    "model": student.state_dict(),
                    "opt": opt.state_dict(),
                    "step": step,
                    "tokens_seen": tokens_seen,
                    "train_seconds": train_s_before + el,
                    "rng": json.dumps(batches.rng.bit_generator.state),
                },
                ckpt_path + ".tmp",
            )
            os.replace(ckpt_path + ".tmp", ckpt_path)
            decay_start_step = step
            print(f"[{clock():.0f}s] stable checkpoint at step {step}; decaying", flush=True)
        lr = T["lr"] * min(1.0, (step + 1) / warm)
        if decay_start_step is not None:
            lr = T["lr"] * max(0.05, frac_left / decay_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        set_lambda(student, min(1.0, step / qwarm) if qwarm else 1.0)
        batch = batches.next(bs).to(dev, non_blocking=True)
        x = batch[:, :-1]
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            t_logits = teacher(x)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            s_logits = student(x)
        loss = kl_loss(s_logits, t_logits)
        del t_logits, s_logits
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        call_steps += 1
        tokens_seen += x.numel()
        if step % 25 == 0:
            losses.append((step, round(loss.item(), 4)))
        if call_steps % 100 == 0:
            print(
                f"[{clock():.0f}s] step {step} kl {loss.item():.4f} lr {lr:.2e} lambda {min(1.0, step / qwarm):.2f}",
                flush=True,
            )
    train_s = time.time() - t0
    set_lambda(student, 1.0)
    student.eval()
    # ---- eval: teacher and student, same code path --------------------------------------------------
    from jinja2 import Template
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_json)
    with open(os.path.join(split, "austen_corpus.txt"), encoding="utf-8") as f:
        aus = torch.tensor(
            tok.encode(f.read(), add_special_tokens=False).ids[-a.eval_tokens :], dtype=torch.long
        )
    sets = zc.heldout_ids(split, tok_json) if a.eval_tokens >= 4096 else {}
    res = {
        "steps": step,
        "tokens_seen": tokens_seen,
        "train_seconds_total": round(train_s_before + train_s, 1),
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "loss_curve_this_call": losses,
    }
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
    os.makedirs(a.out, exist_ok=True)
    zc.save_sharded(
        zc.export_state(student, skip=("embed_tokens.",)), os.path.join(a.out, "smollm2-135m-1.58-state")
    )
    with open(os.path.join(a.out, "smollm2-config.json"), "w") as f:
        json.dump(student_config(tcfg).to_hf(), f, indent=1)
    with open(os.path.join(a.out, "smollm2-results.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(
        f"[{clock():.0f}s] done: student {res['student_austen_last4096_ppl']} teacher {res['teacher_austen_last4096_ppl']}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
