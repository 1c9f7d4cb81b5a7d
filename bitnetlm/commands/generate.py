"""bitnet generate -m MODEL [-p] PROMPT [-n N] [--temp T] ...: complete a prompt (library: generate_text)."""

from __future__ import annotations

import argparse
import json
import sys

# llama.cpp's defaults for the sampling flags
DEFAULTS = dict(max_tokens=256, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.0)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by generate and chat: model, device and sampling."""
    p.add_argument("-m", "--model", help="model directory, .gguf file or zoo name")
    p.add_argument(
        "-n",
        "--max-tokens",
        "--n-predict",
        "--max-new-tokens",
        dest="max_tokens",
        type=int,
        default=DEFAULTS["max_tokens"],
        help="maximum tokens to generate (default: %(default)s)",
    )
    p.add_argument(
        "--temp",
        "--temperature",
        dest="temperature",
        type=float,
        default=DEFAULTS["temperature"],
        help="sampling temperature, 0 = greedy (default: %(default)s)",
    )
    p.add_argument(
        "--top-k", type=int, default=DEFAULTS["top_k"], help="top-k sampling, 0 = off (default: %(default)s)"
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=DEFAULTS["top_p"],
        help="nucleus sampling, 1.0 = off (default: %(default)s)",
    )
    p.add_argument(
        "--min-p",
        type=float,
        default=DEFAULTS["min_p"],
        help="min-p sampling, 0.0 = off (default: %(default)s)",
    )
    p.add_argument(
        "--repeat-penalty",
        "--repetition-penalty",
        dest="repetition_penalty",
        type=float,
        default=DEFAULTS["repetition_penalty"],
        help="repetition penalty, 1.0 = off (default: %(default)s)",
    )
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI presence penalty (default: 0)")
    p.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="OpenAI frequency penalty (default: 0)"
    )
    p.add_argument("-s", "--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="STRING",
        help="stop when this string is generated (not printed); repeatable",
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--system", "-sys", default=None, help="system prompt (uses the chat template)")
    p.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=None,
        help="context length in tokens (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "-t",
        "--threads",
        type=int,
        default=None,
        help="CPU threads for the kernels (default: physical cores)",
    )
    p.add_argument(
        "--head-dtype",
        default=None,
        choices=["bf16", "int8"],
        help="store the embedding/LM head in bf16 or int8 (per-row scaled) for faster decode (CPU); on CUDA, int8 "
        "runs the CUDA-graph engine's int8 LM head",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: %(default)s)")
    p.add_argument(
        "--backend", default=None, help="kernel backend: reference, cpu, triton (default: best available)"
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="activation dtype (default: float32 on CPU, bfloat16 on CUDA)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run the model's own forward per token instead of the CUDA-graph decode engine",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "bf16", "fp8"],
        help="KV-cache elements: auto (the activation dtype), bf16 (CPU: half a float32 cache) or fp8 (CUDA: e4m3, "
        "unscaled; half a bf16 cache's memory and decode-attention reads) (default: %(default)s)",
    )
    p.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="print prompt/generation tokens/s and time to first token on stderr",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt_pos", nargs="?", metavar="PROMPT", help="the prompt (or use -p / -f)")
    p.add_argument("-p", "--prompt", default=None, help="the prompt")
    p.add_argument("-f", "--file", default=None, help="read the prompt from a file ('-' = stdin)")
    add_model_arguments(p)
    p.add_argument(
        "--chat",
        action="store_true",
        help="format the prompt as one user message with the chat template (implied by --system)",
    )


def resolve_model_name(name: str | None) -> str:
    """The -m value, or the zoo's default model when the zoo offers one."""
    if name:
        return name
    try:
        from bitnetlm import zoo
    except ImportError:
        zoo = None
    default = None
    if zoo is not None:
        default = getattr(zoo, "DEFAULT_MODEL", None)
        if default is None and callable(getattr(zoo, "default_model", None)):
            default = zoo.default_model()
    if default:
        return str(default)
    raise ValueError("no model given: pass -m/--model PATH (a model directory, .gguf file or zoo name)")


def resolve_device(device: str | None) -> str:
    if device in (None, "auto"):
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_model_and_tokenizer(
    model: str | None,
    device="auto",
    backend=None,
    dtype=None,
    threads=None,
    head_dtype=None,
    kv_cache_dtype: str | None = None,
):
    """(model, tokenizer) for the CLI: zoo default if `model` is None, threads set, KV-cache dtype (a
    --kv-cache-dtype value), clear error if no tokenizer."""
    import torch

    import bitnetlm
    from bitnetlm.kernels import configure_threads
    from bitnetlm.models.cache import parse_kv_cache_dtype

    name = resolve_model_name(model)
    device = resolve_device(device)
    if dtype is None and device.startswith("cuda"):
        dtype = "bfloat16"  # as vLLM and transformers serve BitNet on GPUs; float32 doubles the head's reads
    dt = getattr(torch, dtype) if dtype else None
    m, tok = bitnetlm.load(name, device=device, dtype=dt, backend=backend, head_dtype=head_dtype)
    configure_threads(m, threads)
    m.kv_cache_dtype = parse_kv_cache_dtype(kv_cache_dtype)
    if tok is None:
        raise FileNotFoundError(f"{name}: the model has no tokenizer (tokenizer.json next to config.json)")
    return m.eval(), tok


def sampling_params(args):
    from bitnetlm.generate import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=list(args.stop or []),
        ignore_eos=args.ignore_eos,
    )


def generate_text(
    model,
    tokenizer,
    prompt,
    params=None,
    *,
    system: str | None = None,
    chat: bool = False,
    ctx_size: int | None = None,
    stream=None,
    verbose: bool = False,
    err=None,
    enforce_eager: bool = False,
    **kwargs,
):
    """Generate for `prompt`, writing text to `stream` as it arrives (None: silent); returns GenerationResult."""
    import time

    from bitnetlm.generate import format_stats, make_params, prompt_to_ids
    from bitnetlm.generate.generate import _engine, _result

    t0 = time.perf_counter()
    p = make_params(params, **kwargs)
    ids = prompt_to_ids(tokenizer, prompt, system=system, chat=chat)
    chunks = []
    for c in _engine(model, tokenizer, [ids], [p], ctx_size=ctx_size, enforce_eager=enforce_eager):
        chunks.append(c)
        if stream is not None and c.text:
            stream.write(c.text)
            stream.flush()
    res = _result(chunks, len(ids), t0)
    if verbose:
        print(format_stats(res), file=err or sys.stderr)
    return res


def _read_prompt(args) -> str:
    given = [x for x in (args.prompt, args.prompt_pos) if x is not None]
    if args.file:
        if args.file == "-":
            given.append(sys.stdin.read())
        else:
            with open(args.file, encoding="utf-8") as f:
                given.append(f.read())
    if not given:
        raise ValueError("no prompt: pass it as an argument, with -p/--prompt, or -f FILE")
    if len(given) > 1:
        raise ValueError("give the prompt once: positional PROMPT, -p/--prompt or -f/--file")
    return given[0]


def run(args) -> int:
    prompt = _read_prompt(args)
    model, tok = load_model_and_tokenizer(
        args.model, args.device, args.backend, args.dtype, args.threads, args.head_dtype, args.kv_cache_dtype
    )
    res = generate_text(
        model,
        tok,
        prompt,
        sampling_params(args),
        system=args.system,
        chat=args.chat,
        ctx_size=args.ctx_size,
        stream=None if args.json else sys.stdout,
        verbose=args.verbose,
        enforce_eager=args.enforce_eager,
    )
    if args.json:
        out = {
            "model": resolve_model_name(args.model),
            "prompt": prompt,
            "text": str(res),
            "tokens": res.tokens,
            "finish_reason": res.finish_reason,
            "prompt_tokens": res.prompt_tokens,
            "generation_tokens": res.generation_tokens,
            "prompt_tps": res.prompt_tps,
            "generation_tps": res.generation_tps,
            "ttft_s": res.ttft_s,
            "total_s": res.total_s,
        }
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
    return 0


def main(argv=None) -> int:
    from bitnetlm.cli import main as cli_main

    return cli_main(["generate", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
