"""bitnet chat -m MODEL: interactive chat with the model's chat template (library: chat_session).

Reads one user message per line from stdin (works from a pipe as well as a terminal). Commands:
/exit or /quit (or end of input) ends the chat, /reset forgets the conversation (keeps --system).
"""

from __future__ import annotations

import argparse
import json
import sys

from bitnetlm.commands.generate import (
    add_model_arguments,
    chat_template_errors,
    sampling_params,
    speculative_from_args,
)
from bitnetlm.generate.args import context_shift_from_args
from bitnetlm.runtime.args import OFFLINE, runtime_from_args

HELP = "commands: /exit (or /quit, end of input) ends, /reset forgets the conversation, /help shows this"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)


def _fit(tok, messages: list[dict], ctx: int, reserve: int) -> tuple[list[dict], list[int]]:
    """Drop the oldest turns (never the system prompt nor the last message) until the prompt fits."""
    msgs = list(messages)
    while True:
        with chat_template_errors(tok):
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if len(ids) + reserve <= ctx:
            return msgs, ids
        first = 1 if msgs and msgs[0].get("role") == "system" else 0
        if len(msgs) - first <= 1:
            if len(ids) < ctx:
                return msgs, ids  # fits with a shorter answer
            raise ValueError(f"this message needs {len(ids)} tokens but the context holds {ctx}")
        del msgs[first]


def _ask(err, prompt: str) -> None:
    """Show the input prompt (when reading from a terminal)."""
    if prompt:
        err.write(prompt)
        err.flush()


def _answer(model, tokenizer, ids: list[int], p, out, stream: bool, **engine_options):
    """Generate the answer to the prompt `ids`, its text streamed to `out` when `stream`; the result."""
    import time

    from bitnetlm.generate.generate import _engine, _result

    t0 = time.perf_counter()
    chunks = []
    for c in _engine(model, tokenizer, [ids], [p], **engine_options):
        chunks.append(c)
        if stream and c.text:
            out.write(c.text)
            out.flush()
    return _result(chunks, len(ids), t0)


def _end_turn(res, out, err, json_lines: bool, verbose: bool) -> None:
    """Close an answer on `out`: a newline after the streamed text, or the whole turn as one JSON line."""
    from bitnetlm.generate import format_stats

    if json_lines:
        rec = {
            "role": "assistant",
            "content": str(res),
            "finish_reason": res.finish_reason,
            "finish_detail": res.finish_detail,
            "prompt_tokens": res.prompt_tokens,
            "generation_tokens": res.generation_tokens,
            "generation_tps": res.generation_tps,
            "ttft_s": res.ttft_s,
        }
        out.write(json.dumps(rec, ensure_ascii=False) + "\n")
    else:
        out.write("\n")
    out.flush()
    if verbose:
        print(format_stats(res), file=err)


def chat_session(
    model,
    tokenizer,
    lines,
    params=None,
    *,
    system: str | None = None,
    ctx_size: int | None = None,
    out=None,
    err=None,
    verbose: bool = False,
    json_lines: bool = False,
    interactive: bool = False,
    runtime=None,
    speculative=None,
    context_shift=None,
) -> list[dict]:
    """Run a chat over the user messages in `lines` (an iterable of str); returns the conversation.

    Each answer is streamed to `out` (a JSON line per turn with json_lines=True); `speculative`: a
    SpeculativeConfig (drafts verified in one pass; same answers); `context_shift`: a ContextShift (an answer
    that reaches the end of the context window goes on past it).
    """
    from bitnetlm.generate import make_params
    from bitnetlm.generate.generate import context_length

    out = out or sys.stdout
    err = err or sys.stderr
    p = make_params(params)
    ctx = context_length(model, ctx_size)
    engine_options = dict(ctx_size=ctx, runtime=runtime, speculative=speculative, context_shift=context_shift)
    base = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    prompt = "> " if interactive else ""
    _ask(err, prompt)
    for raw in lines:
        line = raw.rstrip("\r\n")
        cmd = line.strip()
        if cmd in ("/exit", "/quit", "/bye"):
            break
        if cmd == "/reset":
            messages = list(base)
            print("(conversation reset)", file=err)
        elif cmd in ("/help", "/?"):
            print(HELP, file=err)
        elif cmd:
            user = {"role": "user", "content": line}
            try:
                fitted, ids = _fit(tokenizer, [*messages, user], ctx, reserve=min(p.max_tokens, ctx // 4))
            except ValueError as e:
                print(f"error: {e}", file=err)
            else:
                res = _answer(model, tokenizer, ids, p, out, not json_lines, **engine_options)
                messages = [*fitted, {"role": "assistant", "content": str(res)}]
                _end_turn(res, out, err, json_lines, verbose)
        _ask(err, prompt)
    return messages


def run(args) -> int:
    from bitnetlm.loading import load_for_generation, load_speculative

    runtime = runtime_from_args(args, OFFLINE)
    spec = speculative_from_args(args)
    model, tok = load_for_generation(args.model, runtime)
    if not tok.chat_template:
        raise ValueError(f"{args.model}: the tokenizer has no chat_template; use `bitnet generate` instead")
    system = [{"role": "system", "content": args.system}] if args.system else []
    with chat_template_errors(tok):  # a template that cannot render a first turn fails now, not at each turn
        tok.apply_chat_template([*system, {"role": "user", "content": "Hello"}], add_generation_prompt=True)
    interactive = sys.stdin.isatty()
    if interactive:
        print(HELP, file=sys.stderr)
    chat_session(
        model,
        tok,
        sys.stdin,
        sampling_params(args),
        system=args.system,
        ctx_size=runtime.max_seq_len,
        verbose=args.verbose,
        json_lines=args.json,
        interactive=interactive,
        runtime=runtime,
        speculative=load_speculative(spec, runtime, tok),
        context_shift=context_shift_from_args(args),
    )
    return 0


def main(argv=None) -> int:
    from bitnetlm.cli import main as cli_main

    return cli_main(["chat", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
