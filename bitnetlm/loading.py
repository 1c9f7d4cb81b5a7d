"""`bitnetlm.load` / `bitnetlm.save`: from a path (or zoo name / Hub id) to a ready model and tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from bitnetlm.kernels import prepare, warm_up_async


def resolve_path(name_or_path: str | os.PathLike) -> Path:
    """A local path for a model: an existing path, a zoo name, or a Hub repo id (downloaded when online)."""
    p = Path(name_or_path)
    if p.exists():
        return p
    try:
        from bitnetlm import zoo
    except ImportError:
        zoo = None
    if zoo is not None and hasattr(zoo, "resolve"):
        return Path(zoo.resolve(str(name_or_path)))
    raise FileNotFoundError(f"{name_or_path}: no such file or directory")


def load_model(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    backend: str | None = None,
    mode: str = "infer",
    head_dtype: str | None = None,
):
    """Load a model (HF directory or GGUF file), move it to `device` and prepare its kernels.

    head_dtype "bf16" / "int8": keep the embedding + LM head in that storage (kernels.cpu.head), inference only.
    On CUDA the model keeps its float head and `head_dtype` picks the CUDA-graph engine's LM head instead
    (`model.head_dtype`; "int8": per-row int8 weights, `EngineConfig.head`); the eager path uses the float head.
    """
    p = resolve_path(path)
    dtype = dtype or torch.float32
    config = None
    if p.is_file() and p.suffix == ".gguf":
        from bitnetlm.formats import gguf

        read = lambda: gguf.load_gguf_model(p, mode=mode, dtype=dtype)
    elif p.is_dir():
        from bitnetlm.formats.hf import read_config
        from bitnetlm.formats.native import load_native  # plain HF dirs too; zero-copy for packed ones

        if (p / "config.json").is_file():
            config = read_config(p)
        read = lambda: load_native(p, mode=mode, dtype=dtype)
    else:
        raise ValueError(f"{p}: not a model directory (config.json + safetensors) or a .gguf file")
    if mode != "train":  # CUDA context, first kernels, compiler keys: in threads beside the read
        warm_up_async(device, backend, dtype, config)  # (started after our imports: no import-lock waits)
    model = read()
    if mode == "train":
        return model.to(device)
    model = prepare(model, device, backend)
    if head_dtype and torch.device(device).type == "cuda":
        from bitnetlm.kernels.cpu.head import HEAD_DTYPES

        if head_dtype not in HEAD_DTYPES:
            raise ValueError(f"head_dtype must be one of {HEAD_DTYPES}, got {head_dtype!r}")
        model.head_dtype = head_dtype  # read by generate.graph.engine_config
    elif head_dtype:
        from bitnetlm.kernels.cpu.head import set_head_dtype

        set_head_dtype(model, head_dtype)
    return model


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer stored with a model (tokenizer.json + tokenizer_config.json, or GGUF metadata); None if absent."""
    p = resolve_path(path)
    if p.is_file() and p.suffix == ".gguf":
        from bitnetlm.formats import gguf

        return gguf.load_gguf_tokenizer(p)
    if (p / "tokenizer.json").is_file():
        from bitnetlm.generate.tokenizer import Tokenizer

        return Tokenizer.from_dir(p)
    return None


def load(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    backend: str | None = None,
    mode: str = "infer",
    head_dtype: str | None = None,
):
    """(model, tokenizer) for `path`; tokenizer is None if the checkpoint has none."""
    return load_model(path, device, dtype, backend, mode, head_dtype), load_tokenizer(path)


def save(
    model,
    out_dir: str | os.PathLike,
    tokenizer=None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
):
    """Write `model` as a transformers-loadable HF directory (offline packed ternary layout)."""
    from bitnetlm.formats.hf import save_hf

    return save_hf(model, out_dir, tokenizer=tokenizer, dtype=dtype, overwrite=overwrite)
