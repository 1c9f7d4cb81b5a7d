"""The perplexity cost of bitnet-lm's storage options on a real pretrained model and real held-out text, and how far
the float32 reference agrees with itself on the zoo's models. Runs on the CPU; one markdown table each.

    python benchmarks/quality.py                                       # every table
    python benchmarks/quality.py --tables cpu-head --tokens 1024 --ctx 1024
    python benchmarks/quality.py --tables gpu-head [--tokens 1024] [--narrow-heads 4:32,5:32,6:32]
    python benchmarks/quality.py --tables kv
    python benchmarks/quality.py --tables zoo [--zoo-tokens 64]

No pretrained BitNet is reachable offline, so the storage tables use the real SmolLM2-135M-Instruct (LLaMA
architecture, tied 49152 x 576 embedding; --model, the GGUF that scripts/fetch_assets.py fetches) on held-out
text: the last --tokens tokens of each of Jane Austen's six novels (--texts). Only the option measured changes
between the rows of a table.

- cpu-head: the CPU's compact embedding + LM head, `bitnetlm.load(..., head_dtype="bf16" | "int8")` (int8: one
  scale a row), against the model's float32 one; scored by the library's `perplexity` (what `bitnet eval` runs:
  windows of --ctx tokens every --ctx/2 tokens, each novel alone).
- gpu-head: the CUDA engine's int8 embedding + LM head with its roundings, applied on the CPU: q = round(w / s),
  s = max|w_row| / 127 (`bitnetlm.runtime.cuda.weights.int8_rows`); the final norm's output rounded to bf16 as the
  engine's activations are; then the logits from those bf16 values or from the int16 codes of them that the
  engine's head multiplies (c = round(h * 32639 / max|h|) a row). Windows of --ctx tokens over the novels joined.
  --narrow-heads adds LM heads of fewer bits (not engine options).
- kv: the KV cache's element type: each window runs the model's own forward through a KV cache stored in float32
  (the model's), bfloat16 or float8 e4m3 (unscaled, `--kv-cache-dtype fp8`: the rounding the CUDA engine's cache
  applies; its kernels store the same bytes, tests/test_kv_fp8.py). Windows as gpu-head's.
- zoo: the bound tests/test_gpu_zoo.py sets its teacher-forced checks by. For each zoo model and each of that
  test's prompts, the reference backend (float32) decodes --zoo-tokens greedy tokens through its KV cache; its
  own uncached forward over prompt + those tokens then ranks each token (0 = its argmax), and the gap between its
  top two logits is taken at every position. smollm2-135m-1.58 runs with a seeded random embedding
  (tests/zoo_parts.py), as the test does.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

import common
import torch

TABLES = ("cpu-head", "gpu-head", "kv", "zoo")


# ---- shared ---------------------------------------------------------------------------------------------------
def load_model(path: str, **options):
    """(model, tokenizer) on the CPU, in eval mode."""
    import bitnetlm

    model, tok = bitnetlm.load(path, device="cpu", **options)
    return model.eval(), tok


def windows_ppl(model, ids, ctx: int, kv_dtype=None) -> float:
    """Perplexity over consecutive windows of `ctx` tokens; kv_dtype: through a KV cache of that type (each query
    attends over the keys and values as the cache stores them) instead of no cache."""
    nll, n = 0.0, 0
    with torch.inference_mode():
        for i in range(0, ids.numel() - 1, ctx):
            x = ids[i : i + ctx + 1]
            if x.numel() < 2:
                break
            kw = {}
            if kv_dtype is not None:
                kw = dict(
                    positions=torch.arange(x.numel() - 1)[None],
                    cache=model.new_cache(1, x.numel(), dtype=kv_dtype),
                )
            logits = model(x[None, :-1], **kw)[0].float()
            nll += torch.nn.functional.cross_entropy(logits, x[1:], reduction="sum").item()
            n += x.numel() - 1
    return math.exp(nll / n)


def ppl_table(rows: list[tuple[str, float]], what: str) -> str:
    """Rows [(name, perplexity)], each against the first."""
    base = rows[0][1]
    return common.table(
        [what, "perplexity", f"vs {rows[0][0]}"],
        [(n, f"{v:.3f}", f"{100 * (v / base - 1):+.2f}%") for n, v in rows],
    )


def joined_heldout(args, tok) -> torch.Tensor:
    return torch.tensor([t for seq in common.heldout(tok, args.texts, args.tokens) for t in seq])


def text_details(args, n_tokens: int, how: str) -> str:
    return (
        f"model {os.path.basename(args.model)} (real pretrained weights); the last {args.tokens} tokens of each "
        f"novel in {args.texts} ({n_tokens} tokens); {how}"
    )


# ---- cpu-head --------------------------------------------------------------------------------------------------
def cpu_head_table(args) -> None:
    from bitnetlm.train.eval import perplexity

    rows, n_tokens = [], 0
    for head in (None, "bf16", "int8"):
        model, tok = load_model(args.model, head_dtype=head)
        nbytes = model.lm_head.nbytes() if head else model.lm_head_weight().numel() * 4
        t0, nll, n_tokens = time.perf_counter(), 0.0, 0
        for seq in common.heldout(tok, args.texts, args.tokens):
            r = perplexity(model, seq, ctx=args.ctx, stride=args.ctx // 2, progress=False)
            nll, n_tokens = nll + r["nll"] * r["tokens"], n_tokens + r["tokens"]
        nll /= n_tokens
        name = head or "float32 (the model's)"
        rows.append([name, f"{nbytes / 1e6:.1f}", f"{math.exp(nll):.3f}", f"{nll:.5f}", nll])
        rows[-1] += [f"{time.perf_counter() - t0:.0f}"]
        del model
    base = rows[0][4]
    for r in rows:
        r[4] = f"{r[4] - base:+.5f}"
    common.header(
        "int8 embedding and LM head on the CPU (`--head-dtype`)",
        details=text_details(
            args, n_tokens, f"the library's perplexity, windows of {args.ctx} every {args.ctx // 2}"
        ),
    )
    cols = ["embedding + LM head", "MB", "perplexity", "nll (nats/token)", "nll vs float32", "seconds"]
    print(common.table(cols, rows), flush=True)


# ---- gpu-head --------------------------------------------------------------------------------------------------
def codes16(h):
    """The values the engine's int16-code head multiplies: c / a with a = rcp(max|h|) * 32639, c = round(h * a)
    (half to even), per row."""
    a = (1.0 / h.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)) * 32639.0
    return torch.round(h * a).clamp(-32639, 32639) / a


def narrow_groups(w, bits: int, g: int):
    """w [N, K] through BITS-bit integers and back: q = round(w / s) in [-L, L], L = 2^(BITS-1) - 1, s = max|w| / L
    over each G weights of a row."""
    lim = float(2 ** (bits - 1) - 1)
    wg = w.float().reshape(w.shape[0], -1, g)  # [N, K/G, G]
    s = wg.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / lim
    return (torch.round(wg / s).clamp(-lim, lim) * s).reshape(w.shape)


def set_storage(model, originals, weights: str) -> None:
    """The embedding (and an untied head) as the engine stores them: bf16, or int8 rows scaled back."""
    from bitnetlm.runtime.cuda.weights import int8_rows

    params = [model.embed_tokens.weight] + ([] if model.lm_head is None else [model.lm_head.weight])
    for p, w in zip(params, originals, strict=True):
        if weights == "bf16":
            p.data.copy_(w.bfloat16().float())
        else:
            q, s = int8_rows(w)
            p.data.copy_(q.float() * s[:, None])


class _Head(torch.nn.Module):
    """An LM head over a weight of its own (the narrow heads)."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = w

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(h, self.w)


def gpu_head_rows(model, ids, args) -> list[tuple[str, float]]:
    originals = [model.embed_tokens.weight.data.clone()]
    originals += [] if model.lm_head is None else [model.lm_head.weight.data.clone()]
    norm, head = model.norm.forward, model.lm_head
    variants = (
        ("bf16", "bf16 head, bf16 activations (default)", None),
        ("int8", "int8, bf16 activations (w8_linear)", None),
        ("int8", "int8, int16 activation codes (w8a16_linear, the engine's)", codes16),
    )
    rows = []
    for weights, name, act in variants:
        set_storage(model, originals, weights)

        def final_norm(x, act=act):
            h = norm(x).bfloat16().float()  # the engine's activations
            return h if act is None else act(h)

        model.norm.forward = final_norm
        rows.append((name, windows_ppl(model, ids, args.ctx)))
    for (
        bits,
        g,
    ) in args.narrow_heads:  # the embedding stays int8, the activations int16 codes (the last variant)
        model.lm_head = _Head(narrow_groups(originals[-1], bits, g))
        name = f"int{bits} LM head, groups of {g}; int8 embedding; int16 activation codes"
        rows.append((name, windows_ppl(model, ids, args.ctx)))
    model.norm.forward, model.lm_head = norm, head
    return rows


def gpu_head_table(args) -> None:
    model, tok = load_model(args.model)
    ids = joined_heldout(args, tok)
    rows = gpu_head_rows(model, ids, args)
    common.header(
        "The CUDA engine's int8 embedding and LM head (`--head-dtype int8`), its roundings on the CPU",
        details=text_details(args, ids.numel(), f"windows of {args.ctx}, float32 elsewhere"),
    )
    print(ppl_table(rows, "embedding + LM head"), flush=True)


# ---- kv ------------------------------------------------------------------------------------------------------
def kv_table(args) -> None:
    model, tok = load_model(args.model)
    ids = joined_heldout(args, tok)
    kinds = (
        ("float32 (auto)", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("fp8 (e4m3)", torch.float8_e4m3fn),
    )
    rows = [(name, windows_ppl(model, ids, args.ctx, kv_dtype=dt)) for name, dt in kinds]
    common.header(
        "float8 KV cache (`--kv-cache-dtype fp8`)",
        details=text_details(
            args, ids.numel(), f"windows of {args.ctx} through a KV cache, float32 activations"
        ),
    )
    print(ppl_table(rows, "KV cache"), flush=True)


# ---- zoo -------------------------------------------------------------------------------------------------------
def zoo_rows(name: str, path: str, tokens: int) -> list[list]:
    from oracle import greedy_with_cache
    from zoo_parts import TEXTS, teacher_forced

    from bitnetlm.loading import load_model as load_reference
    from bitnetlm.text.tokenizer import Tokenizer

    model = load_reference(path, device="cpu", backend="reference").eval()
    tok = Tokenizer.from_dir(path)
    rows = []
    for i, text in enumerate(TEXTS):
        p = tok.encode(text)
        got = greedy_with_cache(model, torch.tensor([p]), tokens)[0]
        logits, rank = teacher_forced(model, p, got)  # [N, V], [N]
        top2 = logits.topk(2, dim=1).values
        gap = top2[:, 0] - top2[:, 1]
        rows.append([name, i, int(rank.max()), f"{int((rank == 0).sum())} of {len(rank)}"])
        rows[-1] += [f"{gap.min():.4f}", f"{gap.median():.4f}"]
    return rows


def zoo_table(args) -> None:
    sys.path.insert(0, str(common.ROOT / "tests"))
    from zoo_parts import smollm2_random_embedding

    from bitnetlm import zoo

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows += zoo_rows("bitnet-tiny", zoo.resolve("bitnet-tiny"), args.zoo_tokens)
        smollm2 = str(smollm2_random_embedding(tmp))
        rows += zoo_rows("smollm2-135m-1.58 (random embedding)", smollm2, args.zoo_tokens)
    common.header(
        "The float32 CPU reference against itself on the zoo's models",
        details=f"reference backend, {args.zoo_tokens} greedy tokens a prompt (cached decode), ranked by the "
        "uncached forward",
    )
    cols = ["model", "prompt", "worst rank", "ranked first", "smallest top-2 gap", "median top-2 gap"]
    print(common.table(cols, rows), flush=True)


# ---- command line -------------------------------------------------------------------------------------------
def narrow(text: str) -> list[tuple[int, int]]:
    """--narrow-heads "4:32,5:32" -> [(4, 32), (5, 32)] (argparse type)."""
    try:
        return [tuple(int(v) for v in item.split(":")) for item in common.str_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected BITS:GROUP pairs, e.g. 4:32,6:32") from None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--tables", type=common.str_list, default=list(TABLES), help=f"of {', '.join(TABLES)} (default: all)"
    )
    ap.add_argument(
        "--model", default=str(common.ASSETS / "smollm2-gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    )
    ap.add_argument(
        "--texts", default=str(common.ASSETS / "austen"), help="held-out texts, one .txt file each"
    )
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens of each text (its last ones)")
    ap.add_argument("--ctx", type=int, default=512, help="tokens a window")
    ap.add_argument(
        "--narrow-heads", type=narrow, default=[], help="gpu-head: also BITS:GROUP heads, e.g. 4:32"
    )
    ap.add_argument("--zoo-tokens", type=int, default=64, help="zoo: greedy tokens a prompt")
    args = ap.parse_args(argv)
    if set(args.tables) - set(TABLES):
        ap.error(
            f"--tables: unknown {sorted(set(args.tables) - set(TABLES))}; choose from {', '.join(TABLES)}"
        )
    if any(len(p) != 2 or p[0] < 2 or p[1] < 1 for p in args.narrow_heads):
        ap.error(f"--narrow-heads: expected BITS:GROUP with BITS >= 2, found {args.narrow_heads}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    common.use_checkout()
    tables = {"cpu-head": cpu_head_table, "gpu-head": gpu_head_table, "kv": kv_table, "zoo": zoo_table}
    for name in args.tables:
        tables[name](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
