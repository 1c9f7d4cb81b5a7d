#!/usr/bin/env python3
"""Per-token cost of the two maintained grammar engines, llguidance and xgrammar, on a 128k-token vocabulary.

For each JSON schema: compile it (timed), then walk the tokens of a valid instance, computing the allowed-token
bitmask before each token and advancing the matcher on it (what constrained decoding does every step). Prints a
markdown table naming the machine and the date: compile time, the mean / worst mask time per token, and a whole
request's grammar time (compile + every mask).

With --models: the cost of enforcement in generation, greedy decode tokens/s of zoo models with and without a
json_schema (the engine's llguidance), the same number of tokens each way: medians of --repeats runs each, run
in pairs, and the median of the pairs' ratios as the overhead (robust to a shared machine's drift).

  python benchmarks/grammar_overhead.py                          # the LLaMA-3 tokenizer of .assets
  python benchmarks/grammar_overhead.py --tokenizer DIR --engines llguidance
  python benchmarks/grammar_overhead.py --models bitnet-tiny,smollm2-135m-1.58
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import date

import common

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCHEMAS = {
    "flat": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
        {"name": "Elizabeth Bennet", "age": 20},
    ),
    "enum+array": (
        {
            "type": "object",
            "properties": {
                "colour": {"enum": ["red", "green", "blue"]},
                "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
            },
            "required": ["colour", "tags"],
        },
        {"colour": "green", "tags": ["ternary", "weights", "fast"]},
    ),
    "nested+anyOf": (
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[a-z]{3}-[0-9]{4}$"},
                "owner": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "email": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                    },
                    "required": ["name", "email"],
                },
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"sku": {"type": "integer"}, "price": {"type": "number"}},
                        "required": ["sku", "price"],
                    },
                },
            },
            "required": ["id", "owner", "items"],
        },
        {
            "id": "abc-1234",
            "owner": {"name": "Fitzwilliam Darcy", "email": None},
            "items": [{"sku": 1, "price": 9.5}, {"sku": 22, "price": 100.25}, {"sku": 333, "price": 0.5}],
        },
    ),
}


def tokenizer_json(path: str) -> str:
    with open(os.path.join(path, "tokenizer.json"), encoding="utf-8") as f:
        return f.read()


def run_llguidance(tok_json: str, schema: dict, ids: list[int]) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.torch as llt

    tok = llguidance.LLTokenizer(tok_json)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    m = llguidance.LLMatcher(tok, grammar)
    compile_s = time.perf_counter() - t0
    mask = llt.allocate_token_bitmask(1, tok.vocab_size)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        llt.fill_next_token_bitmask(m, mask, 0)
        times.append(time.perf_counter() - t0)
        assert (int(mask[0, t // 32]) >> (t % 32)) & 1, f"llguidance: token {t} not allowed"
        assert m.consume_token(t), m.get_error()
    return compile_s, times


def run_xgrammar(tok_json: str, schema: dict, ids: list[int]) -> tuple[float, list[float]]:
    import tokenizers
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    backend = tokenizers.Tokenizer.from_str(tok_json)
    info = xgr.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=backend),
        vocab_size=backend.get_vocab_size(),
        stop_token_ids=[0],
    )
    t0 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(schema))
    m = xgr.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    times = []
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - t0)
        assert (int(mask[0, t // 32]) >> (t % 32)) & 1, f"xgrammar: token {t} not allowed"
        assert m.accept_token(t)
    return compile_s, times


ENGINES = {"llguidance": run_llguidance, "xgrammar": run_xgrammar}

# a long, bounded output: 12 records of a string, an integer and an enum
RECORDS = common.records_schema(12, 12)


def model_rows(names: list[str], threads: int | None, repeats: int) -> None:
    import bitnetlm
    from bitnetlm.generate import SamplingParams, generate

    print("| model | tokens | tok/s free | tok/s json_schema | overhead |")
    print("| --- | ---: | ---: | ---: | ---: |")
    prompt = "List twelve works of English literature as JSON records with name, year and kind."
    for name in names:
        model, tok = bitnetlm.load(name, threads=threads)
        on = SamplingParams(max_tokens=600, temperature=0, structured={"json": RECORDS})
        n = generate(
            model, tok, prompt, on
        ).generation_tokens  # (also warms the grammar's tokenizer, the runner)
        off = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        tps = {"on": [], "off": []}
        for i in range(
            repeats
        ):  # in pairs, the order alternating, so that a shared machine's drift hits both
            for k in ("off", "on") if i % 2 == 0 else ("on", "off"):
                tps[k].append(generate(model, tok, prompt, on if k == "on" else off).generation_tps)
        ratio = statistics.median(a / b for a, b in zip(tps["off"], tps["on"], strict=True))
        a, b = statistics.median(tps["off"]), statistics.median(tps["on"])
        print(f"| {name} | {n} | {a:.1f} | {b:.1f} | {(ratio - 1) * 100:+.1f}% |")


def _machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            name = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} cores"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=".assets/llama3-tokenizer", help="a directory with tokenizer.json")
    ap.add_argument("--engines", default="llguidance,xgrammar", help="comma-separated (llguidance,xgrammar)")
    ap.add_argument("--models", default=None, help="zoo models to generate with, comma-separated")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for --models")
    ap.add_argument("--repeats", type=int, default=3, help="run pairs per row for --models (median kept)")
    args = ap.parse_args(argv)
    import tokenizers

    if args.models:
        print(f"{_machine()}, {date.today()}")
        model_rows(args.models.split(","), args.threads, args.repeats)
        return
    tok_json = tokenizer_json(args.tokenizer)
    backend = tokenizers.Tokenizer.from_str(tok_json)
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {date.today()}, "
        f"vocabulary {backend.get_vocab_size()}"
    )
    print(
        "| engine | schema | tokens | compile ms | mask us/token (mean) | max | request ms (compile + masks) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.engines.split(","):
        flat, instance = SCHEMAS["flat"]
        ENGINES[name](
            tok_json, flat, backend.encode(json.dumps(instance), add_special_tokens=False).ids
        )  # warm
        for sname, (schema, instance) in SCHEMAS.items():
            ids = backend.encode(json.dumps(instance), add_special_tokens=False).ids
            compile_s, times = ENGINES[name](tok_json, schema, ids)
            us = [t * 1e6 for t in times]
            total = (compile_s + sum(times)) * 1e3
            print(
                f"| {name} | {sname} | {len(ids)} | {compile_s * 1e3:.1f} | {statistics.mean(us):.0f} | "
                f"{max(us):.0f} | {total:.1f} |"
            )


if __name__ == "__main__":
    main()
