#!/usr/bin/env python3
"""Training throughput: QAT (ternary BitLinear, STE) vs plain training of the same model; peak memory.

    python benchmarks/train_throughput.py                      # CPU here, CUDA if available
    python benchmarks/train_throughput.py --device cuda --hidden 1024 --layers 8 --seq-len 1024 --batch 8

Each variant runs in its own subprocess so that peak memory (CUDA: max_memory_allocated; CPU: peak RSS
growth over the process after model construction) belongs to it alone. Same model shape, same data, same
optimizer (AdamW), same precision (bf16 autocast by default on CUDA; on CPU fp32 unless --precision bf16).
Prints a markdown table naming the machine and the date; the ratio row is QAT tokens/s / plain tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import common


def model_config(args):
    """The model both variants train: a bitnet block of the requested size, ternary for QAT."""
    from bitnetlm.models import ModelConfig

    return ModelConfig(
        arch="bitnet",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or int(args.hidden * 2.7) // 8 * 8,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or args.heads,
        max_position_embeddings=args.seq_len,
        bos_token_id=None,
        eos_token_id=None,
        quant="ternary" if args.variant == "qat" else "none",
    )


def run_variant(args) -> dict:
    import torch

    from bitnetlm.models import build_model
    from bitnetlm.train.loop import init_weights

    torch.manual_seed(0)
    dev = torch.device(args.device)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = build_model(model_config(args), mode="train" if args.variant == "qat" else "fp").to(dev)
    init_weights(model)
    if args.compile:
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))
    bf16 = args.precision == "bf16" or (args.precision == "auto" and dev.type == "cuda")
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=g).to(dev)

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    sync()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    dt = time.perf_counter() - t0
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024  # KiB -> MiB
    return {
        "variant": args.variant,
        "tokens_per_s": args.steps * args.batch * args.seq_len / dt,
        "step_ms": 1000 * dt / args.steps,
        "peak_mib": peak,
        "params": sum(p.numel() for p in model.parameters()),
        "precision": "bf16 autocast" if bf16 else "fp32",
        "threads": torch.get_num_threads(),
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="torch.compile both models")
    p.add_argument("--variant", choices=["qat", "plain"], help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print the raw results as JSON")
    return p.parse_args()


def print_table(args, plain: dict, qat: dict) -> None:
    common.header(
        f"Training throughput ({qat['precision']})",
        gpu=args.device.startswith("cuda"),
        details=f"model: bitnet block, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
        f"{qat['params'] / 1e6:.1f}M params; batch {args.batch} x {args.seq_len} tokens, AdamW, {args.steps} timed "
        f"steps after {args.warmup} warm-up{', torch.compile' if args.compile else ''}; device {args.device}"
        + (f", {qat['threads']} torch threads" if args.device == "cpu" else ""),
    )
    rows = [
        [name, f"{r['tokens_per_s']:,.0f}", f"{r['step_ms']:.1f}", f"{r['peak_mib']:,.0f}"]
        for r, name in ((plain, "plain (nn.Linear)"), (qat, "QAT (ternary BitLinear, W1.58A8 STE)"))
    ]
    ratio = f"**{qat['tokens_per_s'] / plain['tokens_per_s']:.2f}x**"
    rows.append(["**QAT / plain**", ratio, "", f"**{qat['peak_mib'] / max(plain['peak_mib'], 1e-9):.2f}x**"])
    print(common.table(["variant", "tokens/s", "ms/step", "peak memory (MiB)"], rows))


def main() -> int:
    args = parse_args()
    common.use_checkout()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.variant:
        print(json.dumps(run_variant(args)))
        return 0
    results = {}
    for variant in ("plain", "qat"):
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            *sys.argv[1:],
            "--variant",
            variant,
            "--device",
            args.device,
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_table(args, results["plain"], results["qat"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
