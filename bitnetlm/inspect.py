"""`bitnet inspect`: what a checkpoint is (architecture, parameters, bits per weight, file layout)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors import safe_open

from bitnetlm.formats.hf import read_config, safetensors_files


def inspect_hf(path: Path) -> dict:
    cfg = read_config(path)
    files = safetensors_files(path)
    tensors = []
    ternary_params = 0
    ternary_bytes = 0
    other_params = 0
    layout = None
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            meta = h.metadata() or {}
            layout = layout or meta.get("bitnetlm_layout")
            for k in h.keys():
                sl = h.get_slice(k)
                shape = list(sl.get_shape())
                dtype = sl.get_dtype()
                n = 1
                for d in shape:
                    n *= d
                tensors.append({"name": k, "dtype": dtype, "shape": shape, "file": f.name})
                if dtype == "U8" and k.endswith(".weight"):
                    ternary_params += n * (5 if layout == "base3-5" else 4)  # trits per byte
                    ternary_bytes += n
                elif not k.endswith("weight_scale"):
                    other_params += n
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
    """A dict describing the checkpoint at `path` (HF directory, .gguf or .onnx file)."""
    p = Path(path)
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
