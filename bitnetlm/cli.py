"""`bitnet <command>`: each command lives in its own module and is also a plain library function."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

# command -> (module, one-line help). Modules are imported only when their command runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("bitnetlm.commands.generate", "generate text from a prompt"),
    "chat": ("bitnetlm.commands.chat", "interactive chat with the model's chat template"),
    "inspect": ("bitnetlm.commands.inspect", "architecture, parameters, bits per weight, file layout"),
    "serve": ("bitnetlm.commands.serve", "OpenAI-compatible HTTP server"),
    "convert": ("bitnetlm.commands.convert", "convert between HF, GGUF and ONNX"),
    "quantize": ("bitnetlm.commands.quantize", "ternarize a full-precision model (post-training absmean)"),
    "train": ("bitnetlm.commands.train", "quantization-aware training / distillation"),
    "embed": ("bitnetlm.commands.embed", "sentence embeddings from an encoder (BERT family) or a decoder"),
    "eval": ("bitnetlm.commands.eval", "perplexity and multiple-choice accuracy"),
    "data": ("bitnetlm.commands.data", "prepare tokenized training data"),
    "bench": ("bitnetlm.commands.bench", "prefill/decode speed, llama-bench style"),
    "tune": ("bitnetlm.commands.tune", "tune the CUDA decode step's kernel tiles on this GPU"),
    "models": ("bitnetlm.commands.models", "list bundled and known models"),
}


def _available_commands() -> dict[str, tuple[str, str]]:
    return {k: v for k, v in COMMANDS.items() if importlib.util.find_spec(v[0]) is not None}


def build_parser() -> argparse.ArgumentParser:
    from bitnetlm import __version__

    parser = argparse.ArgumentParser(
        prog="bitnet", description="1.58-bit (ternary) language models: run, serve, train, convert."
    )
    parser.add_argument("--version", action="version", version=f"bitnet-lm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (mod_name, help_text) in _available_commands().items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=mod_name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    # Parse the command name first, then let only that command's module add its flags (keeps startup cheap).
    if argv and argv[0] in _available_commands():
        mod = importlib.import_module(COMMANDS[argv[0]][0])
        sub = argparse.ArgumentParser(prog=f"bitnet {argv[0]}", description=COMMANDS[argv[0]][1])
        mod.add_arguments(sub)
        args = sub.parse_args(argv[1:])
        return _run(argv[0], mod, args)
    args = parser.parse_args(argv)
    parser.print_help()
    return 0 if args.command is None else 2


def _run(name: str, mod, args: argparse.Namespace) -> int:
    """Run a command; what goes wrong in the user's input or environment is one line on stderr, exit code 2."""
    from bitnetlm import progress

    try:
        with progress.disabled(getattr(args, "no_progress", False)):
            rc = int(mod.run(args) or 0)
        sys.stdout.flush()  # inside the try: a reader gone (`| head`) surfaces here, not at exit
        return rc
    except BrokenPipeError:
        return _reader_gone()
    except (FileNotFoundError, ValueError, FileExistsError) as e:
        return _error(name, str(e))
    except ImportError as e:  # a missing optional package: one line naming what installs it
        from bitnetlm.deps import describe

        text = describe(e, f"bitnet {name}")
        if text is None:
            raise
        return _error(name, text)
    except OSError as e:  # the environment refused (permissions, a full disk, ...): no traceback for that
        return _error(name, f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e))
    except KeyboardInterrupt:
        return 130


def _error(name: str, text: str) -> int:
    try:
        print(f"bitnet {name}: error: {text}", file=sys.stderr)
    except BrokenPipeError:
        pass
    return 2


def _reader_gone() -> int:
    """stdout's reader closed the pipe (`bitnet inspect M | head`): stop quietly, as Unix tools do on SIGPIPE.

    stdout is pointed at /dev/null so that the interpreter's own flush at exit finds nothing to complain about."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a real file (captured output): nothing to flush later
        pass
    return 128 + 13  # the status of a process that SIGPIPE ended


if __name__ == "__main__":
    sys.exit(main())
