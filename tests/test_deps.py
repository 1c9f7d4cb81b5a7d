"""One install runs every documented command; a package that is missing anyway gives one line naming the extra.

A missing module is simulated the way Python itself signals one: a `None` entry in sys.modules makes `import x`
raise ModuleNotFoundError.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from bitnetlm import deps, zoo
from bitnetlm.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower().replace("-", "_") for r in reqs}


def test_default_install_carries_what_the_documented_commands_import():
    """serve (fastapi, uvicorn, pydantic), convert/quantize/inspect of GGUF (gguf), convert --to onnx (onnx),
    train CONFIG.yaml (pyyaml) and Hub models (huggingface_hub) need no extra; every extra named in a message
    exists and installs that package."""
    project = _pyproject()["project"]
    default = _names(project["dependencies"])
    assert {"fastapi", "uvicorn", "pydantic", "gguf", "onnx", "pyyaml", "huggingface_hub"} <= default
    extras = project["optional-dependencies"]
    for _module, (pip_name, extra) in deps.PACKAGES.items():
        assert pip_name.lower() in _names(extras[extra]), (pip_name, extra)


def _one_line(capsys, extra: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.endswith(f'pip install "bitnet-lm[{extra}]"'), line
    return line


def test_convert_to_onnx_without_onnx(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "onnx", None)
    out = tmp_path / "m.onnx"
    assert main(["convert", str(zoo.bundled_dir(zoo.DEFAULT_MODEL)), str(out)]) == 2
    assert "ONNX export needs the onnx package" in _one_line(capsys, "onnx")
    assert not out.exists() and not list(tmp_path.iterdir())


def test_convert_and_quantize_without_gguf(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gguf", None)
    tiny = str(zoo.bundled_dir(zoo.DEFAULT_MODEL))
    assert main(["convert", tiny, str(tmp_path / "m.gguf")]) == 2
    assert "writing GGUF files needs the gguf package" in _one_line(capsys, "gguf")
    src = tmp_path / "in.gguf"
    src.write_bytes(b"GGUF" + bytes(28))
    assert main(["quantize", str(src), str(tmp_path / "q"), "--to", "hf"]) == 2
    assert "reading GGUF files needs the gguf package" in _one_line(capsys, "gguf")
    assert main(["convert", str(src), str(tmp_path / "c"), "--to", "hf"]) == 2
    _one_line(capsys, "gguf")


def test_train_yaml_without_pyyaml(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "yaml", None)
    cfg = tmp_path / "run.yaml"
    cfg.write_text("data: somewhere\n")
    assert main(["train", str(cfg)]) == 2
    assert "a YAML training config needs the pyyaml package" in _one_line(capsys, "train")


def test_hub_model_without_huggingface_hub(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    assert main(["models", "--path", "microsoft/bitnet-b1.58-2B-4T"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert 'pip install "bitnet-lm[hub]"' in err


def test_a_module_that_fails_to_import_is_told_apart(monkeypatch):
    """Installed but broken (a failing native library): reinstall that package, not the extra."""
    msg = deps.message(
        "onnx", "ONNX export", ImportError("libprotobuf.so.32: cannot open shared object file")
    )
    assert "fails to import (libprotobuf.so.32" in msg and msg.endswith("pip install --force-reinstall onnx")
    assert deps.describe(ModuleNotFoundError("No module named 'numpyy'", name="numpyy"), "x") is None


def test_serve_replicas_without_ray(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    assert main(["serve", "--replicas", "2"]) == 2
    assert "bitnet serve --replicas needs the ray package" in _one_line(capsys, "ray")


def test_an_installed_package_older_than_our_code_needs_is_one_line(monkeypatch):
    """llguidance 1.6 takes one end token where we pass a list (a TypeError deep in a request before); an older
    grpcio refuses the committed stubs. Either is named with the version found and the extra that upgrades it."""
    llg = pytest.importorskip("llguidance")
    monkeypatch.setattr(llg, "__version__", "1.6.1", raising=False)
    with pytest.raises(deps.MissingDependency) as e:
        deps.require("llguidance", "structured output")
    (line,) = str(e.value).splitlines()
    assert (
        line == 'structured output needs llguidance>=1.7, found 1.6.1: pip install -U "bitnet-lm[structured]"'
    )
    monkeypatch.setattr(llg, "__version__", "1.7.0", raising=False)
    assert deps.require("llguidance", "structured output") is llg


def test_minimum_versions_match_the_extras():
    """Every MINIMUM is the lower bound pyproject's extra states for that package."""
    extras = _pyproject()["project"]["optional-dependencies"]
    for module, least in deps.MINIMUM.items():
        pip_name, extra = deps.PACKAGES[module.split(".")[0]]
        want = f"{pip_name}>={'.'.join(map(str, least))}"
        assert want in extras[extra], (want, extras[extra])
