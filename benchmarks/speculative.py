"""Speculative decoding on the CPU: single-stream greedy tokens/s without and with prompt lookup on the zoo's
models and real text, and what one verify pass costs against one decode step. Markdown tables.

    python benchmarks/speculative.py                          # both zoo models, every prompt, k 4 and 8
    python benchmarks/speculative.py --models bitnet-tiny --draft-max 4 --tokens 128 --threads 2
    python benchmarks/speculative.py --models smollm2-135m-1.58 --draft-model runs/draft \
        --draft-max 3,5                          # lookup, a draft model (scripts/train_smollm2_draft.py), both

Prompts are input-grounded, built from Jane Austen (.assets/austen) and this package's own Python source: copy a
passage, copy it with an edit, restate a function, continue a numbered list, and one free continuation (not
grounded: what lookup costs where it finds little). Each row is greedy generation of --tokens tokens (ignore_eos),
the baseline measured in the same run; speculative output is checked token for token against it.

With --draft-model the runs interleave: each repetition generates once without, then once per k and method
(prompt lookup, the draft model, both), so that a noisy machine's slow spells fall on all sides; the rows give the
median of the timed repetitions, and the benchmark stops if any speculative output differs from the baseline's.
"""

from __future__ import annotations

import argparse

import common
from common import int_list, str_list


def prompts() -> dict[str, str]:
    """name -> prompt text."""
    austen = (common.ASSETS / "austen" / "prideprejudice.txt").read_text(encoding="utf-8")
    para = " ".join(austen[20000:20700].split())
    src = (common.ROOT / "bitnetlm" / "engine" / "scheduler.py").read_text(encoding="utf-8")
    fn = src[src.index("    def schedule(self)") : src.index("    def _plan_prefill")][
        :1800
    ]  # (fits 1,024 positions)
    edited = para.replace("Elizabeth", "Lizzy")
    return {
        "copy a passage": f"Original text:\n{para}\n\nThe same text, copied exactly:\n{para[:60]}",
        "copy with an edit": f"Text:\n{para}\n\nThe text with Elizabeth renamed Lizzy:\n{edited[:60]}",
        "restate code": f"```python\n{fn}```\n\nThe same method with a docstring:\n\n```python\n{fn[:80]}",
        "numbered list": "".join(f"{i}. {w}\n" for i, w in enumerate(para.split()[:40], 1))
        + "\nThe list again:\n1.",
        "free continuation": para[:300],
    }


def verify_cost(model, ks, reps: int) -> list[tuple[int, float, float]]:
    """(k + 1, ms of one verify pass of k + 1 tokens, that in decode steps) at a 256-token context."""
    import torch

    from bitnetlm.runtime import make_runner
    from bitnetlm.runtime.config import RuntimeConfig

    r = make_runner(model, RuntimeConfig(), 1, 512)
    ids = torch.randint(
        0, model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    r.prefill(0, ids[:256])
    decode = common.best_seconds(lambda: r.decode([0], [ids[256]], [256]), reps)
    out = []
    for k in ks:
        t = common.best_seconds(lambda k=k: r.verify(0, ids[256 : 257 + k], 256), reps)
        out.append((k + 1, t * 1e3, t / decode))
    return [(1, decode * 1e3, 1.0), *out]


def draft_rows(model, tok, draft, name: str, ks, n_gen: int, reps: int, lookup: int) -> list[tuple]:
    """Per prompt, k and method (prompt lookup, the draft model, both): median t/s without and with it, the
    speedup, acceptance and tokens per target pass."""
    import statistics

    from bitnetlm.engine.speculative import SpeculativeConfig
    from bitnetlm.generate import generate

    methods = {
        "lookup": dict(lookup=lookup),
        "draft model": dict(draft=draft),
        "lookup + draft model": dict(lookup=lookup, lookup_min=2, draft=draft),
    }
    rows = []
    for pname, text in prompts().items():
        base_tps, runs = [], {(k, m): [] for k in ks for m in methods}
        for _ in range(reps + 1):  # the first warms up
            kw = dict(max_tokens=n_gen, temperature=0, ignore_eos=True)
            base = generate(model, tok, text, **kw)
            base_tps.append(base.generation_tps)
            for k, m in runs:
                r = generate(
                    model, tok, text, speculative=SpeculativeConfig(num_tokens=k, **methods[m]), **kw
                )
                if r.tokens != base.tokens:
                    raise SystemExit(f"{name}, {m}, {pname!r}, k {k}: the output differs from the baseline's")
                runs[k, m].append(r)
        b = statistics.median(base_tps[1:])
        for (k, m), rs in runs.items():
            last = rs[-1]
            tps = statistics.median(r.generation_tps for r in rs[1:])
            passes = last.generation_tokens - last.accepted_tokens
            rows.append(
                (
                    pname, m, k, f"{b:.1f}", f"{tps:.1f}", f"**{tps / b:.2f}x**",
                    f"{last.accepted_tokens / max(1, last.draft_tokens):.0%}",
                    f"{last.generation_tokens / max(1, passes):.2f}",
                )
            )  # fmt: skip
        print(f"{name}: {pname} done", flush=True)
    return rows


def lookup_rows(model, tok, name: str, args) -> list[tuple]:
    from bitnetlm.bench import bench_speculative
    from bitnetlm.engine.speculative import SpeculativeConfig

    rows = []
    for pname, text in prompts().items():
        for k in args.draft_max:
            spec = SpeculativeConfig(num_tokens=k, lookup=args.lookup)
            base, sp = bench_speculative(model, tok, text, args.tokens, spec, args.reps, name, args.threads)
            rows.append(
                (
                    name, pname, k, f"{base['tokens_per_s']:.1f}", f"{sp['tokens_per_s']:.1f}",
                    f"**{sp['speedup']:.2f}x**", f"{sp['acceptance']:.0%}", f"{sp['tokens_per_pass']:.2f}",
                    "yes" if sp["same_output"] else "NO",
                )
            )  # fmt: skip
        print(f"{name}: {pname} done", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=str_list, default=["bitnet-tiny", "smollm2-135m-1.58"])
    p.add_argument("--draft-max", type=int_list, default=[4, 8], help="k values (default: 4,8)")
    p.add_argument("--lookup", type=int, default=4, help="longest n-gram (default: 4)")
    p.add_argument(
        "--draft-model",
        default=None,
        help="a draft model (zoo name or directory): compare lookup, it, and both (one model in --models)",
    )
    p.add_argument("--tokens", type=int, default=96, help="tokens generated per run (default: 96)")
    p.add_argument("--reps", type=int, default=3, help="timed runs per row, after one warm-up (default: 3)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads (default: 2)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = p.parse_args()
    common.use_checkout()
    import bitnetlm
    from bitnetlm.runtime.config import RuntimeConfig

    rt = RuntimeConfig(threads=args.threads, device=args.device)
    rows, costs = [], []
    draft = None if args.draft_model is None else bitnetlm.load(args.draft_model, rt)[0]
    for name in args.models:
        model, tok = bitnetlm.load(name, rt)
        target = verify_cost(model, [1, 3, 4, 5, 7, 8], 2 * args.reps + 3)
        costs += [(name, *c) for c in target]
        if draft is None:
            rows += lookup_rows(model, tok, name, args)
            continue
        _, ms, _ = verify_cost(draft, [], 2 * args.reps + 3)[0]  # one draft step, in target decode steps
        costs.append((f"{args.draft_model} (draft)", 1, ms, ms / target[0][1]))
        rows += draft_rows(model, tok, draft, name, args.draft_max, args.tokens, args.reps, args.lookup)
    gpu = args.device.startswith("cuda")
    if draft is None:
        common.header(
            "Prompt lookup, single stream, greedy",
            gpu=gpu,
            details=f"{args.tokens} tokens, {args.threads} threads, lookup n {args.lookup}..1, adaptive draft "
            "length; t/s are the mean of the timed runs",
        )
        cols = ["model", "prompt", "k", "t/s off", "t/s lookup", "speedup", "acceptance", "tokens/pass"]
        print(common.table([*cols, "same output"], rows, [False, False] + [True] * 7))
    else:
        common.header(
            f"Prompt lookup, a draft model and both, single stream, greedy: {args.models[0]}",
            gpu=gpu,
            details=f"{args.tokens} tokens, {args.threads} threads, draft model {args.draft_model}, lookup n "
            f"{args.lookup}..1 (beside the draft model {args.lookup}..2), adaptive draft length; each repetition "
            "runs the baseline and every row in turn; t/s are medians of the timed repetitions; every output "
            "equals the baseline's (the benchmark stops otherwise)",
        )
        cols = ["prompt", "method", "k", "t/s off", "t/s", "speedup", "acceptance", "tokens/pass"]
        print(common.table(cols, rows, [False, False] + [True] * 6))
    common.header(
        "One verify pass of n tokens against one decode step", details="256 tokens in the cache; best of runs"
    )
    print(
        common.table(
            ["model", "tokens", "ms", "decode steps"],
            [(m, n, f"{ms:.2f}", f"{x:.2f}") for m, n, ms, x in costs],
        )
    )


if __name__ == "__main__":
    main()
