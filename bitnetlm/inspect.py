"""`bitnet inspect`: what a checkpoint is (architecture, parameters, bits per weight, file layout)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from bitnetlm.formats.hf import check_layer_count, read_config, safetensors_files
from bitnetlm.formats.safetensors_header import read_header


def inspect_hf(path: Path) -> dict:
    from bitnetlm.loading import _is_encoder_dir

    encoder = _is_encoder_dir(path)
    if encoder:
        from bitnetlm.formats.hf_bert import read_encoder_config

        cfg = read_encoder_config(path)
    else:
        cfg = read_config(path)
    files = safetensors_files(path)
    headers = [read_header(f) for f in files]  # validated: a corrupt file is a one-line error naming it
    src = str(files[0] if len(files) == 1 else path)
    if not encoder:
        check_layer_count(cfg, [k for h in headers for k in h.tensors], src)
    tensors = []
    ternary_params = 0
    ternary_bytes = 0
    layout = None
    for f, h in zip(files, headers):
        layout = layout or h.metadata.get("bitnetlm_layout")
        for k, e in sorted(h.tensors.items()):
            tensors.append({"name": k, "dtype": e.dtype, "shape": list(e.shape), "file": f.name})
            if e.dtype == "U8" and k.endswith(".weight"):
                ternary_params += e.numel * (5 if layout == "base3-5" else 4)  # trits per byte
                ternary_bytes += e.numel
    total_bytes = sum(f.stat().st_size for f in files)
    n_params = cfg.num_parameters()
    return {
        "path": str(path),
        "format": "hf-safetensors",
        "architecture": cfg.arch,
        "quantization": cfg.quant
        if cfg.quant == "none"
        else f"ternary ({cfg.linear_class}, {cfg.quantization_mode})",
        "layout": layout or ("hf-2bit" if ternary_params else None),
        "config": {k: v for k, v in cfg.to_hf().items() if not isinstance(v, dict)},
        "parameters": n_params,
        "ternary_parameters": ternary_params,
        "bits_per_ternary_weight": (8 * ternary_bytes / ternary_params) if ternary_params else None,
        "bits_per_weight_overall": 8 * total_bytes / max(n_params, 1),
        "file_bytes": total_bytes,
        "files": [f.name for f in files],
        "tensors": tensors,
    }


def inspect_path(path: str | os.PathLike) -> dict:
    """A dict describing the checkpoint at `path` (HF directory, .gguf or .onnx file, zoo name or Hub id)."""
    from bitnetlm.loading import resolve_path

    p = resolve_path(path)
    if p.is_dir():
        return inspect_hf(p)
    if p.is_file() and p.suffix == ".gguf":
        from bitnetlm.formats import gguf

        return gguf.inspect_gguf(p)
    if p.is_file() and p.suffix == ".onnx":
        from bitnetlm.formats import onnx_export

        return onnx_export.inspect_onnx(p)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or directory")
    raise ValueError(f"{p}: unknown checkpoint type (expected an HF directory, a .gguf or an .onnx file)")


def format_report(info: dict, show_tensors: bool = True) -> str:
    lines = [f"# {info['path']}", ""]
    for key in (
        "format",
        "architecture",
        "quantization",
        "layout",
        "parameters",
        "ternary_parameters",
        "bits_per_ternary_weight",
        "bits_per_weight_overall",
        "file_bytes",
    ):
        if key in info and info[key] is not None:
            v = info[key]
            v = f"{v:,}" if isinstance(v, int) else (f"{v:.3f}" if isinstance(v, float) else v)
            lines.append(f"{key:>24}: {v}")
    if info.get("config"):
        lines.append("")
        lines.append("config: " + json.dumps(info["config"]))
    if show_tensors and info.get("tensors"):
        lines += ["", "| tensor | dtype | shape |", "|---|---|---|"]
        lines += [f"| {t['name']} | {t['dtype']} | {t['shape']} |" for t in info["tensors"]]
    return "\n".join(lines)
