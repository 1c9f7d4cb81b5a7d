"""bitnet generate -m MODEL [-p] PROMPT [-n N] [--temp T] ...: complete a prompt (library: generate_text)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys

from bitnetlm import progress
from bitnetlm.generate.args import add_context_arguments, add_speculative_arguments, speculative_from_args
from bitnetlm.parallel.group import add_tp_argument
from bitnetlm.runtime.args import OFFLINE, add_runtime_arguments, runtime_from_args

# llama.cpp's defaults for the sampling flags
DEFAULTS = dict(max_tokens=256, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.0)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by generate and chat: model, sampling and the runtime group."""
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
    add_runtime_arguments(p, OFFLINE)
    add_speculative_arguments(p)
    add_context_arguments(p)
    p.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="print prompt/generation tokens/s and time to first token on stderr",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")
    progress.add_argument(p)  # loading: a full-precision GGUF's dequantization, a zoo model's first use


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
    add_tp_argument(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--json-schema", metavar="FILE", help="the output is JSON valid under this JSON schema file"
    )
    g.add_argument("--regex", metavar="PATTERN", help="the output matches this regular expression")
    g.add_argument("--grammar", metavar="FILE", help="the output follows this grammar file (Lark or GBNF)")


def structured_from_args(args):
    """The StructuredOutput that --json-schema / --regex / --grammar ask for, or None."""
    from bitnetlm.sampling.structured import StructuredOutput

    if getattr(args, "regex", None):
        return StructuredOutput(regex=args.regex)
    for flag, path in (("--json-schema", getattr(args, "json_schema", None)), ("--grammar", args.grammar)):
        if path:
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except OSError as e:
                raise FileNotFoundError(f"{flag} {path}: cannot be read ({e.strerror})") from None
            if flag == "--grammar":
                return StructuredOutput(grammar=text)
            try:
                schema = json.loads(text)
            except ValueError as e:
                raise ValueError(f"{flag} {path}: not valid JSON ({e})") from None
            if not isinstance(schema, dict):
                raise ValueError(
                    f"{flag} {path}: expected a JSON schema object, found {type(schema).__name__}"
                )
            return StructuredOutput(json=schema)
    return None


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
    runtime=None,
    **kwargs,
):
    """Generate for `prompt`, writing text to `stream` as it arrives and a newline at the end (None: silent);
    verbose: then the statistics on `err` (stderr), on a line of their own. kwargs: stream_generate's (sampling
    fields, speculative, context_shift, n_keep). Returns the GenerationResult."""
    import time

    from bitnetlm.generate import format_stats, prompt_to_ids, stream_generate
    from bitnetlm.generate.generate import _result

    t0 = time.perf_counter()
    with chat_template_errors(tokenizer):
        ids = prompt_to_ids(tokenizer, prompt, system=system, chat=chat)
    chunks = []
    for c in stream_generate(model, tokenizer, ids, params, ctx_size=ctx_size, runtime=runtime, **kwargs):
        chunks.append(c)
        if stream is not None and c.text:
            stream.write(c.text)
            stream.flush()
    res = _result(chunks, len(ids), t0)
    if stream is not None:
        stream.write("\n")  # ends the text's line before anything else reaches the terminal
        stream.flush()
    if verbose:
        print(format_stats(res), file=err or sys.stderr)
    return res


@contextlib.contextmanager
def chat_template_errors(tokenizer):
    """Inside: an error the chat template raises (jinja2's: a sandbox SecurityError, a syntax error, the
    template's own raise_exception) is a ValueError naming the tokenizer it came from."""
    try:
        yield
    except Exception as e:
        if type(e).__module__.split(".")[0] != "jinja2":
            raise
        where = getattr(tokenizer, "source", None) or "the tokenizer"
        raise ValueError(f"{where}: the chat template failed: {type(e).__name__}: {e}") from None


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
    from bitnetlm.parallel import tensor_parallel
    from bitnetlm.runtime.tp import lead

    prompt = _read_prompt(args)
    runtime = runtime_from_args(args, OFFLINE)
    spec = speculative_from_args(args)
    with tensor_parallel(args.tp, runtime.torch_device) as tp:
        if tp is not None:
            runtime = runtime.replace(device=str(tp.device))
        with progress.disabled(tp is not None and not tp.lead):  # only rank 0 speaks
            model, tok = load_for_generation_sharded(args.model, runtime, tp)
        return lead(model, runtime, lambda: _generate(args, prompt, model, tok, runtime, spec)) or 0


def load_for_generation_sharded(name, runtime, tp):
    """`loading.load_for_generation`, then this rank's shard of the model when `tp` is a group."""
    from bitnetlm.loading import load_for_generation
    from bitnetlm.parallel import shard_

    model, tok = load_for_generation(name, runtime)
    if tp is not None:
        shard_(model, tp)
    return model, tok


def _generate(args, prompt, model, tok, runtime, spec) -> int:
    from bitnetlm.loading import default_model_name, load_speculative

    params = dataclasses.replace(sampling_params(args), structured=structured_from_args(args))
    res = generate_text(
        model,
        tok,
        prompt,
        params,
        system=args.system,
        chat=args.chat,
        ctx_size=runtime.max_seq_len,
        stream=None if args.json else sys.stdout,
        verbose=args.verbose,
        runtime=runtime,
        speculative=load_speculative(spec, runtime, tok),
        context_shift=args.context_shift,
        n_keep=args.n_keep,
    )
    if args.json:
        out = {
            "model": default_model_name(args.model),
            "prompt": prompt,
            "text": str(res),
            "tokens": res.tokens,
            "finish_reason": res.finish_reason,
            "finish_detail": res.finish_detail,
            "prompt_tokens": res.prompt_tokens,
            "generation_tokens": res.generation_tokens,
            "prompt_tps": res.prompt_tps,
            "generation_tps": res.generation_tps,
            "ttft_s": res.ttft_s,
            "total_s": res.total_s,
        }
        if res.draft_tokens:
            out.update(draft_tokens=res.draft_tokens, accepted_tokens=res.accepted_tokens)
        print(json.dumps(out, ensure_ascii=False))
    return 0


def main(argv=None) -> int:
    from bitnetlm.cli import main as cli_main

    return cli_main(["generate", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
