"""`bitnet convert` and `bitnet quantize` as library functions.

convert(src, out, to="hf"|"gguf"|"onnx"): any readable model (HF directory, GGUF file) to another format,
lossless where the target allows it (TQ1_0/TQ2_0 round each scale to fp16; I2_S and HF are exact).
quantize(src, out): a full-precision model (LLaMA-family HF directory or GGUF of any quant type) ternarized
post-training with absmean. Outputs are never overwritten without force=True and never left half-written.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

TARGETS = ("hf", "gguf", "onnx")
PTQ_WARNING = (
    "warning: post-training absmean ternarization of a full-precision model destroys most of its quality "
    "(SmolLM2-135M: perplexity 30.7 -> ~3e7). Use `bitnet train` distillation (quantization-aware training) "
    "to recover it."
)


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise FileExistsError(f"{out}: already exists; pass --force to overwrite it")
    if not out.parent.exists():
        raise FileNotFoundError(f"{out.parent}: output directory does not exist")


def source_kind(src: Path) -> str:
    if src.is_file():
        with open(src, "rb") as fh:
            magic = fh.read(4)
        if magic == b"GGUF":
            return "gguf"
        if src.suffix == ".onnx":
            raise ValueError(f"{src}: ONNX models can be exported but not read back; convert from HF or GGUF")
        raise ValueError(f"{src}: not a GGUF file (magic {magic!r}) and not a model directory")
    if src.is_dir():
        if (src / "config.json").is_file():
            return "hf"
        raise ValueError(f"{src}: directory has no config.json (not an HF model directory)")
    raise FileNotFoundError(f"{src}: no such file or directory")


def load_source(src: str | os.PathLike, mode: str = "infer"):
    """(model on CPU, tokenizer files {name: text} or {}) from an HF directory or GGUF file."""
    src = Path(src)
    kind = source_kind(src)
    if kind == "gguf":
        from bitnetlm.formats.gguf import load_gguf_model
        from bitnetlm.formats.gguf_file import read_gguf
        from bitnetlm.formats.gguf_tokenizer import tokenizer_files_from_gguf

        model = load_gguf_model(src, mode=mode)
        meta = read_gguf(src).metadata
        files = tokenizer_files_from_gguf(meta, str(src)) if "tokenizer.ggml.tokens" in meta else {}
        return model, files
    from bitnetlm.formats.native import load_native

    model = load_native(src, mode=mode)
    files = {}
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (src / name).is_file():
            files[name] = (src / name).read_text(encoding="utf-8")
    return model, files


def _write_tokenizer_dir(files: dict[str, str], d: Path) -> Path | None:
    if "tokenizer.json" not in files:
        return None
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name).write_text(text, encoding="utf-8")
    return d


def lossless_dtype(model) -> torch.dtype | None:
    """bfloat16 or float16 if every float tensor of `model` survives that cast exactly (e.g. loaded from a bf16
    checkpoint into float32), else None (keep float32): conversions must not double the file size or lose bits."""
    tensors = [p.detach() for p in model.parameters() if p.is_floating_point()]
    for dt in (torch.bfloat16, torch.float16):
        if all(t.dtype == dt or torch.equal(t.to(dt).to(t.dtype), t) for t in tensors):
            return dt
    return None


def save_model(
    model,
    out: Path,
    to: str,
    tok_files: dict[str, str],
    qtype: str = "tq2_0",
    force: bool = False,
    storage: str = "2bit",
    embed_type: str = "auto",
    gguf_arch: str | None = None,
) -> Path:
    import tempfile

    if to == "hf":
        from bitnetlm.formats.native import save_native

        return save_native(
            model, out, tok_files=tok_files, overwrite=force, storage=storage, dtype=lossless_dtype(model)
        )
    if to == "gguf":
        from bitnetlm.formats.gguf import save_gguf

        with tempfile.TemporaryDirectory() as td:
            tok = _write_tokenizer_dir(tok_files, Path(td))
            return save_gguf(model, out, qtype, tokenizer=tok, arch_name=gguf_arch, embed_type=embed_type)
    if to == "onnx":
        from bitnetlm.formats.onnx_export import export_onnx

        return export_onnx(model, out)
    raise ValueError(f"unknown target format {to!r}; choose from {TARGETS}")


def convert(
    src: str | os.PathLike,
    out: str | os.PathLike,
    to: str = "hf",
    qtype: str | None = None,
    force: bool = False,
    storage: str = "2bit",
    embed_type: str = "auto",
    gguf_arch: str | None = None,
) -> Path:
    """Convert a model between formats; returns the output path."""
    out = Path(out)
    if to not in TARGETS:
        raise ValueError(f"--to must be one of {TARGETS}, got {to!r}")
    _check_out(out, force)
    model, tok_files = load_source(src)
    if model.config.quant != "ternary" and to == "gguf" and qtype is not None:
        raise ValueError(
            f"{src}: a full-precision model has no ternary weights to store as {qtype}; "
            "run `bitnet quantize` first (or omit --type to write a float GGUF)"
        )
    return save_model(model, out, to, tok_files, qtype or "tq2_0", force, storage, embed_type, gguf_arch)


def ternarize_model(model):
    """An inference-mode ternary copy of a full-precision model (absmean per matrix; embeddings/norms kept)."""
    from bitnetlm.formats.names import layer_modules
    from bitnetlm.models import build_model
    from bitnetlm.quant.bitlinear import BitLinear

    cfg = model.config.replace(quant="ternary", linear_class="autobitlinear", quantization_mode="offline")
    with torch.device("meta"):
        q = build_model(cfg, "infer")
    sd = {}
    for name, kind in layer_modules(cfg.num_hidden_layers, cfg.has_sub_norms):
        src_w = model.get_submodule(name).weight.detach().float().cpu()
        if kind == "proj":
            m = BitLinear.from_ternary(*_absmean(src_w))
            sd[name + ".packed"], sd[name + ".weight_scale"] = m.packed, m.weight_scale
        else:
            sd[name + ".weight"] = src_w
    if q.lm_head is not None:
        sd["lm_head.weight"] = model.lm_head.weight.detach().float().cpu()
    q.load_state_dict(sd, strict=True, assign=True)
    from bitnetlm.models.transformer import rope_inv_freq

    q.inv_freq = rope_inv_freq(cfg)
    return q.eval()


def _absmean(w: torch.Tensor):
    from bitnetlm.quant.ternary import ternarize

    return ternarize(w)


def quantize(
    src: str | os.PathLike,
    out: str | os.PathLike,
    to: str = "hf",
    qtype: str = "tq2_0",
    force: bool = False,
    quiet: bool = False,
) -> Path:
    """Post-training absmean ternarization of a full-precision model, written as `to` (hf or gguf)."""
    out = Path(out)
    _check_out(out, force)
    model, tok_files = load_source(src, mode="fp")
    if model.config.quant == "ternary":
        raise ValueError(f"{src}: already a ternary model; use `bitnet convert` to change its format")
    if not quiet:
        print(PTQ_WARNING, file=sys.stderr)
    q = ternarize_model(model)
    # embeddings as F16 in GGUF, as llama.cpp's converters write them (the ternarization is lossy anyway)
    return save_model(q, out, to, tok_files, qtype, force, embed_type="f16")


def describe(path: Path) -> str:
    return json.dumps({"path": str(path), "bytes": path.stat().st_size if path.is_file() else None})
