"""Export a trained model in the packed inference format (loads back with `bitnetlm.load`)."""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from bitnetlm.train.qat import convert_


def inference_copy(model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """A CPU fp32 copy of `model` with every training BitLinear converted to a packed inference layer.

    state_dict: the full (unsharded) weights, needed when `model` is sharded with FSDP2.
    """
    sharded = any(type(p).__name__ == "DTensor" for p in model.parameters())
    if sharded:
        from bitnetlm.models import build_model
        from bitnetlm.models.transformer import CausalLM

        if not isinstance(model, CausalLM) or state_dict is None:
            raise ValueError("exporting an FSDP-sharded model needs our CausalLM and its full state dict")
        cfg = model.config
        copy_ = build_model(cfg, mode="train" if cfg.quant == "ternary" else "fp")
        copy_.load_state_dict(state_dict, strict=True)
    else:
        copy_ = copy.deepcopy(model).cpu().float()
        if state_dict is not None:
            copy_.load_state_dict(state_dict, strict=True)
    return convert_(copy_.cpu().float().eval())


def export_model(
    model: nn.Module,
    out_dir: str | os.PathLike,
    state_dict: dict[str, torch.Tensor] | None = None,
    tokenizer_dir: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `model` (our CausalLM, training or inference mode) with `bitnetlm.save`, replacing out_dir.

    tokenizer_dir: a directory with tokenizer.json (e.g. the prepared data directory) saved alongside.
    dtype: dtype of the floating-point tensors (embeddings, norms); default keeps fp32.
    """
    from bitnetlm.loading import save

    inf = inference_copy(model, state_dict)
    out = Path(save(inf, out_dir, dtype=dtype, overwrite=True))
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            src = Path(tokenizer_dir) / name
            if src.is_file():
                tmp = out / (name + ".tmp")
                shutil.copyfile(src, tmp)
                os.replace(tmp, out / name)
    return out
