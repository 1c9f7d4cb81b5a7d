"""Files we write: the permissions a plain open() gives under the umask, and no temporary left behind, neither by
an exception mid-write nor, after the next write beside it, by a writer that was killed."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bitnetlm import zoo
from bitnetlm.formats import atomic

ROOT = Path(__file__).resolve().parent.parent
TINY = zoo.bundled_dir(zoo.DEFAULT_MODEL)


@contextlib.contextmanager
def _umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _modes(path: Path) -> dict[str, int]:
    items = [path, *path.rglob("*")] if path.is_dir() else [path]
    return {str(p.relative_to(path.parent)): stat.S_IMODE(p.stat().st_mode) for p in items}


def _debris(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_outputs_get_the_umask_permissions(tmp_path, tiny_model, mask):
    """model.safetensors used to be 0600 (safetensors' save_file writes through a private temp file)."""
    import bitnetlm
    from bitnetlm.convert import convert

    with _umask(mask):
        bitnetlm.save(tiny_model, tmp_path / "hf")
        convert(tmp_path / "hf", tmp_path / "m.gguf")
        convert(tmp_path / "hf", tmp_path / "b3", storage="base3")
        convert(tmp_path / "hf", tmp_path / "m.onnx")
    modes = {}
    for out in ("hf", "m.gguf", "b3", "m.onnx"):
        modes.update(_modes(tmp_path / out))
    assert "hf/model.safetensors" in modes and "b3/model.safetensors" in modes
    for name, mode in modes.items():
        want = (0o777 if (tmp_path / name).is_dir() else 0o666) & ~mask
        assert mode == want, (name, oct(mode), oct(want))
    assert _debris(tmp_path) == []


def test_checkpoints_and_prepared_data_get_the_umask_permissions(tmp_path):
    from bitnetlm.train.checkpoint import save_checkpoint
    from bitnetlm.train.data import PrepareConfig, prepare_data

    (tmp_path / "text.txt").write_text("It is a truth universally acknowledged. " * 200)
    with _umask(0o022):
        ck = save_checkpoint(tmp_path / "ck", 1, {"w": torch.ones(3)}, {"optimizer": {}}, {"data": {}})
        prepare_data([tmp_path / "text.txt"], TINY, tmp_path / "data", PrepareConfig(val_fraction=0.1), False)
    for tree in (ck, tmp_path / "data"):
        for name, mode in _modes(tree).items():
            assert mode == (0o755 if (tree.parent / name).is_dir() else 0o644), (name, oct(mode))


def _fail_mid_write(monkeypatch, module, attr):
    """Patch module.attr (a writer taking a path) to write half a file, then raise."""
    real = getattr(module, attr)

    def half_then_fail(*a, **k):
        real(*a, **k)
        path = next(x for x in (*a, *k.values()) if isinstance(x, (str, os.PathLike)) and os.path.isfile(x))
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module, attr, half_then_fail)


def test_an_exception_mid_write_leaves_no_temporary(tmp_path, tiny_model, monkeypatch):
    import gguf
    import onnx

    import bitnetlm
    import bitnetlm.formats.hf as hf
    from bitnetlm.convert import convert

    model = tiny_model
    bitnetlm.save(model, tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    with monkeypatch.context() as m:
        _fail_mid_write(m, hf, "save_file")
        with pytest.raises(OSError, match="No space"):
            bitnetlm.save(model, out / "hf")
    with monkeypatch.context() as m:
        m.setattr(
            gguf.GGUFWriter, "write_tensor_data", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "full"))
        )
        with pytest.raises(OSError):
            convert(tmp_path / "src", out / "m.gguf")
    with monkeypatch.context() as m:
        _fail_mid_write(m, onnx, "save_model")
        with pytest.raises(OSError, match="No space"):
            convert(tmp_path / "src", out / "m.onnx")
    assert list(out.iterdir()) == []


KILLED_MID_WRITE = r"""
import os, sys
import safetensors.torch as st
import bitnetlm
import bitnetlm.formats.hf as hf
real = st.save_file
def dies(tensors, path, metadata=None):
    real(tensors, path, metadata=metadata)
    os._exit(9)  # killed mid-write: no exception handler, no finally runs
hf.save_file = dies
bitnetlm.save(bitnetlm.load(sys.argv[1])[0], sys.argv[2])
"""


def test_a_killed_writer_leaves_debris_that_the_next_write_removes(tmp_path, tiny_model):
    import bitnetlm

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    bitnetlm.save(tiny_model, tmp_path / "in" / "src")
    out = tmp_path / "model"
    src = str(tmp_path / "in" / "src")
    r = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE, src, str(out)], env=env, capture_output=True)
    assert r.returncode == 9, r.stderr.decode()
    (left,) = _debris(tmp_path)
    assert left.startswith(".model" + atomic.TAG)
    bitnetlm.save(tiny_model, tmp_path / "other")  # the next write in that directory cleans up
    assert _debris(tmp_path) == [] and not out.exists()


def test_a_live_writers_temporary_is_left_alone(tmp_path):
    with atomic.temp_file(tmp_path / "x.gguf") as tmp:
        tmp.write_bytes(b"half")
        assert atomic.remove_stale(tmp_path) == [] and tmp.exists()
        with atomic.temp_file(tmp_path / "y.gguf") as other:  # another write beside it
            assert tmp.exists()
            other.write_bytes(b"y")
            atomic.commit(other, tmp_path / "y.gguf")
        assert tmp.exists()
    assert _debris(tmp_path) == [] and (tmp_path / "y.gguf").read_bytes() == b"y"
