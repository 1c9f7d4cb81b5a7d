#!/usr/bin/env python3
"""Bounded loopback load test of `bitnet serve`: requests/s, TTFT p50/p99 and tokens/s at 1, 8, 32 clients.

Starts `bitnet serve` in a subprocess on 127.0.0.1 (a free port), then for each concurrency level sends a fixed
number of streaming /v1/completions requests from that many concurrent clients (each client sends its next
request as soon as the previous one finished) and prints a markdown table naming the machine and the date.

  python benchmarks/serve_load.py                       # tiny random model (weights random, numbers = overhead)
  python benchmarks/serve_load.py -m path/to/model --max-tokens 64 --requests 64
  python benchmarks/serve_load.py -m DIR --device cuda --sampler llama   # llama.cpp's sampler defaults
  python benchmarks/serve_load.py -m DIR --device cuda --head-dtype int8 --kv-cache-dtype fp8  # the fastest rows
  python benchmarks/serve_load.py -m DIR --device cuda --profile prof.txt --summary  # the server's host time
  python benchmarks/serve_load.py --shared-prefix-words 800 --prefix-caching on,off  # a shared system prompt

--shared-prefix-words N puts the same N words before every prompt (a system prompt); --prefix-caching on,off
serves each setting in turn and also prints the first and the second request's TTFT on a fresh server (the
second finds the shared prefix computed).
  python benchmarks/serve_load.py --json-schema        # every request constrained by a JSON schema (llguidance)

DIR: e.g. the 2B4T-shaped checkpoint of benchmarks/make_checkpoint.py with the LLaMA-3 tokenizer's files copied
in (benchmarks/gpu.py writes it so at .assets/bench-2b4t).

--profile FILE runs the server as a child of `py-spy record` (sampling, raw collapsed stacks per thread, idle
samples left out), which writes its stacks into FILE when the server exits; --summary then sums them by thread and
function: samples, share, and the functions with the most samples inclusive (on the stack) and self (the innermost
frame), leaving out every stack that holds one of --skip (the server's start-up: load, captures, imports), so
that the shares are of the serving work alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import common

# request bodies' sampling settings: greedy, or llama.cpp's defaults (as benchmarks/gpu.py's generate table)
SAMPLERS = {
    "greedy": {"temperature": 0},
    "llama": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
}
# --json-schema: more records than --max-tokens holds, so that every request runs to its end
RECORDS = common.records_schema(1000)
WORDS = "the quick brown fox jumps over the lazy dog while a single man in possession of a fortune".split()


# ---- the server ---------------------------------------------------------------------------------------------
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


def server_command(model: str, args, prefix_caching: str = "on") -> list[str]:
    cmd = [sys.executable, "-m", "bitnetlm.cli", "serve", "-m", model, "--log-level", "warning"]
    cmd += ["--prefix-caching", prefix_caching]
    if args.profile:  # (py-spy's child: no ptrace rights over other processes needed)
        cmd = ["py-spy", "record", "-r", "250", "-f", "raw", "--threads", "-o", args.profile, "--", *cmd]
    cmd += ["--max-batch", str(args.max_batch), "--max-queue", str(args.requests + 8)]
    flags = {
        "--device": args.device,
        "--backend": args.backend,
        "--threads": args.threads,
        "--head-dtype": args.head_dtype,
        "--kv-cache-dtype": args.kv_cache_dtype,
        "--kv-tokens": args.kv_tokens,
    }
    for flag, value in flags.items():
        if value is not None:
            cmd += [flag, str(value)]
    return cmd + (["--enforce-eager"] if args.enforce_eager else [])


def wait_healthy(proc: subprocess.Popen, url: str, model: str) -> None:
    import httpx

    t0 = time.monotonic()
    while (r := httpx.get(url + "/health")).status_code != 200:
        if r.status_code == 503 and r.json().get("status") == "error":  # its model failed to load
            proc.kill()
            raise RuntimeError(f"server failed to load {model}: {r.json().get('error')}")
        if proc.poll() is not None or time.monotonic() - t0 > 600:
            raise RuntimeError("server did not become healthy")
        time.sleep(0.1)


def start_server(
    model: str, args, env_extra: dict, prefix_caching: str = "on"
) -> tuple[subprocess.Popen, str, float]:
    """(the server process, its URL, seconds from its start to its first /health 200: load, capture, warm-up)."""
    t_start = time.monotonic()
    env = dict(os.environ, BITNET_PORT="0", **env_extra)
    env["PYTHONPATH"] = os.pathsep.join([str(common.ROOT), env.get("PYTHONPATH", "")])
    cmd = server_command(model, args, prefix_caching)
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
    wait_healthy(proc, url, model)
    return proc, url, time.monotonic() - t_start


# ---- the clients --------------------------------------------------------------------------------------------
async def one(client, url, prompt, max_tokens, sampler="greedy", extra=None) -> tuple[float, float, int]:
    """(ttft, total seconds, completion tokens) for one streaming request (`extra`: more body fields)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        **SAMPLERS[sampler],
        **(extra or {}),
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


async def level(url, concurrency, n_requests, prompts, max_tokens, sampler="greedy", extra=None) -> dict:
    import httpx

    queue = list(range(n_requests))
    results = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:

        async def worker():
            while queue:
                i = queue.pop()
                prompt = prompts[i % len(prompts)]
                results.append(await one(client, url, prompt, max_tokens, sampler, extra))

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


# ---- the profile's summary ----------------------------------------------------------------------------------
_FRAME = re.compile(r"^(.*) \((.*?)(?::\d+)?\)$")


def _func(frame: str) -> str:
    """'name (path/file.py:123)' -> 'file.py:name' (the line dropped, so that a function's lines add up)."""
    m = _FRAME.match(frame)
    if not m:
        return frame
    name, path = m.groups()
    return f"{path.rsplit('/', 1)[-1]}:{name}"


def load_stacks(path: str, skip: list[str]) -> dict[str, list[tuple[list[str], int]]]:
    """py-spy's raw format, one line a distinct stack ("thread (tid): name;frame;frame... count", root first) ->
    thread name -> [(functions root first, samples)] of the stacks that hold none of `skip`."""
    out: dict[str, list[tuple[list[str], int]]] = defaultdict(list)
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            frames = stack.split(";")
            thread = re.sub(r"^thread \(\d+\):? ?", "", frames[0]) or "(unnamed)"
            funcs = [_func(fr) for fr in frames[1:]]
            if any(s in fn for s in skip for fn in funcs):
                continue
            out[thread].append((funcs, int(n)))
    return out


def print_summary(path: str, skip: list[str], top: int) -> None:
    threads = load_stacks(path, skip)
    total = sum(n for stacks in threads.values() for _, n in stacks)
    if not total:
        raise SystemExit(f"serve_load.py --summary: {path}: no samples left")
    common.header(
        f"Host time of the server under py-spy: {total} samples", details=f"stacks holding {skip} left out"
    )
    for thread, stacks in sorted(threads.items(), key=lambda kv: -sum(n for _, n in kv[1])):
        n_thread = sum(n for _, n in stacks)
        incl, self_ = Counter(), Counter()
        for funcs, n in stacks:
            for fn in set(funcs):
                incl[fn] += n
            if funcs:
                self_[funcs[-1]] += n
        print(f"#### thread {thread}: {n_thread} samples ({100 * n_thread / total:.1f}%)\n")
        rows = [
            [f"`{fn}`", n, f"{100 * n / n_thread:.1f}", self_[fn], f"{100 * self_[fn] / n_thread:.1f}"]
            for fn, n in incl.most_common(top)
        ]
        print(common.table(["function", "inclusive", "% of thread", "self", "% of thread"], rows) + "\n")


# ---- the run ------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "-m", "--model", help="model to serve (default: a tiny random model written to a temp dir)"
    )
    ap.add_argument("--concurrency", type=common.int_list, default=[1, 8, 32], help="client counts (1,8,32)")
    ap.add_argument("--requests", type=int, default=64, help="requests per concurrency level (default: 64)")
    ap.add_argument("--max-tokens", type=int, default=32, help="completion tokens per request (default: 32)")
    ap.add_argument("--prompt-words", type=int, default=48, help="words per prompt (default: 48)")
    ap.add_argument(
        "--shared-prefix-words", type=int, default=0, help="the same words before every prompt (default: 0)"
    )
    ap.add_argument(
        "--prefix-caching",
        type=common.str_list,
        default=["on"],
        help="server --prefix-caching settings, each served in turn (default: on)",
    )
    ap.add_argument("--max-batch", type=int, default=32, help="server --max-batch (default: 32)")
    ap.add_argument("--device", default=None, help="server --device")
    ap.add_argument("--backend", default=None, help="server --backend")
    ap.add_argument("--threads", type=int, default=None, help="server --threads")
    ap.add_argument("--enforce-eager", action="store_true", help="CUDA: serve with the eager forward")
    ap.add_argument("--head-dtype", choices=["bf16", "int8"], default=None, help="server --head-dtype")
    ap.add_argument("--kv-cache-dtype", default=None, help="server --kv-cache-dtype (auto, bf16, fp8)")
    ap.add_argument(
        "--kv-tokens",
        type=int,
        default=None,
        help="server --kv-tokens (CPU: the paged KV cache's positions; 0: the static cache)",
    )
    ap.add_argument(
        "--sampler", choices=sorted(SAMPLERS), default="greedy", help="requests' sampling settings"
    )
    ap.add_argument(
        "--json-schema", action="store_true", help="constrain every request's output by a JSON schema"
    )
    ap.add_argument(
        "--profile", default=None, metavar="FILE", help="run the server under py-spy; stacks into FILE"
    )
    ap.add_argument("--summary", action="store_true", help="with --profile: print the stacks summed")
    ap.add_argument(
        "--skip",
        type=common.str_list,
        default=["app.py:load", "_State.load", "_find_and_load"],
        help="--summary: function names (file.py:name or a part of it) whose stacks are left out (default: the "
        "model's load and the engine's start, which run in app.py's load, and imports)",
    )
    ap.add_argument("--top", type=int, default=25, help="--summary: functions a thread")
    ap.add_argument("--json", action="store_true", help="also print the rows as JSON")
    args = ap.parse_args(argv)
    if args.summary and not args.profile:
        ap.error("--summary sums the stacks of --profile FILE; give one")
    return args


def tiny_model(tmp: str, backend: str | None) -> tuple[str, str, dict]:
    """A tiny random model with its tokenizer saved under tmp: (path, label, server environment)."""
    sys.path.insert(0, str(common.ROOT / "tests"))
    from serve_parts import tiny_model_and_tokenizer

    import bitnetlm

    m, tok = tiny_model_and_tokenizer(max_len=1024, layers=4, hidden=256)
    path = os.path.join(tmp, "tiny")
    bitnetlm.save(m, path, tokenizer=tok)
    label = "tiny random BitNet (4 layers, hidden 256, vocab 506; random weights)"
    return path, label, {"BITNET_BACKEND": backend or "reference"}


def print_rows(args, label: str, ready_s: float, rows: list[dict]) -> None:
    path = "eager forward (--enforce-eager)" if args.enforce_eager else "CUDA graphs where the device is CUDA"
    if args.head_dtype or args.kv_cache_dtype:
        path += f", head {args.head_dtype or 'default'}, KV cache {args.kv_cache_dtype or 'default'}"
    how = "greedy" if args.sampler == "greedy" else "llama.cpp defaults t0.8 k40 p.95 minp.05"
    shared = f" after {args.shared_prefix_words} shared words" if args.shared_prefix_words else ""
    if args.json_schema:
        how += ", output constrained by a JSON schema"
    common.header(
        f"bitnet serve load test: {label}",
        gpu=bool(args.device and args.device.startswith("cuda")),
        details=f"device {args.device or 'auto'}; threads {args.threads or 'default'}; server --max-batch "
        f"{args.max_batch}, {path}; ready {ready_s:.1f} s after its start; {args.requests} streaming requests a "
        f"row; ~{args.prompt_words}-word prompts{shared}, {args.max_tokens} completion tokens each ({how}, "
        "ignore_eos)",
    )
    cols = ["prefix caching", "clients", "requests", "requests/s", "TTFT p50 (ms)", "TTFT p99 (ms)"]
    out = [
        [r["prefix_caching"], r["concurrency"], r["requests"], f"{r['req_s']:.2f}"]
        + [
            f"{r['ttft_p50_ms']:.0f}",
            f"{r['ttft_p99_ms']:.0f}",
            f"{r['tok_s']:.1f}",
            f"{r['mean_latency_s']:.2f}",
        ]
        for r in rows
    ]
    print(common.table([*cols, "output tokens/s", "mean latency (s)"], out))
    if args.json:
        print(json.dumps(rows, indent=1))


def first_two(url: str, prompts: list[str], args, extra) -> tuple[float, float]:
    """TTFT (ms) of a fresh server's first request and of a second one with another prompt (same shared prefix)."""
    import httpx

    async def run():
        async with httpx.AsyncClient(timeout=3600) as client:
            return [(await one(client, url, p, 1, args.sampler, extra))[0] * 1000 for p in prompts[:2]]

    return tuple(asyncio.run(run()))


def _schema_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "records", "schema": RECORDS}}


def main(argv=None) -> int:
    args = parse_args(argv)
    common.use_checkout()
    with tempfile.TemporaryDirectory() as tmp:
        model, label, env_extra = (
            (args.model, args.model, {}) if args.model else tiny_model(tmp, args.backend)
        )
        prefix = " ".join(WORDS[j % len(WORDS)] for j in range(args.shared_prefix_words))
        prompts = [
            (prefix + " " if prefix else "")
            + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(args.prompt_words))
            for i in range(64)
        ]
        rows, firsts = [], []
        extra = {"response_format": _schema_format()} if args.json_schema else None
        for setting in args.prefix_caching:
            proc, url, ready_s = start_server(model, args, env_extra, setting)
            try:
                firsts.append([setting, *(f"{t:.0f}" for t in first_two(url, prompts[-2:], args, extra))])
                asyncio.run(level(url, 1, 2, prompts, 4, args.sampler, extra))  # warm-up
                for c in args.concurrency:
                    r = asyncio.run(
                        level(url, c, args.requests, prompts, args.max_tokens, args.sampler, extra)
                    )
                    rows.append({"prefix_caching": setting, **r})
                    print(f"  prefix caching {setting}, concurrency {c}: done", file=sys.stderr)
            finally:
                stop_server(proc, bool(args.profile))
    print_rows(args, label, ready_s, rows)
    print(
        "\n" + common.table(["prefix caching", "first request TTFT (ms)", "second request TTFT (ms)"], firsts)
    )
    if args.summary:
        print_summary(args.profile, args.skip, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
