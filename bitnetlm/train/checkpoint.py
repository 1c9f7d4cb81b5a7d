"""Exact, atomic training checkpoints.

Layout: OUT/checkpoints/step_00000100/
  model.safetensors   full (unsharded) model state, fp32 latent weights; tied tensors stored once
  optim.pt            {"optimizer": ..., "scheduler": ...} (plain tensors/numbers: torch.load(weights_only=True))
  rng.pt              torch CPU (+ CUDA) generator states
  trainer.json        step, data position, early-stopping state, python/numpy RNG, config
OUT/checkpoints/latest  name of the newest complete checkpoint

A checkpoint is written into a hidden temporary directory, fsynced and renamed into place; only then
does `latest` move (os.replace). A crash at any point leaves the previous checkpoint intact and
pointed to; stale temporary directories are ignored and cleaned up.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

STEP_RE = re.compile(r"^step_(\d{8})$")


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
    mask = os.umask(0)
    os.umask(mask)
    tmp.chmod(0o777 & ~mask)  # mkdtemp makes 0700; checkpoints get the usual permissions
    try:
        tensors, aliases = _dedupe(model_state)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"aliases": json.dumps(aliases)})
        torch.save(optim_state, tmp / "optim.pt")
        rng_t, rng_js = rng_state()
        torch.save(rng_t, tmp / "rng.pt")
        state = {**trainer_state, "step": step, "rng": rng_js}
        (tmp / "trainer.json").write_text(json.dumps(state, indent=1))
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
    latest_tmp = root / f".latest.tmp-{os.getpid()}"
    latest_tmp.write_text(name + "\n")
    os.replace(latest_tmp, root / "latest")
    _fsync_dir(root)
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


def load_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(model state, {"optimizer", "scheduler"}, trainer state) of a checkpoint; restores RNG states."""
    from safetensors import safe_open

    p = Path(path)
    if not (p / "trainer.json").is_file():
        raise FileNotFoundError(f"{p}: not a complete checkpoint (trainer.json missing)")
    with safe_open(str(p / "model.safetensors"), "pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no items())
        aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
    for k, src in aliases.items():
        sd[k] = sd[src]
    optim = torch.load(p / "optim.pt", map_location="cpu", weights_only=True)
    state = json.loads((p / "trainer.json").read_text())
    rng_t = torch.load(p / "rng.pt", map_location="cpu", weights_only=True)
    set_rng_state(rng_t, state.get("rng", {}))
    return sd, optim, state
