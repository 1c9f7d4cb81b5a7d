#!/usr/bin/env python3
"""Bounded loopback load test of `bitnet serve`: requests/s, TTFT p50/p99 and tokens/s at 1, 8, 32 clients.

Starts `bitnet serve` in a subprocess on 127.0.0.1 (a free port), then for each concurrency level sends a fixed
number of streaming /v1/completions requests from that many concurrent clients (each client sends its next
request as soon as the previous one finished) and prints a markdown table naming the machine.

  python benchmarks/serve_load.py                       # tiny random model (weights random, numbers = overhead)
  python benchmarks/serve_load.py -m path/to/model --max-tokens 64 --requests 64
  python benchmarks/serve_load.py -m DIR --device cuda --sampler llama   # llama.cpp's sampler defaults
  python benchmarks/serve_load.py -m DIR --device cuda --host-sampler    # CUDA-graph rows, host sampler (A/B)
  python benchmarks/serve_load.py -m DIR --device cuda --no-pipeline     # each step's tokens read first (A/B)
  python benchmarks/serve_load.py -m DIR --device cuda --head-dtype int8 --kv-cache-dtype fp8  # the fastest rows
  python benchmarks/serve_load.py -m DIR --device cuda --profile prof.txt  # the server under py-spy (host time)

--profile runs the server as a child of `py-spy record` (sampling, raw collapsed stacks per thread, idle
samples left out) and writes its stacks when the server exits; `benchmarks/serve_profile.py prof.txt` sums them
by thread and function.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # bitnetlm from this checkout (machine(), the tiny model)


def machine(device: str | None = None) -> str:
    gpu = ""
    if device and device.startswith("cuda"):
        import torch

        gpu = f"{torch.cuda.get_device_name(0)}, "
    from bitnetlm.bench import cpu_model_name

    return f"{gpu}{cpu_model_name()}, {os.cpu_count()} logical cores, Python {platform.python_version()}"


def _child_pid(pid: int) -> int:
    """The first child process of pid (Linux /proc), or pid when it has none."""
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                return int(d.name)
        except OSError:
            continue
    return pid


def stop_server(proc: subprocess.Popen, profiled: bool) -> None:
    """SIGTERM to the server (under --profile py-spy's child: py-spy writes its stacks once that exits)."""
    os.kill(_child_pid(proc.pid) if profiled else proc.pid, signal.SIGTERM)
    try:
        proc.wait(120 if profiled else 60)
    except subprocess.TimeoutExpired:
        proc.kill()


def start_server(model: str, args, env_extra: dict) -> tuple[subprocess.Popen, str, float]:
    """(the server process, its URL, seconds from its start to its first /health 200: load, capture, warm-up)."""
    t_start = time.monotonic()
    env = dict(os.environ, BITNET_PORT="0", **env_extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "bitnetlm.cli", "serve", "-m", model, "--log-level", "warning"]
    if args.profile:  # (py-spy's child: no ptrace rights over other processes needed)
        cmd = ["py-spy", "record", "-r", "250", "-f", "raw", "--threads", "-o", args.profile, "--", *cmd]
    cmd += ["--max-batch", str(args.max_batch), "--max-queue", str(args.requests + 8)]
    if args.device:
        cmd += ["--device", args.device]
    if args.backend:
        cmd += ["--backend", args.backend]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.enforce_eager:
        cmd += ["--enforce-eager"]
    if args.head_dtype:
        cmd += ["--head-dtype", args.head_dtype]
    if args.kv_cache_dtype:
        cmd += ["--kv-cache-dtype", args.kv_cache_dtype]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    url, seen = None, []
    while url is None:
        line = proc.stderr.readline()
        if not line:
            tail = "".join(seen[-20:])
            raise RuntimeError(f"server exited (rc={proc.wait()}); its stderr:\n{tail}")
        seen.append(line)
        m = re.search(r"listening on (http://\S+)", line)
        url = m.group(1) if m else None
    threading.Thread(target=lambda: [sys.stderr.write(x) for x in proc.stderr], daemon=True).start()
    import httpx

    t0 = time.monotonic()
    while (r := httpx.get(url + "/health")).status_code != 200:
        if r.status_code == 503 and r.json().get("status") == "error":  # its model failed to load
            proc.kill()
            raise RuntimeError(f"server failed to load {model}: {r.json().get('error')}")
        if proc.poll() is not None or time.monotonic() - t0 > 600:
            raise RuntimeError("server did not become healthy")
        time.sleep(0.1)
    return proc, url, time.monotonic() - t_start


# request bodies' sampling settings: greedy, or llama.cpp's defaults (as benchmarks/gpu_generate.py)
SAMPLERS = {
    "greedy": {"temperature": 0},
    "llama": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
}


async def one(client, url, prompt, max_tokens, sampler="greedy") -> tuple[float, float, int]:
    """(ttft, total seconds, completion tokens) for one streaming request."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        **SAMPLERS[sampler],
    }
    body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d["choices"] and ttft is None:
                ttft = time.perf_counter() - t0
            if d.get("usage"):
                tokens = d["usage"]["completion_tokens"]
    return ttft or 0.0, time.perf_counter() - t0, tokens


async def level(url, concurrency, n_requests, prompts, max_tokens, sampler="greedy") -> dict:
    import httpx

    queue = list(range(n_requests))
    results = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:

        async def worker():
            while queue:
                i = queue.pop()
                results.append(await one(client, url, prompts[i % len(prompts)], max_tokens, sampler))

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    toks = sum(r[2] for r in results)

    def pct(q):
        return ttfts[min(len(ttfts) - 1, int(round(q * (len(ttfts) - 1))))]

    return {
        "concurrency": concurrency,
        "requests": len(results),
        "wall_s": wall,
        "req_s": len(results) / wall,
        "ttft_p50_ms": 1000 * pct(0.5),
        "ttft_p99_ms": 1000 * pct(0.99),
        "tok_s": toks / wall,
        "tokens": toks,
        "mean_latency_s": statistics.mean(r[1] for r in results),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "-m", "--model", help="model to serve (default: a tiny random model written to a temp dir)"
    )
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated client counts (default: 1,8,32)")
    ap.add_argument("--requests", type=int, default=64, help="requests per concurrency level (default: 64)")
    ap.add_argument("--max-tokens", type=int, default=32, help="completion tokens per request (default: 32)")
    ap.add_argument("--prompt-words", type=int, default=48, help="words per prompt (default: 48)")
    ap.add_argument("--max-batch", type=int, default=32, help="server --max-batch (default: 32)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true", help="CUDA: serve with the eager forward")
    ap.add_argument("--head-dtype", choices=["bf16", "int8"], default=None, help="server --head-dtype")
    ap.add_argument("--kv-cache-dtype", default=None, help="server --kv-cache-dtype (auto, bf16, fp8)")
    ap.add_argument(
        "--sampler", choices=sorted(SAMPLERS), default="greedy", help="requests' sampling settings"
    )
    ap.add_argument(
        "--host-sampler",
        action="store_true",
        help="CUDA: the graph rows sample on the host (BITNETLM_HOST_SAMPLER=1, the path before stop 52)",
    )
    ap.add_argument(
        "--no-pipeline",
        action="store_true",
        help="CUDA: read each step's tokens before queueing the next (BITNETLM_SERVE_PIPELINE=0, before stop 53)",
    )
    ap.add_argument(
        "--profile", default=None, metavar="FILE", help="run the server under py-spy; its stacks into FILE"
    )
    ap.add_argument("--json", action="store_true", help="also print the rows as JSON")
    args = ap.parse_args(argv)

    tmp = None
    model = args.model
    label = model
    env_extra = {}
    if model is None:
        from serve_parts import tiny_model_and_tokenizer

        import bitnetlm

        m, tok = tiny_model_and_tokenizer(max_len=1024, layers=4, hidden=256)
        tmp = tempfile.TemporaryDirectory()
        model = os.path.join(tmp.name, "tiny")
        bitnetlm.save(m, model, tokenizer=tok)
        label = "tiny random BitNet (4 layers, hidden 256, vocab 506; random weights)"
        env_extra["BITNET_BACKEND"] = args.backend or "reference"
    words = (
        "the quick brown fox jumps over the lazy dog while a single man in possession of a fortune".split()
    )
    prompts = [" ".join(words[(i + j) % len(words)] for j in range(args.prompt_words)) for i in range(64)]
    if args.host_sampler:
        env_extra["BITNETLM_HOST_SAMPLER"] = "1"
    if args.no_pipeline:
        env_extra["BITNETLM_SERVE_PIPELINE"] = "0"
    proc, url, ready_s = start_server(model, args, env_extra)
    rows = []
    try:
        asyncio.run(level(url, 1, 2, prompts, 4, args.sampler))  # warm-up
        for c in [int(x) for x in args.concurrency.split(",")]:
            rows.append(asyncio.run(level(url, c, args.requests, prompts, args.max_tokens, args.sampler)))
            print(f"  concurrency {c}: done", file=sys.stderr)
    finally:
        stop_server(proc, bool(args.profile))
        if tmp is not None:
            tmp.cleanup()
    print(f"\n### bitnet serve load test: {label}\n")
    print(
        f"machine: {machine(args.device)}; device {args.device or 'auto'}; torch threads {args.threads or 'default'}"
    )
    path = "eager forward (--enforce-eager)" if args.enforce_eager else "CUDA graph where the device is CUDA"
    if args.host_sampler:
        path += ", host sampler"
    if args.no_pipeline:
        path += ", no pipelining"
    if args.head_dtype or args.kv_cache_dtype:
        path += f", head {args.head_dtype or 'default'}, KV cache {args.kv_cache_dtype or 'default'}"
    if os.environ.get("BITNETLM_WIDE_SAMPLER") == "0":
        path += ", PyTorch's sampler ops (BITNETLM_WIDE_SAMPLER=0)"
    print(
        f"server --max-batch {args.max_batch}, {path}; ready {ready_s:.1f} s after its start "
        f"(TRITON_CACHE_DIR {os.environ.get('TRITON_CACHE_DIR', 'default')}); "
        f"{args.requests} streaming requests per row; ",
        end="",
    )
    how = "greedy" if args.sampler == "greedy" else "llama.cpp defaults t0.8 k40 p.95 minp.05"
    print(
        f"~{args.prompt_words}-word prompts, {args.max_tokens} completion tokens each ({how}, ignore_eos)\n"
    )
    print(
        "| clients | requests | requests/s | TTFT p50 (ms) | TTFT p99 (ms) | output tokens/s | mean latency (s) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['concurrency']} | {r['requests']} | {r['req_s']:.2f} | {r['ttft_p50_ms']:.0f} | "
            f"{r['ttft_p99_ms']:.0f} | {r['tok_s']:.1f} | {r['mean_latency_s']:.2f} |"
        )
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
