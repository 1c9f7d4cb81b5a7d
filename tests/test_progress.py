"""Progress bars (bitnetlm.progress): every long operation draws one on stderr when it is a terminal, none with
--no-progress or when stderr is a file or a pipe."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import sys
import termios
import threading
import time

import pytest
from oracle import random_model

from bitnetlm import progress, zoo
from bitnetlm.cli import main
from bitnetlm.formats.gguf import save_gguf

BAR = "%|"  # tqdm's bar: "desc:  40%|####      | 2/5 [...]"
MODEL = json.dumps(
    dict(
        arch="bitnet",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
)
TRAIN = [
    "--model-config",
    MODEL,
    "--max-steps",
    "3",
    "--batch-size",
    "2",
    "--seq-len",
    "16",
    "--tensorboard",
    "0",
]


class Terminal:
    """A real terminal (a pty, 120 columns) for stderr; `drawn()` gives what was drawn on it so far."""

    def __init__(self):
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        self.tty = os.fdopen(slave, "w", encoding="utf-8")
        self.chunks: list[bytes] = []
        self.done = threading.Event()
        self.reader = threading.Thread(target=self._drain, daemon=True)  # a full pty would block the writer
        self.reader.start()

    def _drain(self):
        while not self.done.is_set():
            if select.select([self.master], [], [], 0.02)[0]:
                try:
                    self.chunks.append(os.read(self.master, 1 << 16))
                except OSError:
                    return

    def drawn(self) -> str:
        """What was drawn since the last call: everything before a marker written now (a pty keeps the order)."""
        marker = b"<end of drawing>"
        self.tty.write(marker.decode())
        self.tty.flush()
        deadline = time.monotonic() + 30
        while marker not in b"".join(self.chunks):
            assert time.monotonic() < deadline, "the terminal never showed what was written"
            time.sleep(0.01)
        data = b"".join(self.chunks)
        self.chunks.clear()
        return data[: data.index(marker)].decode("utf-8", "replace")

    def close(self):
        self.done.set()
        self.reader.join()
        self.tty.close()
        os.close(self.master)


@pytest.fixture
def terminal(monkeypatch):
    """stderr on a terminal: set inside the test (pytest's output capture takes stderr back between setup and
    the test's call)."""
    term = Terminal()

    def attach() -> Terminal:
        monkeypatch.setattr(sys, "stderr", term.tty)
        return term

    yield attach
    term.close()


@pytest.fixture(scope="module")
def fp_gguf(tmp_path_factory):
    """A full-precision LLaMA GGUF (F16 projections): loading it dequantizes every tensor."""
    path = tmp_path_factory.mktemp("fp") / "fp.gguf"
    save_gguf(random_model("llama", hidden=256, inter=512).eval(), path, embed_type="f16")
    return path


@pytest.fixture
def text_file(tmp_path):
    p = tmp_path / "held_out.txt"
    p.write_text(
        "It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 8
    )
    return p


def _operations(tmp, fp_gguf, text):
    """(argv, the bars it must draw): loading a full-precision GGUF, quantize, convert to every format, eval."""
    q, tiny = tmp / "q.gguf", str(zoo.bundled_dir(zoo.DEFAULT_MODEL))
    return [
        (["quantize", str(fp_gguf), str(q), "-q"], ["loading fp.gguf", "ternarizing", "writing q.gguf"]),
        (["convert", str(q), str(tmp / "hf")], ["loading q.gguf", "packing"]),
        (["convert", str(q), str(tmp / "b3"), "--storage", "base3"], ["packing", "base-3 packing"]),
        (["convert", str(tmp / "hf"), str(tmp / "m.onnx")], ["building the ONNX graph"]),
        (["convert", str(tmp / "hf"), str(tmp / "m.gguf")], ["writing m.gguf"]),
        (["eval", "-m", zoo.DEFAULT_MODEL, "--text", str(text), "-c", "16"], ["perplexity"]),
        (["data", "prepare", str(text), "-o", str(tmp / "data"), "--tokenizer", tiny], ["tokenizing"]),
        (["train", *TRAIN, "--data", str(tmp / "data"), "--out-dir", str(tmp / "run")], ["train"]),
    ]


def test_long_operations_draw_bars_on_a_terminal(terminal, tmp_path, fp_gguf, text_file):
    term = terminal()
    for argv, bars in _operations(tmp_path, fp_gguf, text_file):
        assert main(argv) == 0, argv
        seen = term.drawn()
        for desc in bars:
            assert f"{desc}: " in seen and BAR in seen, (argv, desc, seen)


def test_no_progress_draws_none(terminal, tmp_path, fp_gguf, text_file):
    term = terminal()
    for argv, _ in _operations(tmp_path, fp_gguf, text_file):
        assert main([*argv, "--no-progress"]) == 0, argv
        seen = term.drawn()
        assert BAR not in seen, (argv, seen)


def test_no_terminal_draws_none(tmp_path, fp_gguf, text_file, capsys):
    for argv, _ in _operations(tmp_path, fp_gguf, text_file):
        assert main(argv) == 0, argv
        assert BAR not in capsys.readouterr().err, argv


def test_the_policy_in_library_code(terminal):
    term = terminal()
    assert progress.enabled()
    list(progress.bar(range(3), desc="shown"))
    assert "shown: " in term.drawn()
    with progress.disabled():
        assert not progress.enabled()
        list(progress.bar(range(3), desc="hidden"))
        with progress.disabled(False):  # leaves the policy as it is
            assert not progress.enabled()
    assert progress.enabled()
    list(progress.bar(range(3), desc="off", show=False))
    assert term.drawn() == ""
