"""The CUDA half of `bitnet bench`: prefill and CUDA-graph decode of the Triton engine vs our own bf16 engine.

Both engines are `bitnetlm.runtime.cuda.engine.CudaEngine` over the same model shape with random weights (ternary in
the real packed layout vs unquantized bf16 matrices), with the same CUDA-graph treatment, timed with CUDA
events. Reported per batch size and depth (tokens already in each row's KV cache when a test starts, as
llama-bench's --n-depth; 0: an empty cache): prefill ms and tokens/s, decode ms/step, tokens/s and the GB/s of
weights a decode step reads (projections + LM head + embedding rows, gpt-fast style), and the ternary/bf16 ratio.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys

import torch


def gpu_name() -> str:
    p = torch.cuda.get_device_properties(0)
    return f"{p.name} ({p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs), torch {torch.__version__}"


def _events_ms(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


@torch.no_grad()
def bench_engine(
    eng, batches=(1, 8, 64), n_prompt: int = 512, n_gen: int = 128, reps: int = 5, depths=(0,)
) -> list[dict]:
    """Rows of prefill/decode timings of one engine, per batch size and depth (graphs captured for each). At
    depth d each row's cache first holds d random tokens (run untimed); the prefill then starts at position d
    (a chunk continuing the prompt) and the decode steps at d, captured for d + n_gen keys."""
    from bitnetlm.runtime.cuda.graphs import capture

    vocab = eng.cfg.vocab_size
    rows = []
    for b, d in ((b, d) for b in batches for d in depths):
        tok = torch.randint(0, vocab, (b, d + n_prompt), device=eng.device)
        pos = torch.full((b,), d, dtype=torch.int32, device=eng.device)
        if d:
            eng.forward(tok[:, :d], torch.zeros_like(pos))  # the context: positions 0..d-1 of every row
        graph, _ = capture(lambda tok=tok[:, d:], pos=pos, d=d: eng.forward(tok, pos, start=d))
        pre = _events_ms(graph.replay, reps)
        del graph
        st = eng.decode_state(b, max_keys=d + n_gen)

        def decode(st=st, d=d):
            st.tok.random_(0, vocab)
            st.pos.fill_(d)  # after the d tokens of context
            st.step.fill_(1)
            for _ in range(n_gen):
                st.graph.replay()

        dec = _events_ms(decode, reps)
        pre_ms, dec_ms = statistics.median(pre), statistics.median(dec) / n_gen
        nbytes = eng.bytes_per_step(b)
        rows.append(
            dict(
                weights=eng.ecfg.weights,
                head=eng.ecfg.head,
                batch=b,
                depth=d,
                prefill_tokens=n_prompt,
                prefill_ms=pre_ms,
                prefill_tok_s=b * n_prompt / pre_ms * 1e3,
                decode_ms_per_step=dec_ms,
                decode_tok_s=b / dec_ms * 1e3,
                decode_weight_gb_s=nbytes / dec_ms / 1e6,
                weight_bytes_per_step=nbytes,
                weight_gib=sum(eng.weight_bytes().values()) / 2**30,
            )
        )
        eng._graphs.clear()
        torch.cuda.empty_cache()
    return rows


PAGED = "+paged"  # a KV-cache name's suffix: the paged cache, every row's blocks scattered over the pool


def _engine_config(max_batch: int, max_seq_len: int, head: str, kv_cache_dtype: str, weights: str):
    from bitnetlm.runtime.config import kv_cache_dtype as parse_kv_cache_dtype
    from bitnetlm.runtime.cuda.engine import EngineConfig

    kv = parse_kv_cache_dtype(kv_cache_dtype.removesuffix(PAGED))
    blocks = max_batch * -(-max_seq_len // 16) if kv_cache_dtype.endswith(PAGED) else 0
    return EngineConfig(
        max_batch=max_batch,
        max_seq_len=max_seq_len,
        weights=weights,
        head=head,
        kv_dtype=kv,
        kv_blocks=blocks,
    )


def _deal_blocks(eng, seed: int = 0) -> None:
    """A paged engine's rows each take a whole context's blocks, in random order over the pool."""
    if eng.table is not None:
        rows, per_row = eng.ecfg.max_batch, eng.table.shape[1]
        g = torch.Generator().manual_seed(seed)
        ids = torch.randperm(eng.ecfg.kv_blocks, generator=g)[: rows * per_row].view(rows, per_row)
        eng.table[:rows] = ids.to(eng.device, torch.int32)


def random_engine(
    max_batch: int,
    max_seq_len: int,
    head: str = "fp",
    kv_cache_dtype: str = "auto",
    weights: str = "ternary",
    shape: dict | None = None,
):
    """A `CudaEngine` of random weights in the real packed layout, of the 2B4T shape (`ModelConfig`'s defaults,
    or those `shape` overrides): what `bitnet bench` and the GPU scripts in benchmarks/ time. kv_cache_dtype:
    "auto" (the activations' bf16) or "fp8", each with `PAGED` appended for a paged cache."""
    from bitnetlm.models import ModelConfig
    from bitnetlm.runtime.cuda.engine import CudaEngine

    ecfg = _engine_config(max_batch, max_seq_len, head, kv_cache_dtype, weights)
    eng = CudaEngine.random(ModelConfig(**(shape or {})), ecfg)
    _deal_blocks(eng)
    return eng


def bench_cuda(
    shape: dict | None = None,
    batches=(1, 8, 64),
    n_prompt: int = 512,
    n_gen: int = 128,
    heads=("fp",),
    baseline: bool = True,
    reps: int = 5,
    kv=("auto",),
    max_seq_len: int | None = None,
    model=None,
    label: str = "",
    depths=(0,),
) -> dict:
    """Ternary engine (each head option x KV-cache type: "auto" = bf16, "fp8") and the bf16 baseline on the same
    shape, at each depth (`bench_engine`); returns rows + ratios. model: a loaded bitnetlm CausalLM to build the
    engines from (the baseline from its ternary weights times their scales, in bf16) instead of random weights of
    `shape`; label names it."""
    from bitnetlm.runtime.cuda.engine import CudaEngine

    need = max(depths) + n_prompt + n_gen + 1
    seq = max_seq_len or need  # KV-cache positions (a server allocates its whole context)
    if seq < need:
        raise ValueError(
            f"max_seq_len {seq} is shorter than depth + prompt + decode "
            f"({max(depths)} + {n_prompt} + {n_gen} + 1)"
        )
    rows = []
    kinds = [("ternary", h, c) for h in heads for c in kv] + ([("dense", "fp", "auto")] if baseline else [])
    for weights, head, cache in kinds:
        torch.cuda.reset_peak_memory_stats()
        if model is None:
            eng = random_engine(max(batches), seq, head, cache, weights, shape)
        else:
            eng = CudaEngine.from_model(model, _engine_config(max(batches), seq, head, cache, weights))
            _deal_blocks(eng)
        rows += [dict(r, kv=cache) for r in bench_engine(eng, batches, n_prompt, n_gen, reps, depths)]
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    ratios = []
    for r in rows:
        if r["weights"] != "ternary":
            continue
        base = [
            d
            for d in rows
            if d["weights"] == "dense" and (d["batch"], d["depth"]) == (r["batch"], r["depth"])
        ]
        if base:
            ratios.append(
                dict(
                    head=r["head"],
                    kv=r["kv"],
                    batch=r["batch"],
                    depth=r["depth"],
                    decode_speedup=r["decode_tok_s"] / base[0]["decode_tok_s"],
                    prefill_speedup=r["prefill_tok_s"] / base[0]["prefill_tok_s"],
                )
            )
    source = label or "random weights of the shape"
    config = dict(n_prompt=n_prompt, n_gen=n_gen, depths=list(depths), max_seq_len=seq, weights=source)
    return dict(gpu=gpu_name(), config=config, results=rows, ratios=ratios)


def markdown(res: dict) -> str:
    cfg = res["config"]
    out = [
        f"GPU: {res['gpu']}; prompt {cfg['n_prompt']} tokens, decode {cfg['n_gen']} steps, each test after "
        f"`depth` tokens already in every row's KV cache; KV cache of {cfg['max_seq_len']} positions; "
        f"{cfg['weights']}",
        "",
        "| weights | head | KV cache | batch | depth | prefill ms | prefill tok/s | decode ms/step | decode tok/s "
        "| weights GB/s | vs bf16 (decode) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in res["results"]:
        sp = [
            x
            for x in res["ratios"]
            if (x["batch"], x["depth"], x["head"], x["kv"]) == (r["batch"], r["depth"], r["head"], r["kv"])
        ]
        ratio = f"{sp[0]['decode_speedup']:.2f}x" if r["weights"] == "ternary" and sp else "-"
        name = "ternary (Triton W2A8)" if r["weights"] == "ternary" else "bf16 (cuBLAS)"
        out.append(
            f"| {name} | {'bf16' if r['head'] == 'fp' else r['head']} | {_kv_name(r['kv'])} "
            f"| {r['batch']} | {r['depth']} | {r['prefill_ms']:.2f} | "
            f"{r['prefill_tok_s']:,.0f} | {r['decode_ms_per_step']:.3f} | {r['decode_tok_s']:,.0f} | "
            f"{r['decode_weight_gb_s']:,.0f} | {ratio} |"
        )
    return "\n".join(out)


def _kv_name(kv: str) -> str:
    base = kv.removesuffix(PAGED)
    return ("fp8" if base == "fp8" else "bf16") + (" paged" if kv.endswith(PAGED) else "")


def run_cuda(args) -> int:
    """`bitnet bench --device cuda`: the hook called by bitnetlm.bench.run. -m: the engines are built from that
    model (its own weights; the bf16 baseline from them); --shape (default 2b4t): random weights of the shape."""
    from bitnetlm.models.shapes import SHAPES
    from bitnetlm.runtime.config import kv_cache_dtype as parse_kv_cache_dtype

    kv = tuple(args.kv_cache_dtype or ("auto",))
    try:
        for c in kv:
            parse_kv_cache_dtype(c.removesuffix(PAGED))
    except ValueError as exc:
        print(f"bitnet bench: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(f"bitnet bench: --device {args.device} needs a CUDA GPU; torch sees none", file=sys.stderr)
        return 2
    n_prompt = args.n_prompt[-1] if args.n_prompt else 512
    n_gen = args.n_gen[-1] if args.n_gen else 128
    batches = tuple(args.batch or (1, 8, 64))
    heads = ("int8",) if args.head_dtype == "int8" else ("fp",)
    model, label, shape = None, "", SHAPES[args.shape or "2b4t"]
    if args.model:
        from bitnetlm.loading import load_model

        model = load_model(args.model, device=args.device, backend=args.backend).eval()
        label = f"the weights of {args.model}"
    res = bench_cuda(
        shape,
        batches,
        n_prompt,
        n_gen,
        heads=heads,
        reps=max(1, args.repetitions),
        kv=kv,
        model=model,
        label=label,
        depths=tuple(args.n_depth),
    )
    print(json.dumps(res, indent=2) if args.json else markdown(res))
    return 0
