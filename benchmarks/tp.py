"""Tensor-parallel decode speed: tokens/s of greedy decode steps at tensor parallelism 1 / 2 / ... (one markdown
table naming the machine and the date).

    python benchmarks/tp.py                                          # bitnet-tiny on the CPU, TP 1 and 2
    python benchmarks/tp.py --model DIR --tp 1,2,4 --batches 1,8,64 --device cuda
    python benchmarks/tp.py --shape 2b4t --threads 1                 # random weights of a real shape (written once)

Each TP degree runs in fresh processes under torchrun (gloo on the CPU, NCCL on CUDA); rank 0 fills --batches
rows with a --prompt-token prompt each, then times --steps decode steps of all of them through the runner that
`generate` would use (`runtime.make_runner`). At TP 1 that is the device's own runner (the CPU's fused C step, the
CUDA-graph engine) and, for comparison, the eager runner that a sharded model runs on every device.
On a CPU of few cores the ranks share the cores: TP there shows the collectives' cost, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import common


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(args) -> None:
    """Under torchrun: one TP degree, every batch; rank 0 prints one JSON line per row."""
    common.use_checkout()
    import torch

    from bitnetlm.loading import load_model
    from bitnetlm.parallel import shard_, tensor_parallel
    from bitnetlm.runtime import make_runner
    from bitnetlm.runtime.config import RuntimeConfig
    from bitnetlm.runtime.eager import EagerRunner
    from bitnetlm.runtime.tp import lead

    size = int(os.environ["WORLD_SIZE"])
    dev = "cuda" if args.device == "cuda" else "cpu"
    with tensor_parallel(size, dev) as tp:
        device = str(tp.device) if tp is not None else dev
        cfg = RuntimeConfig(device=device, threads=args.threads, max_batch=max(args.batches))
        model = load_model(args.model, cfg).eval()
        if tp is not None:
            shard_(model, tp)
        makers = [make_runner] if tp is not None else [make_runner, EagerRunner]

        def run():
            rows = []
            for make in makers:
                for b in args.batches:
                    r = make(model, cfg, b, args.prompt_tokens + args.steps + 8)
                    r.prefill_many(list(range(b)), [[5 + i % 50] * args.prompt_tokens for i in range(b)])
                    pos = [args.prompt_tokens] * b
                    r.decode(list(range(b)), [7] * b, pos)  # warm-up
                    pos = [p + 1 for p in pos]
                    if dev == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        r.decode(list(range(b)), [7] * b, pos)
                        pos = [p + 1 for p in pos]
                    if dev == "cuda":
                        torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                    rows.append(dict(tp=size, runner=type(r).__name__, batch=b, tps=b * args.steps / dt))
                    del r
            return rows

        rows = lead(model, cfg, run)
        if rows is not None:
            for row in rows:
                print("ROW " + json.dumps(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bitnet-tiny", help="model directory, .gguf or zoo name")
    p.add_argument("--shape", default=None, help="random weights of this shape instead (make_checkpoint.py)")
    p.add_argument("--tp", type=common.int_list, default=[1, 2], help="tensor-parallel degrees (default 1,2)")
    p.add_argument("--batches", type=common.int_list, default=[1, 8], help="rows decoded together")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed")
    p.add_argument("--prompt-tokens", type=int, default=32, help="tokens in each row before the timed steps")
    p.add_argument(
        "--threads", type=int, default=None, help="CPU kernel threads per rank (default: cores / TP)"
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.shape:
        from make_checkpoint import write_checkpoint

        args.model = str(write_checkpoint(common.ASSETS / f"bench-{args.shape}", args.shape))
    rows = []
    for n in args.tp:
        threads = args.threads or max(1, (os.cpu_count() or 1) // n)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", f"--master-port={_free_port()}",
               __file__, "--worker", "--model", args.model, "--batches", ",".join(map(str, args.batches)),
               "--steps", str(args.steps), "--prompt-tokens", str(args.prompt_tokens), "--threads", str(threads),
               "--device", args.device]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(common.ROOT)}
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"TP {n} failed:\n{out.stderr[-4000:]}")
        rows += [json.loads(line[4:]) for line in out.stdout.splitlines() if line.startswith("ROW ")]
    common.header(
        f"Tensor-parallel decode, {args.model}",
        gpu=args.device == "cuda",
        details=f"{args.steps} greedy decode steps after {args.prompt_tokens} prompt tokens per row; "
        "tokens/s of all rows together",
    )
    table = [(r["tp"], r["runner"], r["batch"], f"{r['tps']:.1f}") for r in rows]
    print(common.table(["TP", "runner", "batch", "decode tok/s"], table))


if __name__ == "__main__":
    main()
