#!/usr/bin/env python3
"""Requests that fit one KV-cache memory budget at a long context: the static cache against the paged one.

The static cache gives every row --ctx positions, so a budget of R rows holds R requests whatever their lengths.
The paged cache (`--kv-tokens R * ctx`, the same bytes) gives a row blocks as its tokens arrive: a request is
admitted when the blocks it may fill (prompt + max_tokens) fit. This runs the engine over the model's CPU runner
for N requests of --prompt tokens (the first --shared of them the same for every request: a system prompt) and
--max-tokens greedy tokens, and prints per cache: the KV memory, the growth of the process's resident memory from
before the runner was made to the end (the paged pool's pages are committed as blocks are first used), the most
requests running at once, the most KV
positions held at any step (static: every row's; paged: blocks in use, a shared prompt block counted once), the
requests/s, the prompt tokens computed (the rest were reused; a preempted request's are computed again) and the
preemptions. Prompts are random token ids.

--no-max-tokens: the requests come as chats without max_tokens do (the engine may run each to the end of the
context) and each ends after --max-tokens tokens, as at its end of sequence. Admitted on what it may fill, each
would hold a whole context; admitted on what its prompt needs now, with preemption, they run many at once.
--checkout DIR runs the engine of another checkout (its C library built in place), to compare an earlier
scheduler on the same requests. --device cuda runs the CUDA runners (the resident column: GPU memory allocated).

  python benchmarks/kv_memory.py                                   # a tiny random model
  python benchmarks/kv_memory.py -m smollm2-135m-1.58 --ctx 4096 --rows 8 --prompt 700 --shared 600
  python benchmarks/kv_memory.py -m smollm2-135m-1.58 --ctx 2048 --rows 4 --prompt 300 --no-max-tokens
  python benchmarks/kv_memory.py --device cuda -m smollm2-135m-1.58 --ctx 4096 --rows 8 --prompt 700 --shared 600
"""

from __future__ import annotations

import argparse
import sys
import time

import common


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="model path or zoo name (default: a tiny random model)")
    ap.add_argument("--ctx", type=int, default=4096, help="context per request (default: 4096)")
    ap.add_argument("--rows", type=int, default=8, help="static rows: the memory budget (default: 8)")
    ap.add_argument("--max-batch", type=int, default=128, help="paged: rows (default: 128)")
    ap.add_argument("--requests", type=int, default=64, help="requests (default: 64)")
    ap.add_argument("--prompt", type=int, default=700, help="prompt tokens per request (default: 700)")
    ap.add_argument("--shared", type=int, default=0, help="leading prompt tokens every request shares (0)")
    ap.add_argument("--max-tokens", type=int, default=64, help="generated tokens per request (default: 64)")
    ap.add_argument("--block-size", type=int, default=16, help="paged: positions per block (default: 16)")
    ap.add_argument("--threads", type=int, default=None, help="C kernel threads")
    ap.add_argument(
        "--no-max-tokens",
        action="store_true",
        help="requests without max_tokens (each may run to the context), ending after --max-tokens tokens",
    )
    ap.add_argument("--checkout", help="run another checkout's engine (default: this one)")
    ap.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="the runners' device (default: cpu)"
    )
    return ap.parse_args(argv)


def load(args):
    import bitnetlm

    if args.model:
        backend = "cpu" if args.device == "cpu" else None
        model, tok = bitnetlm.load(args.model, device=args.device, backend=backend, threads=args.threads)
        return model, tok, args.model
    sys.path.insert(0, str(common.ROOT / "tests"))
    from serve_parts import tiny_model_and_tokenizer

    from bitnetlm.kernels import prepare

    model, tok = tiny_model_and_tokenizer(max_len=args.ctx, layers=4, hidden=256, backend="reference")
    prepare(model, args.device)
    return model, tok, "tiny random BitNet (4 layers, hidden 256; random weights)"


def memory(device: str) -> int:
    """The process's resident bytes, or on a GPU the bytes its allocator holds for tensors."""
    if device == "cpu":
        return common.rss_bytes()
    import torch

    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def kv_bytes(runner) -> int:
    """The bytes of a runner's KV cache: a paged pool, a static cache, or the CUDA engine's."""
    if getattr(runner, "pool", None) is not None:
        return runner.nbytes()
    if hasattr(runner, "cache"):
        return runner.cache.nbytes()
    e = runner.eng
    return sum(t.numel() * t.element_size() for t in e.k_cache + e.v_cache)


def run(model, tok, runtime, rows: int, prompts, args) -> dict:
    from bitnetlm.engine.core import EngineCore
    from bitnetlm.engine.metrics import Metrics
    from bitnetlm.engine.sequence import GenerationRequest
    from bitnetlm.runtime import make_runner
    from bitnetlm.sampling import SamplingParams

    before = memory(args.device)
    runner = make_runner(model, runtime, rows, args.ctx)
    metrics = Metrics("m")
    core = EngineCore(runner, tok, metrics=metrics)
    limit = args.ctx - args.prompt if args.no_max_tokens else args.max_tokens
    params = SamplingParams(max_tokens=limit, temperature=0.0, ignore_eos=True)
    groups = [core.add(GenerationRequest(p, params), lambda ev: None) for p in prompts]
    pool = getattr(runner, "pool", None)
    most, held = 0, 0
    t0 = time.perf_counter()
    while core.has_work():
        core.step()
        for g in groups:  # (--no-max-tokens: the request's end of sequence)
            if not g.cancelled and g.completion_tokens >= args.max_tokens:
                core.abort(g)
        most = max(most, len(core.running()))
        held = max(held, pool.in_use() * pool.block_size if pool is not None else rows * args.ctx)
    wall = time.perf_counter() - t0
    resident = memory(args.device) - before
    nbytes = kv_bytes(runner)
    computed = metrics.counters["prompt_tokens_total"]
    return dict(
        bytes=nbytes,
        resident=resident,
        most=most,
        held=held,
        rps=len(prompts) / wall,
        computed=computed,
        preempted=metrics.counters.get("num_preemptions_total", 0),
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    common.use_checkout(args.checkout or common.ROOT)
    import torch

    from bitnetlm.runtime.config import RuntimeConfig

    model, tok, label = load(args)
    if args.prompt + args.max_tokens > args.ctx:
        raise SystemExit("kv_memory: --prompt + --max-tokens must fit --ctx")
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    shared = torch.randint(10, vocab, (args.shared,), generator=g).tolist()
    prompts = [
        shared + torch.randint(10, vocab, (args.prompt - args.shared,), generator=g).tolist()
        for _ in range(args.requests)
    ]
    base = RuntimeConfig(device=args.device, threads=args.threads, max_seq_len=args.ctx)
    budget = args.rows * args.ctx
    cases = [
        (f"static, {args.rows} rows of {args.ctx}", base, args.rows),
        (
            f"paged, --kv-tokens {budget}, {args.max_batch} rows",
            base.replace(kv_tokens=budget, kv_block_size=args.block_size),
            args.max_batch,
        ),
    ]
    out = []
    for name, rt, rows in cases:
        r = run(model, tok, rt, rows, prompts, args)
        out.append(
            [
                name,
                f"{r['bytes'] / 2**20:.0f}",
                f"{r['resident'] / 2**20:.0f}",
                r["most"],
                r["held"],
                f"{r['rps']:.2f}",
                r["computed"],
                r["preempted"],
            ]
        )
    details = (
        f"{label}; {args.requests} requests of {args.prompt} prompt tokens ({args.shared} shared) + "
        f"{args.max_tokens} generated{' (no max_tokens given)' if args.no_max_tokens else ''}, context {args.ctx}"
        + (f"; the engine of commit {common.commit(args.checkout)}" if args.checkout else "")
    )
    common.header("KV cache: requests that fit one memory budget", details=details)
    cols = [
        "cache",
        "KV MiB",
        "resident MiB after",
        "most requests at once",
        "most positions held",
        "requests/s",
        "prompt tokens computed",
        "preemptions",
    ]
    print(common.table(cols, out, right=[False, True, True, True, True, True, True, True]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
