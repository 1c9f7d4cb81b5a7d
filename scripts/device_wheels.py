#!/usr/bin/env python3
"""Download the wheels the GPU machine needs to run the whole test suite (it has no network) into .whl/py312.

The GPU machine's image (Python 3.12, PyTorch, Triton, transformers, pytest and more) lacks the serving stack,
gguf and openai. pip's resolver finds those packages' whole closure for that Python here, and the packages the
image already has are left out, because a second version on PYTHONPATH would shadow the image's. Resolving each
time, not pinning a list, keeps up with new dependencies: fastapi 0.165 began importing opentelemetry, and the
serve tests could not be imported there until this script resolved it (2026-12-04).

On the GPU machine, with `.whl/py312` carried:
    pip install -q --no-index --no-deps --target /tmp/site .whl/py312/*.whl; export PYTHONPATH=/tmp/site:$PWD
Usage: python scripts/device_wheels.py [--dest DIR] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What the tests import beyond the image's packages (pyproject's dev extra, less what the GPU runs never need).
WANTED = [
    "fastapi",
    "uvicorn",
    "pydantic",
    "gguf",
    "openai",
    "httpx",
    "hypothesis",
    "pytest-xdist",
    "pytest-timeout",
    "websockets",
    "grpcio>=1.85.4",  # the committed gRPC stubs need it
    "protobuf>=7.35.1",
    "llguidance>=1.7",
    "jsonschema",
    "prometheus_client",
]
# Packages of the GPU machine's image (its package list, read 2026-11-17) that the closure above can reach.
DEVICE_HAS = {
    "annotated-doc", "anyio", "attrs", "certifi", "charset-normalizer", "click", "execnet", "filelock", "fsspec",
    "h11", "httpcore", "httpx", "huggingface-hub", "hypothesis", "idna", "iniconfig", "jinja2", "markupsafe",
    "numpy", "packaging", "pluggy", "pygments", "pytest", "pytest-timeout", "pytest-xdist", "pyyaml", "regex",
    "requests", "rich", "safetensors", "sortedcontainers", "tokenizers", "torch", "tqdm", "transformers",
    "triton", "typing-extensions", "urllib3", "zipp",
}  # fmt: skip
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"] + [
    a
    # the image's glibc is 2.39: newer wheels (llguidance >= 1.7) are tagged manylinux_2_31 and up
    for p in (*(f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 17)), "manylinux2014_x86_64", "any")
    for a in ("--platform", p)
]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve(wanted: list[str]) -> dict[str, str]:
    """name -> version of the closure of `wanted` for the GPU machine's Python (pip's resolver, a dry run)."""
    with tempfile.TemporaryDirectory() as td:
        report = Path(td) / "report.json"
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--dry-run",
            "--ignore-installed",
            "--target",
            td,
        ]
        subprocess.run([*cmd, *PLATFORM, "--report", str(report), *wanted], check=True)
        items = json.loads(report.read_text())["install"]
    return {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def missing(closure: dict[str, str]) -> dict[str, str]:
    """The part of the closure the image lacks."""
    return {n: v for n, v in sorted(closure.items()) if n not in DEVICE_HAS}


def download(pins: dict[str, str], dest: Path) -> list[Path]:
    """The wheels of `pins` into dest, replacing what it held (downloaded beside it first, then renamed)."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    specs = [f"{n}=={v}" for n, v in pins.items()]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(tmp), *specs],
        check=True,
    )
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return sorted(dest.glob("*.whl"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=ROOT / ".whl" / "py312")
    ap.add_argument("--dry-run", action="store_true", help="list the wheels, download nothing")
    args = ap.parse_args(argv)
    pins = missing(resolve(WANTED))
    for n, v in pins.items():
        print(f"{n}=={v}")
    if not args.dry_run:
        wheels = download(pins, args.dest)
        size = sum(w.stat().st_size for w in wheels) / 2**20
        print(f"{len(wheels)} wheels, {size:.1f} MiB in {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
