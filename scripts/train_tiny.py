#!/usr/bin/env python3
"""Train bitnet-tiny (1.58-bit, from scratch) and its full-precision twin on the same batches.

Every run in the config's `runs:` list gets the identical token stream (same seed, same batches, same number of
steps), so a ternary run and a full-precision run differ only in their linear layers and learning rate. Each run
is the library's training loop (`bitnetlm.train.Trainer`: AdamW, cosine schedule to 0.1x after warm-up, weight
decay on matrices, gradient clipping, bf16 autocast on CUDA, checkpoint / resume in OUT/<run>/checkpoints, torchrun
DDP); this script gives it the model, the weighted mix of sources, and evaluates and exports the result.

    python scripts/train_tiny.py examples/zoo_bitnet_tiny.yaml --pack .assets/carry/corpus.tar.xz --out OUTDIR

On four GPUs (DDP; batch_size is the global batch, split over the processes, so a step sees the rows it sees on
one GPU), with 4x the first release's tokens (559 steps of 64 x 512):

    torchrun --nproc-per-node 4 scripts/train_tiny.py examples/zoo_bitnet_tiny.yaml \
        --pack .assets/carry/corpus.tar.xz --out OUTDIR --steps 2236 --save-every 200

A call that stops early resumes from each run's last checkpoint when started again with the same arguments.
Writes OUTDIR/<run>-state-0000N.safetensors (packed ternary inference state, sharded <= 15 MB), OUTDIR/results.json
(held-out perplexities, tokens seen, time, samples) and OUTDIR/<run>-config.json (HF config of the model).
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
from bitnetlm.train import TrainConfig, Trainer  # noqa: E402
from bitnetlm.train import distributed as D  # noqa: E402


def make_model(mcfg: dict, quant: str) -> torch.nn.Module:
    cfg = ModelConfig(**{**mcfg, "quant": quant})
    torch.manual_seed(0)  # same init for every run of the same shape
    model = build_model(cfg, mode="train")
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


def train_config(tcfg: dict, run: dict, out: str, steps: int, save_every: int) -> TrainConfig:
    """The library's options for one run (the zoo recipe)."""
    return TrainConfig(
        quantize=run["quant"] == "ternary",
        seq_len=tcfg["seq_len"],
        batch_size=tcfg["batch_size"],
        micro_batch_size=tcfg.get("micro_batch_size"),
        lr=run["lr"],
        betas=[0.9, 0.95],
        weight_decay=tcfg.get("weight_decay", 0.1),
        schedule="cosine",
        min_lr_ratio=0.1,
        warmup_steps=tcfg.get("warmup_steps", 100),
        max_steps=steps,
        grad_clip=1.0,
        seed=tcfg.get("seed", 0),
        compile=bool(tcfg.get("compile", False)) and torch.cuda.is_available(),
        out_dir=os.path.join(out, run["name"]),
        save_every=save_every,
        log_every=tcfg.get("log_every", 50),
        tensorboard=False,
        export=False,
    )


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


PROMPTS = [
    '<|im_start|>user\nWhat does "castle" mean?<|im_end|>\n<|im_start|>assistant\n',
    "It is a truth universally acknowledged",
    "And God said",
    "def ",
]


def judge(run: dict, model, trainer: Trainer, sets, seq_len: int, tok, mcfg: dict, out: str, dev) -> dict:
    """Held-out perplexities, samples and the export of one trained run (main process)."""
    ev = zc.eval_heldout(model, sets, seq_len, dev)
    rows = [json.loads(x) for x in (trainer.out / "metrics.jsonl").read_text().splitlines()]
    print(run["name"], json.dumps(ev), flush=True)
    if run.get("export"):
        if run["quant"] == "ternary":
            sd = zc.export_state(model)
        else:
            sd = {k: v.detach().bfloat16().cpu() for k, v in model.state_dict().items()}
        zc.save_sharded(sd, os.path.join(out, f"{run['name']}-state"))
        with open(os.path.join(out, f"{run['name']}-config.json"), "w") as f:
            json.dump(ModelConfig(**{**mcfg, "quant": run["quant"]}).to_hf(), f, indent=1)
    return {
        **run,
        "heldout_ppl": ev,
        "loss_curve": [(r["step"], round(r["loss"], 4)) for r in rows if "loss" in r],
        "samples": {p: greedy(model, tok, p, dev) for p in PROMPTS},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--pack", required=True, help="text pack (tar.xz of the corpus split)")
    ap.add_argument("--tokenizer", default="bitnetlm/zoo/bundled/bitnet-tiny/tokenizer.json")
    ap.add_argument("--work", default="runs/zoo", help="scratch dir (token cache)")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--steps", type=int, default=None, help="optimizer steps of each run (default: max_steps)"
    )
    ap.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: at the end)")
    a = ap.parse_args(argv)
    with open(a.config) as f:
        cfg = yaml.safe_load(f)
    tcfg = cfg["train"]
    torch.backends.cuda.matmul.allow_tf32 = True
    info = D.setup("auto", "auto")  # under torchrun: the group the runs share
    clock = zc.Timer()
    if info.is_main:  # one process unpacks and tokenizes; the others read its cache
        zc.tokenize_sources(zc.unpack_text(a.pack, a.work), a.tokenizer, a.work, "tiny")
    D.barrier(info)
    split = zc.unpack_text(a.pack, a.work)
    srcs = zc.tokenize_sources(split, a.tokenizer, a.work, "tiny")
    print(f"[{clock():.0f}s] tokens per source: { {k: len(v) for k, v in srcs.items()} }", flush=True)
    steps = a.steps or tcfg["max_steps"]
    bs, seq = tcfg["batch_size"], tcfg["seq_len"]
    results = {"steps": steps, "tokens_seen": steps * bs * seq, "train_seconds": 0.0, "runs": {}}
    results["device"] = torch.cuda.get_device_name() if info.device.type == "cuda" else "cpu"
    results["processes"] = info.world_size
    sets = zc.heldout_ids(split, a.tokenizer) if info.is_main else None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(a.tokenizer)
    for run in cfg["runs"]:
        model = make_model(cfg["model"], run["quant"])
        print(
            f"run {run['name']}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params", flush=True
        )

        def batches(rank, world, seed=tcfg.get("seed", 0)):  # the same stream for every run
            return zc.Batches(
                srcs, cfg["data"]["weights"], seq, seed, bs, rank, world, tcfg.get("micro_batch_size")
            )

        trainer = Trainer(train_config(tcfg, run, a.out, steps, a.save_every), model=model, batches=batches)
        t0 = time.time()
        trainer.fit()
        results["train_seconds"] = round(results["train_seconds"] + time.time() - t0, 1)
        if info.is_main:
            results["runs"][run["name"]] = judge(
                run, model, trainer, sets, seq, tok, cfg["model"], a.out, info.device
            )
        D.barrier(info)
    if info.is_main:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    print(f"[{clock():.0f}s] done", flush=True)
    D.barrier(info)
    D.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
