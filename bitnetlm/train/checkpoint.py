"""Exact, atomic training checkpoints.

Layout: OUT/checkpoints/step_00000100/
  model.safetensors   full (unsharded) model state, fp32 latent weights; tied tensors stored once
  optim.pt            {"optimizer": ..., "scheduler": ...} (plain tensors/numbers: torch.load(weights_only=True))
  rng.pt              torch CPU (+ CUDA) generator states
  trainer.json        step, data position, early-stopping state, python/numpy RNG, config, and the size and
                      CRC-32 of the three files above ("files"; CRC-32 runs at disk speed and catches
                      accidental damage, which is what it guards against)
OUT/checkpoints/latest  name of the newest complete checkpoint

A checkpoint is written into a hidden temporary directory, fsynced and renamed into place; only then
does `latest` move (os.replace). A crash at any point leaves the previous checkpoint intact and
pointed to; stale temporary directories are ignored and cleaned up. A checkpoint damaged after the
fact (disk errors, a torn copy) fails `verify_checkpoint`, and resuming falls back to the newest one
that verifies (`select_resume`).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
import torch

from bitnetlm.formats.atomic import default_permissions

STEP_RE = re.compile(r"^step_(\d{8})$")
DATA_FILES = ("model.safetensors", "optim.pt", "rng.pt")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def rng_state() -> tuple[dict, dict]:
    """(tensor states for rng.pt, JSON-able states for trainer.json)."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["cuda"] = torch.cuda.get_rng_state()
    py = random.getstate()
    npst = np.random.get_state()
    js = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
    }
    return tensors, js


def set_rng_state(tensors: dict, js: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])
    if "python" in js:
        v, st, g = js["python"]
        random.setstate((v, tuple(st), g))
    if "numpy" in js:
        name, keys, pos, has_g, g = js["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_g, g))


def _dedupe(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses shared storage (tied weights): keep one name per storage, record the aliases."""
    out, aliases, seen = {}, {}, {}
    for k, v in sd.items():
        v = v.detach()
        key = (
            (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.dtype)
            if v.numel()
            else None
        )
        if key is not None and key in seen:
            aliases[k] = seen[key]
            continue
        if key is not None:
            seen[key] = k
        out[k] = v.contiguous().cpu()
    return out, aliases


def _point_latest(root: Path, name: str) -> None:
    latest_tmp = root / f".latest.tmp-{os.getpid()}"
    latest_tmp.write_text(name + "\n")
    os.replace(latest_tmp, root / "latest")
    _fsync_dir(root)


def save_checkpoint(
    ckpt_root: str | os.PathLike,
    step: int,
    model_state: dict[str, torch.Tensor],
    optim_state: dict,
    trainer_state: dict,
    keep_last: int = 0,
) -> Path:
    """Write checkpoint `step` atomically under ckpt_root; returns its directory."""
    from safetensors.torch import save_file

    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    final = root / name
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        tensors, aliases = _dedupe(model_state)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"aliases": json.dumps(aliases)})
        torch.save(optim_state, tmp / "optim.pt")
        rng_t, rng_js = rng_state()
        torch.save(rng_t, tmp / "rng.pt")
        files = {f: {"bytes": (tmp / f).stat().st_size, "crc32": _crc32(tmp / f)} for f in DATA_FILES}
        state = {**trainer_state, "step": step, "rng": rng_js, "files": files}
        (tmp / "trainer.json").write_text(json.dumps(state, indent=1))
        default_permissions(tmp)  # mkdtemp makes 0700 and safetensors 0600: checkpoints get the usual ones
        for f in tmp.iterdir():
            _fsync_file(f)
        _fsync_dir(tmp)
        if final.exists():  # re-saving the same step (e.g. end of a resumed run): replace it
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(root)
    _point_latest(root, name)
    if keep_last > 0:
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(ckpt_root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [
        p for p in root.iterdir() if p.is_dir() and STEP_RE.match(p.name) and (p / "trainer.json").is_file()
    ]
    return sorted(found, key=lambda p: int(STEP_RE.match(p.name).group(1)))


def latest_checkpoint(ckpt_root: str | os.PathLike) -> Path | None:
    root = Path(ckpt_root)
    ptr = root / "latest"
    if ptr.is_file():
        p = root / ptr.read_text().strip()
        if (p / "trainer.json").is_file():
            return p
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def clean_stale(ckpt_root: str | os.PathLike) -> None:
    """Remove temporary directories left by a crash during a save."""
    root = Path(ckpt_root)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".") and ".tmp-" in p.name:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def verify_checkpoint(path: str | os.PathLike) -> str | None:
    """None if checkpoint `path` is whole (its files have the sizes and CRC-32 recorded at save), else what is
    wrong, naming the file. Checkpoints written before the record existed only need their files present."""
    p = Path(path)
    meta = p / "trainer.json"
    try:
        state = json.loads(meta.read_text())
    except FileNotFoundError:
        return f"{meta}: missing"
    except (OSError, ValueError) as e:
        return f"{meta}: unreadable ({type(e).__name__}: {e})"
    if not isinstance(state, dict):
        return f"{meta}: expected a JSON object, found {type(state).__name__}"
    files = state.get("files")
    if files is None:  # written before sizes and hashes were recorded
        missing = [p / f for f in DATA_FILES if not (p / f).is_file()]
        return f"{missing[0]}: missing" if missing else None
    if not isinstance(files, dict):
        return f"{meta}: 'files' must map file names to their size and CRC-32"
    for name in DATA_FILES:
        f, want = p / name, files.get(name)
        if not isinstance(want, dict) or not {"bytes", "crc32"} <= set(want):
            return f"{meta}: no size and CRC-32 recorded for {name}"
        if not f.is_file():
            return f"{f}: missing"
        size = f.stat().st_size
        if size != want["bytes"]:
            return f"{f}: {size} bytes, {want['bytes']} recorded at save"
        if _crc32(f) != want["crc32"]:
            return f"{f}: CRC-32 differs from the one recorded at save"
    return None


def _free_name(p: Path) -> Path:
    i = 1
    q = p
    while q.exists():
        q, i = p.with_name(f"{p.name}.{i}"), i + 1
    return q


def select_resume(ckpt_root: str | os.PathLike) -> Path | None:
    """The newest checkpoint under `ckpt_root` that verifies (`latest` then points to it), or None if there is
    none at all.

    Newer ones that fail are renamed `<name>.corrupt` (out of the resume order, and out of keep_last's reach,
    which must never prune a good checkpoint in their favour) with one line each on stderr. If checkpoints
    exist but none verifies: ValueError naming the damaged file."""
    root = Path(ckpt_root)
    found = sorted(
        (p for p in root.iterdir() if p.is_dir() and STEP_RE.match(p.name)) if root.is_dir() else [],
        key=lambda p: int(STEP_RE.match(p.name).group(1)),
        reverse=True,
    )
    bad = []
    for p in found:
        why = verify_checkpoint(p)
        if why is None:
            for q, reason in bad:
                aside = _free_name(q.with_name(q.name + ".corrupt"))
                q.rename(aside)
                print(
                    f"checkpoint {q.name} is damaged ({reason}); moved it to {aside.name} and resuming "
                    f"from {p.name}",
                    file=sys.stderr,
                    flush=True,
                )
            if latest_checkpoint(root) != p:
                _point_latest(root, p.name)
            return p
        bad.append((p, why))
    if bad:
        more = f" (and {len(bad) - 1} older checkpoint(s) failed too)" if len(bad) > 1 else ""
        raise ValueError(
            f"cannot resume: no checkpoint in {root} verifies: {bad[0][1]}{more}; "
            "set resume: never (--resume never) to start over"
        )
    return None


def load_checkpoint(
    path: str | os.PathLike, verify: bool = True
) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(model state, {"optimizer", "scheduler"}, trainer state) of a checkpoint; restores RNG states.

    A checkpoint that does not verify (skip with verify=False where `select_resume` just did) or cannot be read
    raises ValueError naming the file."""
    from safetensors import safe_open

    p = Path(path)
    if not (p / "trainer.json").is_file():
        raise FileNotFoundError(f"{p}: not a complete checkpoint (trainer.json missing)")
    why = verify_checkpoint(p) if verify else None
    if why is not None:
        raise ValueError(f"cannot resume from {p}: {why}")
    f = p / "model.safetensors"
    try:
        with safe_open(str(f), "pt") as st:
            sd = {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118 (safe_open has no items())
            aliases = json.loads((st.metadata() or {}).get("aliases", "{}"))
        for k, src in aliases.items():
            sd[k] = sd[src]
        f = p / "optim.pt"
        optim = torch.load(f, map_location="cpu", weights_only=True)
        f = p / "trainer.json"
        state = json.loads(f.read_text())
        f = p / "rng.pt"
        rng_t = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors, pickle and zip errors have no common base
        first = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(
            f"cannot resume from {p}: {f.name} is unreadable ({type(e).__name__}: {first})"
        ) from e
    set_rng_state(rng_t, state.get("rng", {}))
    return sd, optim, state
