"""Are two checkouts' CUDA engines bit-identical? (device machine) The logits of a few decode steps of a random
2B4T engine, computed in a fresh process by each tree's own package, compared element for element.

    python benchmarks/gpu_logits_diff.py --baseline DIR [--batches 1,2,8] [--steps 6] [--head int8]
        [--kv-cache-dtype fp8]

The twin of `gpu_compare.py` for a change meant not to move a single bit (a kernel restructured for speed): DIR
holds the baseline's `bitnetlm/` (e.g. `mkdir -p .scratch/base && git archive main bitnetlm benchmarks | tar -x -C
.scratch/base`, carried with the device call). Each batch size decodes `--steps` eager steps (`CudaEngine.forward`,
the same kernels as the captured step) from position 0, feeding back its greedy tokens; the same seed gives both
trees the same weights and first tokens. Prints one row a (batch, step): identical, or the largest difference.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(out: str, batches: list[int], steps: int, head: str, kv: str) -> None:
    """This process's package (first on sys.path): the logits of every (batch, step) into `out`."""
    from bitnetlm.models import ModelConfig
    from bitnetlm.models.cache import parse_kv_cache_dtype
    from bitnetlm.runtime.cuda.engine import CudaEngine, EngineConfig

    cfg = ModelConfig()
    ecfg = EngineConfig(
        max_batch=max(batches), max_seq_len=steps + 8, head=head, kv_dtype=parse_kv_cache_dtype(kv)
    )
    eng = CudaEngine.random(cfg, ecfg)
    g = torch.Generator(device="cuda").manual_seed(1)
    res = {}
    with torch.no_grad():
        for b in batches:
            tok = torch.randint(0, cfg.vocab_size, (b, 1), device="cuda", generator=g)
            pos = torch.zeros(b, dtype=torch.int32, device="cuda")
            for step in range(steps):
                logits = eng.forward(tok, pos)
                res[(b, step)] = logits.float().cpu()
                tok = logits.argmax(-1, keepdim=True)
                pos += 1
    torch.save(res, out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="a tree with the baseline's bitnetlm/")
    ap.add_argument("--batches", default="1,2,8")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--head", default="int8", help="fp (bf16) or int8")
    ap.add_argument("--kv-cache-dtype", default="fp8", help="auto (bf16) or fp8")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    if a._child:
        child(a._child, batches, a.steps, a.head, a.kv_cache_dtype)
        return 0
    if not a.baseline or not os.path.isdir(os.path.join(a.baseline, "bitnetlm")):
        raise SystemExit(f"--baseline {a.baseline}: expected a tree holding bitnetlm/")
    opts = [
        "--batches",
        a.batches,
        "--steps",
        str(a.steps),
        "--head",
        a.head,
        "--kv-cache-dtype",
        a.kv_cache_dtype,
    ]
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, tree in (("base", os.path.abspath(a.baseline)), ("new", HERE)):
            out = os.path.join(tmp, f"{name}.pt")
            env = dict(os.environ, PYTHONPATH=tree)  # that tree's package first
            res = subprocess.run([sys.executable, __file__, *opts, "--_child", out], env=env, cwd=tree)
            if res.returncode:
                raise SystemExit(f"the {name} tree's process failed (exit {res.returncode})")
            got[name] = torch.load(out)
    print(
        f"GPU: {torch.cuda.get_device_name()}; random 2B4T engine, head {a.head}, cache {a.kv_cache_dtype}\n"
    )
    print("| batch | step | logits |\n| ---: | ---: | --- |")
    same = True
    for (b, step), x in got["base"].items():
        y = got["new"][(b, step)]
        ok = torch.equal(x, y)
        same &= ok
        print(f"| {b} | {step} | {'identical' if ok else f'max |diff| {(x - y).abs().max().item():.3g}'} |")
    print("\nall identical" if same else "\nDIFFERENT")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
