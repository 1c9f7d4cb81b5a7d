"""Where `generate`'s CUDA-graph loop spends GPU time a token beyond the decode step (device machine).

    python benchmarks/gpu_loop_profile.py [--head-dtype int8 --kv-cache-dtype fp8] [--out DIR] [--tag NAME]

A 2B4T-shaped checkpoint (random weights, benchmarks/make_checkpoint.py) with the LLaMA-3 tokenizer, batch 1, a
128-token prompt. Prints, per sampler (greedy, llama.cpp's defaults): `generate`'s decode tok/s; the logits step
alone and gpu_bench's greedy-folded step as chains of replays; the captured sampler alone; stop 59's loop (the
sampler's graph + copies + the step's graph) and generate's since stop 61 (one graph: the step, the sampler, and
its outputs stored into pinned host memory); and a torch.profiler summary of 12 iterations of each of those two
(GPU ops by time an iteration). DIR gets each profile's timeline of the last iteration
(timeline_TAG_SAMPLER_{loop,both}.txt).
"""

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bitnetlm.generate import SamplingParams, Tokenizer, generate  # noqa: E402
from bitnetlm.loading import load_model  # noqa: E402

SAMPLERS = {
    "greedy": dict(temperature=0),
    "llama": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=0),
}


def chain(fn, n=200, rounds=3):
    best = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        torch.cuda.synchronize()
        best.append(a.elapsed_time(b) / n)
    return min(best), max(best)


def host_time(fn, n=200):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    h = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    return h


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dtype", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--tag", default="bf16")
    a = ap.parse_args()
    from bitnetlm.generate.graph import graph_engine
    from make_checkpoint import write_checkpoint

    from bitnetlm.models.cache import parse_kv_cache_dtype
    from bitnetlm.runtime.cuda.graph_sampler import graph_sampler
    from bitnetlm.sampling.sampler import RowRandom

    d = os.path.join(ROOT, ".assets", "bench-2b4t")
    write_checkpoint(d, "2b4t")
    model = load_model(d, device="cuda", dtype=torch.bfloat16, head_dtype=a.head_dtype).eval()
    model.kv_cache_dtype = parse_kv_cache_dtype(a.kv_cache_dtype)
    tok = Tokenizer.from_dir(os.path.join(ROOT, ".assets", "llama3-tokenizer"))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1000, 100000, (128,), generator=g).tolist()
    print(f"== head {a.head_dtype or 'bf16'} kv {a.kv_cache_dtype}")
    for name, kw in SAMPLERS.items():
        p = SamplingParams(max_tokens=256, ignore_eos=True, **kw)
        generate(model, tok, prompt, SamplingParams(max_tokens=4, ignore_eos=True, **kw))
        tps = [generate(model, tok, prompt, p).generation_tps for _ in range(2)]
        print(
            f"{name}: generate decode tok/s (row 0) {tps[0]:.1f} / {tps[1]:.1f} -> {1e3 / max(tps):.3f} ms/token"
        )

    eng = graph_engine(model, 1, 1024)
    with torch.no_grad():
        st = eng.logits_state(1, max_keys=384)
        fold = eng.decode_state(1, max_keys=384)  # gpu_bench's step: greedy folded into the head

        def reset():
            st.pos.fill_(128)
            fold.pos.fill_(128)
            fold.step.fill_(0)

        reset()
        print(f"logits step alone: {chain(lambda: st.graph.replay(), 200)} ms (pos 128..328)")
        reset()
        print(f"greedy-fold step alone (gpu_bench's): {chain(lambda: fold.graph.replay(), 200)} ms")
        for name, kw in SAMPLERS.items():
            prm = SamplingParams(max_tokens=1024, **kw)
            rr = RowRandom(torch.Generator(device="cuda").manual_seed(0), "cuda")
            gs = graph_sampler(eng, st, [prm], [rr], [1000], 0)
            tok_h = torch.empty((1,), dtype=torch.long, pin_memory=True)
            lp_h = torch.empty((1,), dtype=torch.float32, pin_memory=True)
            ready = torch.cuda.Event()
            print(
                f"{name}: sampler alone {chain(gs.run, 200)} ms; host per run {host_time(gs.run) * 1e3:.4f} ms"
            )

            def it(gs=gs, tok_h=tok_h, lp_h=lp_h, ready=ready):  # (used within this iteration)
                gs.run()
                tok_h.copy_(gs.tok, non_blocking=True)
                lp_h.copy_(gs.lp, non_blocking=True)
                ready.record()
                st.graph.replay()

            reset()
            gs.step.zero_()
            print(
                f"{name}: sampler+copies+step chain {chain(it, 150)} ms; host per it {host_time(it, 150) * 1e3:.4f} ms"
            )

            def it_nocopy(gs=gs):
                gs.run()
                st.graph.replay()

            reset()
            gs.step.zero_()
            print(f"{name}: sampler+step chain (no D2H) {chain(it_nocopy, 150)} ms")
            both = gs.step_graph(st)  # generate's loop since stop 61: step + sampler + export in one graph

            def it_both(ready=ready, both=both):
                both.replay()
                ready.record()

            reset()
            gs.step.zero_()
            print(
                f"{name}: step+sampler+export graph chain {chain(it_both, 150)} ms; "
                f"host per it {host_time(it_both, 150) * 1e3:.4f} ms"
            )
            for what, fn in (("loop", it), ("both", it_both)):
                profile_its(a, name, what, fn, reset, gs)


def profile_its(a, name, what, it, reset, gs):
    """A torch.profiler summary of 12 iterations of `it`, and the last ones' timeline into a.out."""
    reset()
    gs.step.zero_()
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        it()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(12):
            it()
        torch.cuda.synchronize()
    name = f"{name}_{what}"
    path = os.path.join(a.out, f"trace_{a.tag}_{name}.json")
    prof.export_chrome_trace(path)
    ev = json.load(open(path))["traceEvents"]
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    gpu.sort(key=lambda e: e["ts"])
    # find iteration boundaries: the first kernel of the sampler = the first after the head kernel
    t0, t1 = gpu[0]["ts"], gpu[-1]["ts"] + gpu[-1]["dur"]
    busy = sum(e["dur"] for e in gpu)
    print(
        f"{name}: profiled 12 its: span {(t1 - t0) / 12:.1f} us/it, kernels busy {busy / 12:.1f} us/it, {len(gpu) / 12:.1f} ops/it"
    )
    # print the last ~1.2 iterations' ops with gaps
    n_it = len(gpu) // 12
    seg = gpu[-n_it - 12 :]
    prev = None
    lines = []
    for e in seg:
        gap = 0 if prev is None else e["ts"] - prev
        lines.append(f"  {e['ts'] - seg[0]['ts']:9.1f} dur {e['dur']:7.2f} gap {gap:6.2f}  {e['name'][:90]}")
        prev = e["ts"] + e["dur"]
    # aggregate by name (non-layer)
    agg = {}
    for e in gpu:
        k = e["name"][:70]
        agg.setdefault(k, [0, 0.0])
        agg[k][0] += 1
        agg[k][1] += e["dur"]
    print(f"{name}: ops by total time per iteration:")
    for k, (c, t) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:40]:
        print(f"   {t / 12:8.2f} us  x{c / 12:5.1f}  {k}")
    with open(os.path.join(a.out, f"timeline_{a.tag}_{name}.txt"), "w") as f:
        f.write("\n".join(lines))
    os.remove(path)


if __name__ == "__main__":
    main()
