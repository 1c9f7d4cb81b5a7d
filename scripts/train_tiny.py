#!/usr/bin/env python3
"""Train bitnet-tiny (1.58-bit, from scratch) and its full-precision twin in lockstep on the same batches.

Every run in the config's `runs:` list gets the identical token stream (same seed, same batches, same number of
steps), so a ternary run and a full-precision run differ only in their linear layers and learning rate. The
number of steps is fixed up front or derived from `time_budget_s` after a short calibration (all runs use it).

    python scripts/train_tiny.py examples/zoo_bitnet_tiny.yaml --pack .assets/carry/corpus.tar.xz --out OUTDIR

Writes OUTDIR/<run>-state-0000N.safetensors (packed ternary inference state, sharded <= 15 MB), OUTDIR/results.json
(held-out perplexities, tokens seen, time, samples) and OUTDIR/config.json (HF config of the model).
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

from bitnetlm.models import ModelConfig, build_model  # noqa: E402


def make_model(mcfg: dict, quant: str, device) -> torch.nn.Module:
    cfg = ModelConfig(**{**mcfg, "quant": quant})
    torch.manual_seed(0)  # same init for every run of the same shape
    model = build_model(cfg, mode="train").to(device)
    for name, p in model.named_parameters():
        # small-init of embeddings (GPT-2 style); linear layers keep their kaiming init scaled down
        if name.endswith("embed_tokens.weight"):
            torch.nn.init.normal_(p, std=0.02)
        elif p.dim() == 2:
            torch.nn.init.normal_(
                p,
                std=0.02 / (2 * cfg.num_hidden_layers) ** 0.5
                if "o_proj" in name or "down_proj" in name
                else 0.02,
            )
    return model


def param_groups(model, wd: float):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() == 2 and "embed" not in n else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def greedy(model, tok, prompt: str, device, n: int = 40, stop=(2, 0)) -> str:
    ids = tok.encode(prompt, add_special_tokens=False).ids
    x = torch.tensor([ids], device=device)
    out = []
    for _ in range(n):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x[:, -512:])
        t = int(logits[0, -1].argmax())
        if t in stop:
            break
        out.append(t)
        x = torch.cat([x, torch.tensor([[t]], device=device)], 1)
    return tok.decode(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--pack", required=True, help="text pack (tar.xz of the corpus split)")
    ap.add_argument("--tokenizer", default="bitnetlm/zoo/bundled/bitnet-tiny/tokenizer.json")
    ap.add_argument("--work", default="runs/zoo", help="scratch dir (token cache)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--time-budget", type=float, default=None, help="override train.time_budget_s")
    ap.add_argument("--steps", type=int, default=None, help="fixed number of steps (overrides the budget)")
    a = ap.parse_args(argv)
    with open(a.config) as f:
        cfg = yaml.safe_load(f)
    tcfg = cfg["train"]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    clock = zc.Timer()
    split = zc.unpack_text(a.pack, a.work)
    srcs = zc.tokenize_sources(split, a.tokenizer, a.work, "tiny")
    ntok = {k: len(v) for k, v in srcs.items()}
    print(f"[{clock():.0f}s] tokens per source: {ntok}", flush=True)
    sets = zc.heldout_ids(split, a.tokenizer)
    batches = zc.Batches(srcs, cfg["data"]["weights"], tcfg["seq_len"], seed=tcfg.get("seed", 0))
    runs = []
    for r in cfg["runs"]:
        m = make_model(cfg["model"], r["quant"], dev)
        opt = torch.optim.AdamW(
            param_groups(m, tcfg.get("weight_decay", 0.1)),
            lr=r["lr"],
            betas=(0.9, 0.95),
            fused=dev.type == "cuda",
        )
        fwd = torch.compile(m) if tcfg.get("compile", False) and dev.type == "cuda" else m
        runs.append({"spec": r, "model": m, "fwd": fwd, "opt": opt, "losses": []})
        print(
            f"run {r['name']}: {sum(p.numel() for p in m.parameters()) / 1e6:.1f}M params, lr {r['lr']}",
            flush=True,
        )
    bs, warm = tcfg["batch_size"], tcfg.get("warmup_steps", 100)
    total = a.steps or tcfg.get("max_steps", 10**9)
    budget = a.time_budget or tcfg.get("time_budget_s")
    calib_at, t_calib = 30, None
    step = 0
    t_train = time.time()
    while step < total:
        batch = batches.next(bs).to(dev, non_blocking=True)
        x, y = batch[:, :-1], batch[:, 1:]
        for run in runs:
            lr = zc.lr_at(step, total if total < 10**9 else 10**6, run["spec"]["lr"], warm)
            for g in run["opt"].param_groups:
                g["lr"] = lr
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                logits = run["fwd"](x)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(run["model"].parameters(), 1.0)
            run["opt"].step()
            run["opt"].zero_grad(set_to_none=True)
            if step % 50 == 0:
                run["losses"].append((step, round(loss.item(), 4)))
        step += 1
        if step == 5:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t_calib = time.time()
        if budget and step == 5 + calib_at and total >= 10**9:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            per = (time.time() - t_calib) / calib_at
            left = budget - (time.time() - t_train)
            total = step + int(left / per)
            print(
                f"[{clock():.0f}s] {per * 1000:.0f} ms/step for {len(runs)} runs -> total {total} steps",
                flush=True,
            )
        if step % 200 == 0:
            print(
                f"[{clock():.0f}s] step {step}/{total} "
                + " ".join(f"{r['spec']['name']}={r['losses'][-1][1]}" for r in runs),
                flush=True,
            )
    train_s = time.time() - t_train
    os.makedirs(a.out, exist_ok=True)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(a.tokenizer)
    results = {
        "steps": step,
        "tokens_seen": step * bs * tcfg["seq_len"],
        "train_seconds": round(train_s, 1),
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "runs": {},
    }
    prompts = [
        '<|im_start|>user\nWhat does "castle" mean?<|im_end|>\n<|im_start|>assistant\n',
        "It is a truth universally acknowledged",
        "And God said",
        "def ",
    ]
    for run in runs:
        m = run["model"]
        ev = zc.eval_heldout(m, sets, tcfg["seq_len"], dev)
        samples = {p: greedy(m, tok, p, dev) for p in prompts}
        results["runs"][run["spec"]["name"]] = {
            **run["spec"],
            "heldout_ppl": ev,
            "loss_curve": run["losses"],
            "samples": samples,
        }
        print(run["spec"]["name"], json.dumps(ev), flush=True)
        if run["spec"].get("export"):
            mc = ModelConfig(**{**cfg["model"], "quant": run["spec"]["quant"]})
            if run["spec"]["quant"] == "ternary":
                sd = zc.export_state(m)
            else:
                sd = {k: v.detach().bfloat16().cpu() for k, v in m.state_dict().items()}
            zc.save_sharded(sd, os.path.join(a.out, f"{run['spec']['name']}-state"))
            with open(os.path.join(a.out, f"{run['spec']['name']}-config.json"), "w") as f:
                json.dump(mc.to_hf(), f, indent=1)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"[{clock():.0f}s] done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
