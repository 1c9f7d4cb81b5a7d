#!/usr/bin/env python3
"""Perplexity cost of the compact LM head/embedding (bf16, int8 per-row) on real text with a real model.

No pretrained BitNet checkpoint is reachable offline, so this uses the real pretrained SmolLM2-135M-Instruct
(LLaMA architecture, tied 49152 x 576 embedding; `scripts/zoo_fetch_teacher.py`, or `--model` the GGUF that
scripts/fetch_assets.py fetches) on held-out Jane Austen text: the last N tokens of each novel. Only the
head/embedding storage changes between rows. (Heads under 8 bits: `gpu_int8_head_ppl.py --narrow-heads`.)

    python benchmarks/cpu_head_ppl.py --tokens 2048 --ctx 1024
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import bitnetlm  # noqa: E402
from bitnetlm.bench import machine_name  # noqa: E402
from bitnetlm.kernels.cpu.head import set_head_dtype  # noqa: E402
from bitnetlm.train.eval import perplexity  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / ".assets/teacher/smollm2-135m-instruct"))
    ap.add_argument("--texts", default=str(ROOT / ".assets/austen"))
    ap.add_argument("--tokens", type=int, default=2048, help="held-out tokens from the end of each text")
    ap.add_argument("--ctx", type=int, default=1024)
    a = ap.parse_args()
    _, tok = bitnetlm.load(a.model)
    ids = []
    for f in sorted(Path(a.texts).glob("*.txt")):
        ids.append(tok.encode(f.read_text(encoding="utf-8"), add_special_tokens=False)[-a.tokens :])
    print(f"machine: {machine_name()}; model {Path(a.model).name}; {len(ids)} texts x {a.tokens} tokens\n")
    print("| head/embedding | bytes | perplexity | nll (nats/token) | vs float32 | seconds |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    base = None
    for dtype in ("float32", "bf16", "int8"):
        model, _ = bitnetlm.load(a.model)
        model.eval()
        nbytes = model.lm_head_weight().numel() * 4
        if dtype != "float32":
            set_head_dtype(model, dtype)
            nbytes = model.compact_head.nbytes()
        t0 = time.perf_counter()
        nll = tot = 0.0
        for seq in ids:
            r = perplexity(model, seq, ctx=a.ctx, stride=a.ctx // 2)
            nll += r["nll"] * r["tokens"]
            tot += r["tokens"]
        nll /= tot
        base = nll if base is None else base
        ppl = float(torch.tensor(nll).exp())
        print(
            f"| {dtype} | {nbytes / 1e6:.1f} MB | {ppl:.3f} | {nll:.5f} | {nll - base:+.5f} | "
            f"{time.perf_counter() - t0:.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
