#!/usr/bin/env python3
"""bitnet-lm's C kernels against llama.cpp (its ternary TQ2_0 / TQ1_0 types) on the same GGUF files, same machine.

For each model shape and ternary type this writes one GGUF file of random ternary weights with our GGUF writer
(llama.cpp's `bitnet` architecture: the 1bitLLM layer, SiLU-gated MLP with sub-norms) and then measures pp128 and
tg64 at 2 threads with llama.cpp's `llama-bench` on that file and with our engine on the same file
(`bitnetlm.loading.load_model`, which repacks TQ2_0/TQ1_0 into our layout; timed by `bitnetlm.bench`, the code
of `bitnet bench`). The two alternate round by round (`--rounds`), so both see the same machine load.

Shapes (random weights; the real checkpoints are not reachable offline):
  2b4t:  BitNet b1.58 2B4T's matrices (hidden 2560, 30 layers, ffn 6912, 20 heads / 5 KV heads, vocab 128256,
         tied head), as our "1bitllm" arch: llama.cpp does not know 2B4T's GGUF arch (`bitnet-b1.58`), and the
         MLP activation (SiLU here, ReLU^2 in 2B4T) costs nothing measurable. Tokenizer: the real LLaMA-3 one.
  large: 1bitLLM bitnet_b1_58-large (hidden 1536, 24 layers, ffn 4096, 16 heads, vocab 32002). Tied: llama.cpp's
         `bitnet` graph has no output tensor (the LM head is always token_embd). Tokenizer: a SentencePiece-style
         byte-fallback vocabulary (<unk> <s> </s>, 256 byte tokens, "▁"), which our writer pads to the model's
         32002 ids with unused "[PADn]" entries: loadable by both, of the right size; llama-bench and ours feed
         random token ids, so no text is ever tokenized.
Heads: bf16 = the file's BF16 token_embd, read as BF16 by llama.cpp and as our bf16 head; int8 = the same file
with token_embd re-encoded as Q8_0 (llama.cpp: 8.5 bits, fp16 scale per 32 values; ours: the Q8_0 values
re-quantized at load to our int8 head, 8 bits + one float32 scale per row).

    scripts/build_llama_bench.sh                    # once: .assets/llama.cpp/bin/llama-bench
    python benchmarks/cpu_peer.py --shapes 2b4t,large --types tq2_0,tq1_0
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bitnetlm import bench  # noqa: E402
from bitnetlm.formats import gguf_codecs as codecs  # noqa: E402
from bitnetlm.formats.gguf import save_gguf  # noqa: E402
from bitnetlm.formats.gguf_file import TensorToWrite, read_gguf, write_gguf  # noqa: E402
from bitnetlm.kernels import cpu  # noqa: E402
from bitnetlm.loading import load_model  # noqa: E402

ASSETS = Path(os.environ.get("BITNETLM_ASSETS", ROOT / ".assets"))
DEFAULT_LLAMA_BENCH = ASSETS / "llama.cpp" / "bin" / "llama-bench"
DEFAULT_CACHE = ASSETS / "peer"
LLAMA3_VOCAB = 128256

# ModelConfig kwargs, all as our "1bitllm" arch (GGUF "bitnet", the one llama.cpp reads)
SHAPES = {
    "2b4t": dict(arch="1bitllm", hidden_act="silu"),  # ModelConfig defaults hold 2B4T's dimensions
    "large": dict(bench.SHAPES["large"], tie_word_embeddings=True),
}
HEADS = ("bf16", "int8")
# llama-bench's record fields kept in --json: its build, and the settings it ran with (its defaults)
LLAMA_INFO = (
    "build_commit",
    "build_number",
    "backends",
    "cpu_info",
    "n_batch",
    "n_ubatch",
    "type_k",
    "type_v",
    "flash_attn",
    "load_mode",
    "repack",
)


# ---- model files ----------------------------------------------------------------------------------
def byte_tokenizer_dir(dest: Path) -> Path:
    """A SentencePiece-style BPE tokenizer of 260 tokens (<unk> <s> </s>, 256 byte-fallback tokens, "▁"), no merges.

    For shapes whose vocabulary no real tokenizer here has: llama.cpp's SPM vocab needs the byte tokens
    (it looks up <0x0A> for the newline), and our writer pads the list to the model's vocab_size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    vocab["\u2581"] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tk.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    dest.mkdir(parents=True, exist_ok=True)
    tk.save(str(dest / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


def tokenizer_for(vocab_size: int, workdir: Path) -> Path:
    """The LLaMA-3 tokenizer for its own vocabulary size, else the byte-fallback one (padded by the writer)."""
    if vocab_size == LLAMA3_VOCAB:
        d = ASSETS / "llama3-tokenizer"
        if not (d / "tokenizer.json").is_file():
            raise SystemExit(
                f"LLaMA-3 tokenizer missing at {d}: run python scripts/fetch_assets.py llama3-tokenizer"
            )
        return d
    return byte_tokenizer_dir(workdir / "byte-tokenizer")


def q8_0_head_copy(src: Path, dst: Path) -> Path:
    """`src` with token_embd (the tied embedding + LM head) re-encoded as Q8_0; every other tensor copied raw."""
    from gguf import quants
    from gguf.constants import GGMLQuantizationType

    f = read_gguf(src)
    tensors = []
    for name, ti in f.tensors.items():
        if name == "token_embd.weight":
            data = quants.quantize(np.asarray(f.array(name), dtype=np.float32), GGMLQuantizationType.Q8_0)
            tensors.append(TensorToWrite(name, data, codecs.TYPE_Q8_0, ti.shape))  # [V, H / 32 * 34] bytes
        else:
            tensors.append(TensorToWrite(name, f.raw(name), ti.type_id, ti.shape))
    meta = {k: v for k, v in f.metadata.items() if k != "general.architecture"}
    write_gguf(dst, f.metadata["general.architecture"], meta, tensors, value_types=f.value_types)
    f.close()
    return dst


def write_shape_files(shape: str, types: list[str], heads: list[str], cache: Path) -> dict[tuple, Path]:
    """{(type, head): GGUF path} for one shape, all from one random model (files already in `cache` are reused).
    The int8 head's file is made from the bf16 one, so that one is written whichever heads are asked for."""
    files = {(t, h): cache / f"{shape}-{t}-{h}.gguf" for t in types for h in heads}
    bf16 = {t: cache / f"{shape}-{t}-bf16.gguf" for t in types}
    need = [t for t in types if not bf16[t].is_file() and any(not files[(t, h)].is_file() for h in heads)]
    if need:
        _write_bf16_files(shape, need, cache)
    for t in types:
        if "int8" in heads and not files[(t, "int8")].is_file():
            q8_0_head_copy(bf16[t], files[(t, "int8")])
    return files


def _write_bf16_files(shape: str, types: list[str], cache: Path) -> None:
    t0 = time.perf_counter()
    model = bench.random_model(SHAPES[shape], head_dtype=None)  # float embedding, BF16-exact values
    tok = tokenizer_for(model.config.vocab_size, cache)
    for t in types:
        path = cache / f"{shape}-{t}-bf16.gguf"
        save_gguf(model, path, t, tokenizer=tok, arch_name="bitnet")
        print(f"# wrote {path.name} ({path.stat().st_size / 1e9:.2f} GB)", file=sys.stderr)
    print(f"# {shape}: files written in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    del model
    gc.collect()


def head_type_in_file(path: Path) -> str:
    f = read_gguf(path)
    name = f.tensors["token_embd.weight"].type_name
    tied = "output.weight" not in f.tensors
    f.close()
    return name + (" tied" if tied else "")


# ---- the two engines ------------------------------------------------------------------------------
def run_llama_bench(exe: Path, path: Path, threads: int, pp: int, tg: int, reps: int) -> list[dict]:
    """llama-bench's JSON records (one per test: ppN, tgN) for one file."""
    cmd = [str(exe), "-m", str(path), "-t", str(threads), "-p", str(pp), "-n", str(tg), "-r", str(reps)]
    proc = subprocess.run(cmd + ["-o", "json"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def llama_speeds(records: list[dict]) -> dict[str, list[float]]:
    """{'pp128': [t/s per repetition], 'tg64': [...]} from llama-bench records."""
    out = {}
    for r in records:
        name = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
        out[name] = list(r["samples_ts"])
    return out


def our_speeds(model, threads: int, pp: int, tg: int, reps: int) -> dict[str, list[float]]:
    """The same tests through `bitnet bench`'s functions (C kernels on `threads`, torch's ops on 1 thread)."""
    rows = bench.bench(model, [pp], [tg], [threads], reps, "cpu")
    return {r["test"]: list(r["runs"]) for r in rows}


# ---- the comparison -------------------------------------------------------------------------------
def compare_file(exe: Path, path: Path, head: str, a, results: list[dict]) -> dict:
    """Alternate llama-bench and our engine on one file for `a.rounds` rounds; appends one row per test."""
    t0 = time.perf_counter()
    model = load_model(path, head_dtype=head)  # as `bitnet bench -m FILE --head-dtype HEAD` loads it
    load_s = time.perf_counter() - t0
    theirs: dict[str, list[float]] = {}
    ours: dict[str, list[float]] = {}
    info = {}
    for _ in range(a.rounds):
        records = run_llama_bench(exe, path, a.threads, a.pp, a.tg, a.reps)
        info = records[0]
        for k, v in llama_speeds(records).items():
            theirs.setdefault(k, []).extend(v)
        for k, v in our_speeds(model, a.threads, a.pp, a.tg, a.reps).items():
            ours.setdefault(k, []).extend(v)
    our_head = bench._head_name(model)
    del model
    gc.collect()
    for test in (f"pp{a.pp}", f"tg{a.tg}"):
        results.append(
            dict(
                file=path.name,
                head=head,
                head_llama_cpp=head_type_in_file(path),
                head_ours=our_head,
                test=test,
                llama_cpp=theirs[test],
                ours=ours[test],
                our_load_s=load_s,
                llama_cpp_model_type=info.get("model_type"),
                llama_cpp_model_size=info.get("model_size"),
            )
        )
    return info


def run_all(a, exe: Path, cache: Path) -> tuple[list[dict], dict]:
    results: list[dict] = []
    info: dict = {}
    for shape in a.shapes:
        files = write_shape_files(shape, a.types, a.heads, cache)
        for t in a.types:
            for h in a.heads:
                n = len(results)
                info = compare_file(exe, files[(t, h)], h, a, results) or info
                for r in results[n:]:
                    r.update(shape=shape, type=t)
                    print(f"# {_row_text(r)}", file=sys.stderr)
                if not a.keep:
                    files[(t, h)].unlink(missing_ok=True)
    return results, info


# ---- output ---------------------------------------------------------------------------------------
def _mean_std(v: list[float]) -> tuple[float, float]:
    return statistics.mean(v), (statistics.stdev(v) if len(v) > 1 else 0.0)


def _row_text(r: dict) -> str:
    m1, s1 = _mean_std(r["llama_cpp"])
    m2, s2 = _mean_std(r["ours"])
    head = f"{r['head_llama_cpp']} / {r['head_ours']}"
    return (
        f"| {r['shape']} | {r['type'].upper()} | {head} | {r['test']} | {m1:.2f} ± {s1:.2f} | "
        f"{m2:.2f} ± {s2:.2f} | {m2 / m1:.2f}x |"
    )


def machine_line(info: dict, loadavg: tuple) -> str:
    la = ", ".join(f"{x:.2f}" for x in loadavg)
    return (
        f"machine: {bench.machine_name()}; bitnet-lm kernels: cpu-{cpu.get_isa()}; llama.cpp: "
        f"build {info.get('build_commit')} ({info.get('build_number')}), backends {info.get('backends')}, "
        f"cpu_info {info.get('cpu_info')!r}; load average at start: {la}"
    )


def markdown(results: list[dict], a) -> str:
    out = [
        f"{a.threads} threads; t/s: mean ± std of {a.rounds} rounds x {a.reps} repetitions; ratio: "
        "bitnet-lm / llama.cpp; head: token_embd type in the file (llama.cpp reads it) / our head dtype",
        "",
        "| shape | type | head (llama.cpp / bitnet-lm) | test | llama.cpp t/s | bitnet-lm t/s | ratio |",
        "| --- | --- | --- | --- | ---: | ---: | ---: |",
    ]
    out += [_row_text(r) for r in results]
    return "\n".join(out)


def _csv(s: str) -> list[str]:
    return [v.strip() for v in s.split(",") if v.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=_csv, default=["2b4t", "large"], help="2b4t,large (default: both)")
    ap.add_argument("--types", type=_csv, default=["tq2_0", "tq1_0"], help="tq2_0,tq1_0 (default: both)")
    ap.add_argument("--heads", type=_csv, default=list(HEADS), help="bf16,int8 (default: both)")
    ap.add_argument("--llama-bench", type=Path, default=DEFAULT_LLAMA_BENCH, help="llama-bench binary")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-p", "--pp", type=int, default=128, help="prompt length (default 128)")
    ap.add_argument("-n", "--tg", type=int, default=64, help="tokens generated (default 64)")
    ap.add_argument("-r", "--reps", type=int, default=3, help="repetitions per round and engine (default 3)")
    ap.add_argument("--rounds", type=int, default=2, help="alternations llama.cpp/ours per file (default 2)")
    ap.add_argument("--keep", action="store_true", help="keep the GGUF files (in --cache-dir) for later runs")
    ap.add_argument(
        "--cache-dir", type=Path, default=DEFAULT_CACHE, help="where --keep stores the GGUF files"
    )
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    for name, have, known in (("shape", a.shapes, SHAPES), ("type", a.types, codecs.TERNARY_TYPES)):
        bad = [v for v in have if v not in known or v == "i2_s"]
        if bad:
            ap.error(f"unknown {name}(s) {bad}; choose from {[k for k in known if k != 'i2_s']}")
    if any(h not in HEADS for h in a.heads):
        ap.error(f"--heads: choose from {HEADS}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    exe = a.llama_bench.resolve()
    if not (exe.is_file() and os.access(exe, os.X_OK)):
        raise SystemExit(
            f"llama-bench not found at {exe}: run scripts/build_llama_bench.sh (or pass --llama-bench)"
        )
    loadavg_start = os.getloadavg()
    if a.keep:
        a.cache_dir.mkdir(parents=True, exist_ok=True)
        results, info = run_all(a, exe, a.cache_dir)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="bitnetlm-peer-"))
        try:
            results, info = run_all(a, exe, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    out = dict(
        machine=bench.machine_name(),
        isa=cpu.get_isa(),
        llama_cpp={k: info.get(k) for k in LLAMA_INFO},
        loadavg_start=loadavg_start,
        loadavg_end=os.getloadavg(),
        threads=a.threads,
        torch=torch.__version__,
        rows=results,
    )
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    print(machine_line(info, loadavg_start) + "\n")
    print(markdown(results, a))
    print(f"\nload average at end: {', '.join(f'{x:.2f}' for x in out['loadavg_end'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
