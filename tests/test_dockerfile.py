"""The Dockerfile, without Docker: its steps parse, what it copies exists and is what a build needs, the extras it
installs exist, and its CMD is a valid `bitnet` command line. (scripts/check_dockerfile.py runs the steps for
real in a clean virtual environment: minutes, so it is not part of the suite.)"""

from __future__ import annotations

import importlib.util
import json
import shlex
from pathlib import Path

import tomllib

from bitnetlm.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location(
        "check_dockerfile", ROOT / "scripts" / "check_dockerfile.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dockerfile_steps_are_sound():
    steps = _script().steps(ROOT / "Dockerfile")
    ops = [op for op, _ in steps]
    assert ops[0] == "FROM" and ops[-1] == "CMD"
    copied = {src for op, arg in steps if op == "COPY" for src in shlex.split(arg)[:-1]}
    # a build needs the package, the C sources and the build files; each exists
    assert {"bitnetlm", "csrc", "pyproject.toml", "setup.py"} <= copied
    assert all((ROOT / src).exists() for src in copied)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    args = dict(arg.split("=", 1) for op, arg in steps if op == "ARG")
    for name in ("EXTRAS",):
        assert set(args[name].split(",")) <= set(extras)
    assert any(op == "RUN" and '".[$EXTRAS]"' in arg for op, arg in steps)
    env = dict(kv.split("=", 1) for op, arg in steps if op == "ENV" for kv in shlex.split(arg))
    assert env["BITNET_HOST"] == "0.0.0.0"  # reachable through `docker run -p`
    cmd = json.loads(steps[-1][1])
    assert cmd[0] == "bitnet"
    build_parser().parse_args(cmd[1:])  # SystemExit on a bad command line
