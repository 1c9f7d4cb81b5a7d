"""Every command takes the same names and paths and spells its options the same way; what goes wrong in the
user's input or environment is one line on stderr (exit code 2), never a traceback."""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bitnetlm import zoo
from bitnetlm.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parent.parent
TINY = zoo.DEFAULT_MODEL  # bitnet-tiny, bundled


def one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def text_file(tmp_path):
    p = tmp_path / "held_out.txt"
    p.write_text(
        "It is a truth universally acknowledged, that a single man in possession of a good fortune.\n"
    )
    return p


@pytest.fixture
def no_hub(monkeypatch):
    """Records every Hub lookup instead of making it (each then fails as an offline machine's would)."""
    asked = []

    def lookup(repo_id):
        asked.append(repo_id)
        raise FileNotFoundError(f"{repo_id}: not in the local Hugging Face cache (offline)")

    monkeypatch.setattr(zoo, "_resolve_hub", lookup)
    return asked


def _model_argv(cmd: str, name: str, tmp: Path, text: Path) -> list[str]:
    return {
        "inspect": ["inspect", name],
        "convert": ["convert", name, str(tmp / "o.gguf")],
        "quantize": ["quantize", name, str(tmp / "o.gguf"), "-q"],
        "eval": ["eval", "-m", name, "--text", str(text)],
        "embed": ["embed", "-m", name, str(text)],
        "bench": ["bench", "-m", name, "-p", "4", "-n", "2", "-r", "1", "-t", "1", "--device", "cpu"],
        "generate": ["generate", "-m", name, "Hello"],
        "chat": ["chat", "-m", name],
        "models": ["models", "--path", name],
    }[cmd]


MODEL_COMMANDS = ("inspect", "convert", "quantize", "eval", "embed", "bench", "generate", "chat", "models")


@pytest.mark.parametrize("cmd", MODEL_COMMANDS)
def test_a_missing_relative_path_is_a_missing_file_not_a_hub_id(
    cmd, tmp_path, text_file, monkeypatch, no_hub, capsys
):
    """`./nope`, `nope/`, `x.gguf`, `a/b/c` can only be local paths: each is reported as missing, by the name
    given, and never looked up on the Hub (`nope/` used to be, and failed with the Hub's repo-id rules)."""
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(tmp_path)
    for name in ("./nope", "nope/", "x.gguf", "a/b/c", "weights.safetensors"):
        assert main(_model_argv(cmd, name, out, text_file)) == 2, (cmd, name)
        line = one_line(capsys.readouterr().err)
        assert line == f"bitnet {cmd}: error: {name}: no such file or directory", line
    assert no_hub == []
    assert not list(out.iterdir())


@pytest.mark.parametrize("cmd", ["inspect", "generate", "convert"])
def test_owner_slash_name_without_such_a_path_is_a_hub_id(
    cmd, tmp_path, text_file, monkeypatch, no_hub, capsys
):
    monkeypatch.chdir(tmp_path)
    assert main(_model_argv(cmd, "someone/some-model-1.58", tmp_path, text_file)) == 2
    assert "not in the local Hugging Face cache" in one_line(capsys.readouterr().err)
    assert no_hub == ["someone/some-model-1.58"]


def test_zoo_names_work_in_every_command(tmp_path, text_file, capsys):
    assert main(["inspect", TINY, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == str(zoo.bundled_dir(TINY))
    out = tmp_path / "tiny.gguf"
    assert main(["convert", TINY, str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "path": str(out),
        "format": "gguf",
        "bytes": out.stat().st_size,
    }
    assert main(["eval", "-m", TINY, "--text", str(text_file), "--json", "-t", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["perplexity"] > 1
    assert main(_model_argv("bench", TINY, tmp_path, text_file) + ["--json"]) == 0
    assert [r["test"] for r in json.loads(capsys.readouterr().out)["results"]] == ["pp4", "tg2"]
    assert main(["quantize", TINY, str(tmp_path / "q.gguf")]) == 2  # found, and refused for what it is
    assert one_line(capsys.readouterr().err).endswith(
        f"{TINY}: already a ternary model; use `bitnet convert` to change its format"
    )


@pytest.mark.parametrize("cmd", ["convert", "quantize"])
@pytest.mark.parametrize("name", ["x.safetensors", "model.bin", "config.json"])
def test_an_hf_output_named_like_a_file_is_refused(cmd, name, tmp_path, capsys):
    """An HF model is a directory (config.json, model.safetensors, tokenizer files), as save_pretrained writes it:
    `convert M x.safetensors` used to make a directory named x.safetensors."""
    out = tmp_path / name
    extra = ["-q"] if cmd == "quantize" else []
    for to in ([], ["--to", "hf"]):
        assert main([cmd, TINY, str(out), *to, *extra]) == 2
        line = one_line(capsys.readouterr().err)
        assert f"{out}: an HF model is a directory" in line and repr(str(out.with_suffix(""))) in line
    assert not list(tmp_path.iterdir())


def test_the_extension_names_the_format(tmp_path, capsys):
    assert main(["convert", TINY, str(tmp_path / "m.gguf"), "--to", "onnx"]) == 2
    assert "the extension .gguf names a GGUF file, but --to is onnx" in one_line(capsys.readouterr().err)
    assert main(["convert", TINY, str(tmp_path / "m.onnx"), "--to", "gguf"]) == 2
    assert "the extension .onnx names a ONNX file, but --to is gguf" in one_line(capsys.readouterr().err)
    assert main(["convert", TINY, str(tmp_path / "m"), "--json"]) == 0  # no extension: an HF directory
    assert (
        json.loads(capsys.readouterr().out)["format"] == "hf" and (tmp_path / "m" / "config.json").is_file()
    )


def _parser(cmd: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"bitnet {cmd}")
    importlib.import_module(COMMANDS[cmd][0]).add_arguments(p)
    return p


MINIMAL = {  # the least each command parses
    "generate": [],
    "chat": [],
    "eval": ["-m", TINY],
    "embed": ["-m", TINY],
    "bench": [],
    "convert": ["a", "b"],
    "quantize": ["a", "b"],
    "inspect": ["a"],
    "train": [],
    "models": [],
    "data": ["prepare", "a", "-o", "b"],
}


@pytest.mark.parametrize("cmd", sorted(MINIMAL))
def test_one_spelling_per_option(cmd):
    """--no-progress and --json on every command (a model can be assembled at first use by any that takes
    one); -t/--threads on every command that computes; -m/--model, --device (default auto) and -c/--ctx-size
    (the context) spelled alike wherever they exist."""
    p = _parser(cmd)
    ns = p.parse_args([*MINIMAL[cmd], "--no-progress", "--json"])
    assert ns.no_progress is True and ns.json is True
    if cmd not in ("inspect", "models", "data"):
        assert p.parse_args([*MINIMAL[cmd], "-t", "2"]).threads in (2, [2])
        assert p.parse_args([*MINIMAL[cmd], "--threads", "2"]).threads in (2, [2])
    opts = {s: a for a in p._actions for s in a.option_strings}
    if "--model" in opts:
        assert opts["-m"] is opts["--model"]
    if "--device" in opts:
        assert cmd == "train" or opts["--device"].default == "auto"
    if "--ctx-size" in opts:
        assert opts["-c"] is opts["--ctx-size"] and opts["-c"].dest == "max_seq_len"


def test_threads_are_validated_and_applied(tmp_path, capsys):
    for cmd in ("convert", "quantize"):
        assert main([cmd, TINY, str(tmp_path / "x.gguf"), "-t", "0"]) == 2
        assert (
            one_line(capsys.readouterr().err) == f"bitnet {cmd}: error: --threads 0: expected an integer >= 1"
        )
    assert main(["bench", "--shape", "2b4t", "-t", "0,1"]) == 2
    assert "-t/--threads takes counts >= 1" in one_line(capsys.readouterr().err)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert main(["convert", TINY, str(tmp_path / "x.gguf"), "-t", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("device", ["mps", "metal", "xpu", "cuda:99"])
@pytest.mark.parametrize("cmd", ["generate", "chat", "eval", "bench", "train"])
def test_an_absent_device_is_one_line_naming_the_devices_available(cmd, device, text_file, capsys):
    argv = {
        "generate": ["generate", "-p", "Hi"],
        "chat": ["chat"],
        "eval": ["eval", "-m", TINY, "--text", str(text_file)],
        "bench": ["bench", "--shape", "2b4t"],
        "train": ["train"],
    }[cmd]
    assert main([*argv, "--device", device]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"bitnet {cmd}: error: --device {device!r}") and "available" in line, line
    assert ", cuda" in line or line.endswith("cpu") or line.endswith("cpu)"), line


def test_verbose_statistics_start_on_their_own_line(monkeypatch):
    """`-v` prints the statistics on stderr after the streamed text: on a terminal (stdout and stderr on one
    screen) they used to continue the text's last line."""
    screen = io.StringIO()
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    assert main(["generate", "Once upon a time", "-n", "4", "--temp", "0", "-v"]) == 0
    text, stats = screen.getvalue().split("\n", 1)
    assert text and stats.startswith("prompt: ") and stats.endswith("\n") and "\n" not in stats[:-1]
    screen.seek(0)
    screen.truncate()
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n"))
    assert main(["chat", "-n", "4", "--temp", "0", "-v"]) == 0
    lines = screen.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].startswith("prompt: ")


@pytest.fixture
def unsafe_template_model(tmp_path):
    """bitnet-tiny with a chat template that reaches for Python internals (the sandbox refuses)."""
    src, d = zoo.bundled_dir(TINY), tmp_path / "unsafe"
    d.mkdir()
    for f in src.iterdir():
        (d / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, d / f.name)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m['content'].__class__.__mro__ }}{% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_a_chat_template_the_sandbox_refuses_is_one_line(unsafe_template_model, monkeypatch, capsys):
    want = (
        "the chat template failed: SecurityError: access to attribute '__class__' of 'str' object is unsafe."
    )
    assert main(["generate", "-m", str(unsafe_template_model), "--chat", "Hi", "-n", "2"]) == 2
    assert one_line(capsys.readouterr().err).endswith(want)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n"))
    assert main(["chat", "-m", str(unsafe_template_model), "-n", "2"]) == 2
    assert one_line(capsys.readouterr().err).endswith(want)


def _unwritable_dir(tmp_path: Path) -> Path:
    """A directory that refuses new files: mode 0555, or where that binds no one (root), sysfs."""
    d = tmp_path / "read-only"
    d.mkdir()
    d.chmod(0o555)
    for cand in (d, Path("/sys")):
        try:
            (cand / ".probe").touch()
        except OSError:
            return cand
        (cand / ".probe").unlink()
    pytest.fail("no directory here refuses writes")


@pytest.mark.parametrize("out", ["m.gguf", "m.onnx", "m"])
def test_convert_into_a_read_only_directory(out, tmp_path, capsys):
    d = _unwritable_dir(tmp_path)
    before = sorted(os.listdir(d))
    assert main(["convert", TINY, str(d / out)]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"bitnet convert: error: {d / out}: cannot write into {d} ("), line
    assert sorted(os.listdir(d)) == before


@pytest.fixture
def full_disk(tmp_path):
    """(a directory, a context manager) whose writes run out of room after 256 KiB: a tmpfs of that size where
    this process may mount one (ENOSPC), else the same limit on file sizes (EFBIG) around the block."""
    import contextlib
    import resource
    import signal

    d = tmp_path / "small"
    d.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(d)], capture_output=True
    )
    if mounted.returncode == 0:
        yield d, contextlib.nullcontext()
        subprocess.run(["umount", str(d)], check=True)
        return

    @contextlib.contextmanager
    def limited():
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, handler)

    yield d, limited()


@pytest.mark.parametrize("out", ["m.gguf", "m.onnx", "m"])
def test_convert_onto_a_full_disk(out, full_disk, capsys):
    """Every writer (GGUF, ONNX, and safetensors' own for HF) running out of room: one line naming the output;
    no temporary is left behind."""
    d, limit = full_disk
    with limit:
        rc = main(["convert", TINY, str(d / out)])
    assert rc == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"bitnet convert: error: {d / out}: cannot write it ("), line
    assert "No space left on device" in line or "File too large" in line, line
    assert os.listdir(d) == []


def test_a_closed_pipe_ends_the_command_quietly():
    """`bitnet inspect M | head`: the reader goes away before the output is written; the command stops
    without a word, with the status of a process that SIGPIPE ended."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "bitnetlm.cli", "inspect", TINY, "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    proc.stdout.close()  # before the interpreter has even imported the package
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == b"", err.decode()
