"""`bitnet generate` and `bitnet chat` end to end on a saved tiny checkpoint with the real LLaMA-3 tokenizer."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from assets import asset
from test_generate import tiny_llama3_bitnet

import bitnetlm
from bitnetlm.cli import main
from bitnetlm.generate import Tokenizer, generate
from bitnetlm.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["--device", "cpu", "--backend", "reference", "--temp", "0", "--ignore-eos"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli") / "tiny"
    bitnetlm.save(tiny_llama3_bitnet(seed=1), d, tokenizer=Tokenizer.from_dir(asset("llama3-tokenizer")))
    return d


@pytest.fixture(scope="module")
def loaded(model_dir):
    model, tok = bitnetlm.load(model_dir, backend="reference")
    return model, tok


def test_generate_json_matches_library(model_dir, loaded, capsys):
    rc = main(
        ["generate", "-m", str(model_dir), "-p", "The capital of France is", "-n", "6", "--json", *COMMON]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    ref = generate(*loaded, "The capital of France is", max_tokens=6, temperature=0, ignore_eos=True)
    assert out["tokens"] == ref.tokens and out["text"] == str(ref)
    assert out["generation_tokens"] == 6 and out["prompt_tokens"] == 6 and out["finish_reason"] == "length"


def test_generate_positional_prompt_stream_and_verbose(model_dir, loaded, capsys):
    rc = main(["generate", "-m", str(model_dir), "Hello", "-n", "5", "--verbose", "--seed", "3", *COMMON])
    assert rc == 0
    cap = capsys.readouterr()
    ref = generate(*loaded, "Hello", max_tokens=5, temperature=0, ignore_eos=True)
    assert cap.out == str(ref) + "\n"
    assert "tokens/s" in cap.err and "time to first token" in cap.err


def test_generate_system_prompt_uses_chat_template(model_dir, loaded, capsys):
    rc = main(
        ["generate", "-m", str(model_dir), "-p", "Hi", "--system", "Be brief.", "-n", "2", "--json", *COMMON]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    _, tok = loaded
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert out["prompt_tokens"] == len(tok.apply_chat_template(msgs, tokenize=True))


def test_generate_errors(model_dir, tmp_path, capsys):
    assert main(["generate", "-m", str(tmp_path / "nope"), "-p", "x"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["generate", "-m", str(model_dir)]) == 2
    assert "no prompt" in capsys.readouterr().err
    assert main(["generate", "-m", str(model_dir), "-p", "Hi", "-c", "2", *COMMON]) == 2
    assert "context holds 2" in capsys.readouterr().err


def test_generate_json_schema_and_regex_on_the_llama3_vocabulary(model_dir, tmp_path, capsys):
    """--json-schema / --regex constrain a random model's output over the 128k LLaMA-3 vocabulary."""
    import jsonschema
    from structured_schemas import SCHEMAS

    flags = ["--device", "cpu", "--backend", "reference", "--temp", "0", "-n", "120", "--json"]
    for i in (5, 11):
        f = tmp_path / f"schema{i}.json"
        f.write_text(json.dumps(SCHEMAS[i]))
        assert (
            main(["generate", "-m", str(model_dir), "-p", "Give JSON", "--json-schema", str(f), *flags]) == 0
        )
        jsonschema.validate(json.loads(json.loads(capsys.readouterr().out)["text"]), SCHEMAS[i])
    assert (
        main(["generate", "-m", str(model_dir), "-p", "Date:", "--regex", "[0-9]{4}-[0-9]{2}", *flags]) == 0
    )
    assert re.fullmatch("[0-9]{4}-[0-9]{2}", json.loads(capsys.readouterr().out)["text"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "object", "if": {}, "then": {}}))
    assert main(["generate", "-m", str(model_dir), "-p", "x", "--json-schema", str(bad), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert '"if"' in err and "\n" not in err and len(err.splitlines()) == 1, err
    assert (
        main(["generate", "-m", str(model_dir), "-p", "x", "--json-schema", str(tmp_path / "none"), *flags])
        == 2
    )
    assert "none" in capsys.readouterr().err


def test_chat_session_streams_text_drops_old_turns_and_refuses_long_messages(loaded):
    """chat_session in text mode: each answer streamed as generate() gives it; /help on stderr; a message the
    context cannot hold is refused in one line and forgotten; when the conversation outgrows the context the
    oldest turn goes (the system prompt stays)."""
    from bitnetlm.commands.chat import HELP, chat_session

    model, tok = loaded
    kw = dict(max_tokens=4, temperature=0, ignore_eos=True)
    system = {"role": "system", "content": "Be brief."}
    u1, u2 = {"role": "user", "content": "Hello"}, {"role": "user", "content": "How are you?"}
    a1 = {"role": "assistant", "content": str(generate(model, tok, [system, u1], **kw))}

    def n_tokens(msgs):
        return len(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))

    ctx = n_tokens([system, a1, u2]) + 4  # the second turn fits only without the first question
    assert n_tokens([system, u1, a1, u2]) + 4 > ctx and n_tokens([system, u1]) + 4 <= ctx
    long = {"role": "user", "content": "word " * 100}
    out, err = io.StringIO(), io.StringIO()
    lines = ["Hello\n", "/help\n", long["content"] + "\n", "How are you?\r\n", "/exit\n", "never read\n"]
    got = chat_session(model, tok, lines, SamplingParams(**kw), system="Be brief.", ctx_size=ctx, out=out,
                       err=err, verbose=True, interactive=True)  # fmt: skip
    a2 = {"role": "assistant", "content": str(generate(model, tok, [system, a1, u2], **kw))}
    assert got == [system, a1, u2, a2]
    assert out.getvalue() == a1["content"] + "\n" + a2["content"] + "\n"
    err_lines = err.getvalue().replace("> ", "").splitlines()
    assert err_lines[1] == HELP
    assert (
        err_lines[2]
        == f"error: this message needs {n_tokens([system, long])} tokens but the context holds {ctx}"
    )
    assert len(err_lines) == 4 and all("tokens/s" in err_lines[i] for i in (0, 3))
    assert err.getvalue().count("> ") == 5  # a prompt before each line read; /exit ends the chat


def test_chat_repl_through_a_pipe(model_dir, loaded):
    model, tok = loaded
    stdin = "Hello\n\n/reset\nHello\nHow are you?\n/exit\nnever read\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "bitnetlm.cli", "chat", "-m", str(model_dir), "-n", "4", "--json", *COMMON]
    p = subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    turns = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(turns) == 3  # /exit stops before "never read"
    kw = dict(max_tokens=4, temperature=0, ignore_eos=True)
    first = generate(model, tok, [{"role": "user", "content": "Hello"}], **kw)
    assert turns[0]["content"] == str(first) == turns[1]["content"]  # /reset forgot the first turn
    history = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": str(first)},
        {"role": "user", "content": "How are you?"},
    ]
    second = generate(model, tok, history, **kw)
    assert turns[2]["content"] == str(second)
    assert turns[2]["prompt_tokens"] == len(tok.apply_chat_template(history, tokenize=True))
    assert "conversation reset" in p.stderr
