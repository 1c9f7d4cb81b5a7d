"""`bitnet convert` and `bitnet quantize` as library functions.

convert(src, out, to="hf"|"gguf"|"onnx"): any readable model (HF directory, GGUF file) to another format,
lossless where the target allows it (TQ1_0/TQ2_0 round each scale to fp16; I2_S and HF are exact).
quantize(src, out): a full-precision model (LLaMA-family HF directory or GGUF of any quant type) ternarized
post-training with absmean. Outputs are never overwritten without force=True and never left half-written.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

import torch

from bitnetlm import deps, progress
from bitnetlm.loading import resolve_path

TARGETS = ("hf", "gguf", "onnx")
_EXTENSIONS = {".gguf": "gguf", ".onnx": "onnx"}
# file extensions that an HF model directory's name must not carry (it would look like, but not be, that file)
_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".json")
_TARGET_NEEDS = {"gguf": ("gguf", "writing GGUF files"), "onnx": ("onnx", "ONNX export")}
PTQ_WARNING = (
    "warning: post-training absmean ternarization of a full-precision model destroys most of its quality "
    "(SmolLM2-135M: perplexity 30.7 -> ~3e7). Use `bitnet train` distillation (quantization-aware training) "
    "to recover it."
)


def _check_out(out: Path, force: bool, to: str) -> None:
    """Fail before any work: an output that exists, a directory that is missing or refuses writes, a missing
    package for `to`."""
    if to in _TARGET_NEEDS:
        deps.require(*_TARGET_NEEDS[to])
    if out.exists() and not force:
        raise FileExistsError(f"{out}: already exists; pass --force to overwrite it")
    parent = out.parent
    if not parent.is_dir():
        raise FileNotFoundError(f"{parent}: output directory does not exist")
    try:  # the writers put a temporary beside the output: probe that very thing (root ignores mode bits)
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise OSError(e.errno, f"cannot write into {parent} ({e.strerror or e})", str(out)) from None


def source_kind(src: Path) -> str:
    if src.is_file():
        with open(src, "rb") as fh:
            magic = fh.read(4)
        if magic == b"GGUF":
            return "gguf"
        if src.suffix == ".onnx":
            return "onnx"
        raise ValueError(f"{src}: not a GGUF file (magic {magic!r}), an .onnx file or a model directory")
    if src.is_dir():
        if (src / "config.json").is_file():
            return "hf"
        raise ValueError(f"{src}: directory has no config.json (not an HF model directory)")
    raise FileNotFoundError(f"{src}: no such file or directory")


def infer_target(out: str | os.PathLike, allowed: tuple[str, ...] = TARGETS, to: str | None = None) -> str:
    """The format to write `out` as: `to`, else the one its extension names (.gguf -> gguf, .onnx -> onnx,
    anything else an HF directory). An extension naming another format than `to`, or a file's extension for an
    HF model (a directory, as transformers' save_pretrained writes it), is refused."""
    out = Path(out)
    suffix = out.suffix.lower()
    named = _EXTENSIONS.get(suffix)
    target = to or named or "hf"
    if target not in allowed:
        raise ValueError(
            f"{out}: writing {target} is not supported here (choose one of {', '.join(allowed)})"
        )
    if named is not None and named != target:
        raise ValueError(f"{out}: the extension {suffix} names a {named.upper()} file, but --to is {target}")
    if target == "hf" and suffix in _FILE_SUFFIXES:
        raise ValueError(
            f"{out}: an HF model is a directory (config.json, model.safetensors, tokenizer files), not a "
            f"{suffix} file; give a directory name, e.g. {str(out.with_suffix(''))!r}"
        )
    return target


def source_config(src: str | os.PathLike):
    """The ModelConfig of a model from its header alone (GGUF metadata, or config.json): no tensor is read."""
    src = Path(src)
    if source_kind(src) == "gguf":
        deps.require("gguf", "reading GGUF files")
        from bitnetlm.formats.gguf import config_from_gguf
        from bitnetlm.formats.gguf_file import read_gguf

        with read_gguf(src) as f:
            return config_from_gguf(f)
    if source_kind(src) == "onnx":
        from bitnetlm.formats.onnx_import import config_from_onnx

        return config_from_onnx(src)
    from bitnetlm.formats.hf import read_config

    return read_config(src)


def _fits(qtype: str, out_features: int, in_features: int) -> bool:
    if qtype == "i2_s":  # one tensor-wide scale over 128-value blocks of the flattened matrix
        return out_features * in_features % 128 == 0
    return in_features % 256 == 0  # TQ1_0 / TQ2_0: 256-value blocks along each row


def gguf_plan(cfg, qtype: str | None = None) -> tuple[str, list[str]]:
    """(the ternary GGUF type, the projections that cannot be stored in it) from the shapes alone.

    qtype None or "auto": TQ2_0 if every projection fits it (llama.cpp loads it), else I2_S if every one fits
    that (bitnet.cpp loads it), else whichever of the two leaves fewer out. A projection that does not fit is
    stored as F16 T*s (the ternary values exact, the scale rounded to fp16 as the TQ types round it), per
    tensor as llama.cpp's quantizer falls back; a type that fits none of them is refused."""
    from bitnetlm.formats.names import model_modules
    from bitnetlm.models import build_model

    with torch.device("meta"):
        model = build_model(cfg, "infer")
    shapes = {}
    for name, kind in model_modules(cfg):
        if kind == "proj":
            m = model.get_submodule(name)
            shapes[name] = (m.out_features, m.in_features)

    def misfits(q: str) -> list[str]:
        return [n for n, (o, i) in shapes.items() if not _fits(q, o, i)]

    if qtype in (None, "auto"):
        qtype = min(("tq2_0", "i2_s"), key=lambda q: len(misfits(q)))  # a tie keeps tq2_0
    if qtype not in ("tq1_0", "tq2_0", "i2_s"):
        raise ValueError(f"--type must be auto, tq1_0, tq2_0 or i2_s, got {qtype!r}")
    bad = misfits(qtype)
    if bad and len(bad) == len(shapes):  # nothing of that type would be left: refuse rather than write floats
        rows = sorted({shapes[n][1] for n in bad})
        need = (
            "a multiple of 128 values per matrix" if qtype == "i2_s" else "each row a multiple of 256 values"
        )
        hint = "; --type i2_s fits" if qtype != "i2_s" and not misfits("i2_s") else ""
        raise ValueError(
            f"{qtype.upper()} cannot hold any projection of this model (rows of {'/'.join(map(str, rows))} "
            f"values; it needs {need}){hint}"
        )
    return qtype, bad


def _gguf_type(cfg, qtype: str | None) -> str:
    """gguf_plan's type for `cfg`, with one note on stderr when some projections fall back to F16."""
    from bitnetlm.formats.names import model_modules

    qtype, fallback = gguf_plan(cfg, qtype)
    n_proj = sum(kind == "proj" for _, kind in model_modules(cfg))
    if fallback:
        hint = " (--type i2_s fits them all)" if qtype != "i2_s" and not gguf_plan(cfg, "i2_s")[1] else ""
        print(
            f"note: {len(fallback)} of {n_proj} projections have rows that {qtype.upper()} "
            f"cannot hold (it needs multiples of {128 if qtype == 'i2_s' else 256} values): they are stored as "
            f"F16 with exact ternary values, as llama.cpp falls back per tensor{hint}",
            file=sys.stderr,
        )
    return qtype


def float_fallback_(model, names: list[str]):
    """Replace the ternary projections `names` of `model` by nn.Linear holding T*s, in place (for GGUF tensors
    that cannot hold the ternary type: the writer stores them as floats, the reader finds the ternary values)."""
    from bitnetlm.quant.ternary import ternarize

    for name in names:
        m = model.get_submodule(name)
        if m.training_mode:
            t, s = ternarize(m.weight.detach().float())
        else:
            t, s = m.ternary_weight(), m.weight_scale
        lin = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        lin.weight = torch.nn.Parameter(t.float() * s.reshape(-1)[0].float(), requires_grad=False)
        if m.bias is not None:
            lin.bias = torch.nn.Parameter(m.bias.detach().float(), requires_grad=False)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, lin)
    return model


def load_source(src: str | os.PathLike, mode: str = "infer"):
    """(model on CPU, tokenizer files {name: text} or {}) from an HF directory, a GGUF or an ONNX file."""
    src = Path(src)
    kind = source_kind(src)
    if kind == "gguf":
        deps.require("gguf", "reading GGUF files")
        from bitnetlm.formats.gguf import load_gguf_model
        from bitnetlm.formats.gguf_file import read_gguf
        from bitnetlm.formats.gguf_tokenizer import tokenizer_files_from_gguf

        model = load_gguf_model(src, mode=mode)
        meta = read_gguf(src).metadata
        files = tokenizer_files_from_gguf(meta, str(src)) if "tokenizer.ggml.tokens" in meta else {}
        return model, files
    if kind == "onnx":
        from bitnetlm.formats.onnx_import import load_onnx_model

        model, src = load_onnx_model(src, mode=mode), src.parent  # (a tokenizer beside the file goes along)
    else:
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
    qtype: str | None = None,
    force: bool = False,
    storage: str = "2bit",
    embed_type: str = "auto",
    gguf_arch: str | None = None,
) -> Path:
    """Write `model` as `to` at `out`; a write the system refuses (a full disk, permissions) is an OSError (of the
    errno's kind) whose filename is `out` and whose text says so: the CLI prints `OUT: cannot write it (...)`."""
    try:
        return _write(model, out, to, tok_files, qtype, force, storage, embed_type, gguf_arch)
    except OSError as e:
        if isinstance(e, (FileExistsError, FileNotFoundError)):
            raise
        raise OSError(e.errno, f"cannot write it ({e.strerror or e})", str(out)) from None
    except Exception as e:
        from safetensors import SafetensorError

        if not isinstance(e, SafetensorError):
            raise
        io = re.search(r"I/O error: (.*?)(?: \(os error (\d+)\))?$", str(e))  # its Rust writer's OSError
        if io is None:
            raise
        code = int(io.group(2)) if io.group(2) else None
        raise OSError(code, f"cannot write it ({io.group(1)})", str(out)) from None


def _write(model, out, to, tok_files, qtype, force, storage, embed_type, gguf_arch) -> Path:
    if to == "hf":
        from bitnetlm.formats.native import save_native

        return save_native(
            model, out, tok_files=tok_files, overwrite=force, storage=storage, dtype=lossless_dtype(model)
        )
    if to == "gguf":
        from bitnetlm.formats.gguf import save_gguf

        if model.config.quant == "ternary":
            qtype, fallback = gguf_plan(model.config, qtype)
            float_fallback_(model, fallback)
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
    to: str | None = None,
    qtype: str | None = None,
    force: bool = False,
    storage: str = "2bit",
    embed_type: str = "auto",
    gguf_arch: str | None = None,
) -> Path:
    """Convert a model (a path, zoo name or Hub id) between formats (`to` defaults from the output's extension);
    returns the output path."""
    out = Path(out)
    to = infer_target(out, TARGETS, to)
    _check_out(out, force, to)
    name, src = src, resolve_path(src)
    if is_encoder(src):
        return _convert_encoder(name, src, out, to, qtype, force, embed_type)
    cfg = source_config(src)  # everything that can fail on the header fails before the tensors are read
    if to == "gguf" and cfg.quant == "ternary":
        qtype = _gguf_type(cfg, qtype)
    elif to == "gguf" and qtype not in (None, "auto"):
        raise ValueError(
            f"{name}: a full-precision model has no ternary weights to store as {qtype}; "
            "run `bitnet quantize` first (or omit --type to write a float GGUF)"
        )
    model, tok_files = load_source(src)
    return save_model(model, out, to, tok_files, qtype, force, storage, embed_type, gguf_arch)


def is_encoder(src: Path) -> bool:
    """Whether `src` (an HF directory or a GGUF file) holds a BERT-family encoder."""
    if source_kind(src) == "gguf":
        deps.require("gguf", "reading GGUF files")
        from bitnetlm.formats.gguf_file import read_gguf

        with read_gguf(src) as f:
            return f.metadata.get("general.architecture") == "bert"
    from bitnetlm.loading import _is_encoder_dir

    return _is_encoder_dir(src)


def _convert_encoder(name, src: Path, out: Path, to: str, qtype, force: bool, embed_type: str) -> Path:
    """An encoder between its HF (+ sentence-transformers) directory and a llama.cpp `bert` GGUF."""
    from bitnetlm.loading import load_tokenizer

    if to == "onnx":
        raise ValueError(f"{name}: ONNX export of an encoder is not supported (convert to hf or gguf)")
    if source_kind(src) == "gguf":
        from bitnetlm.formats.gguf import load_gguf_model

        model = load_gguf_model(src)
    else:
        from bitnetlm.formats.hf_bert import load_bert_hf

        model = load_bert_hf(src)
    tok = load_tokenizer(src)
    if to == "hf":
        from bitnetlm.formats.hf_bert import save_bert_hf

        return save_bert_hf(model, out, tokenizer=tok, overwrite=force)
    from bitnetlm.formats.gguf import save_gguf

    if model.config.quant != "ternary" and qtype not in (None, "auto"):
        raise ValueError(f"{name}: a full-precision model has no ternary weights to store as {qtype}")
    if qtype in (
        None,
        "auto",
    ):  # TQ2_0 needs rows of 256 values; I2_S any matrix of 128k values (MiniLM: 384)
        h, i = model.config.hidden_size, model.config.intermediate_size
        qtype = "tq2_0" if h % 256 == 0 and i % 256 == 0 else "i2_s"
    return save_gguf(model, out, qtype, tokenizer=tok, embed_type=embed_type)


def ternarize_model(model):
    """An inference-mode ternary copy of a full-precision model (absmean per matrix; embeddings/norms kept)."""
    from bitnetlm.formats.names import model_modules
    from bitnetlm.models import build_model
    from bitnetlm.quant.bitlinear import BitLinear

    cfg = model.config.replace(quant="ternary", linear_class="autobitlinear", quantization_mode="offline")
    with torch.device("meta"):
        q = build_model(cfg, "infer")
    sd = {}
    for name, kind in progress.bar(list(model_modules(cfg)), desc="ternarizing", unit="tensor"):
        src = model.get_submodule(name)
        src_w = src.weight.detach().float().cpu()
        if kind == "proj":
            m = BitLinear.from_ternary(*_absmean(src_w))
            sd[name + ".packed"], sd[name + ".weight_scale"] = m.packed, m.weight_scale
        else:
            sd[name + ".weight"] = src_w
        if getattr(src, "bias", None) is not None:
            sd[name + ".bias"] = src.bias.detach().float().cpu()
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
    to: str | None = None,
    qtype: str | None = None,
    force: bool = False,
    quiet: bool = False,
) -> Path:
    """Post-training absmean ternarization of a full-precision model, written as `to` (hf or gguf; default from
    the output's extension). qtype (GGUF): None/"auto" picks one that fits every projection (see gguf_plan)."""
    out = Path(out)
    to = infer_target(out, ("hf", "gguf"), to)
    _check_out(out, force, to)
    name, src = src, resolve_path(src)
    cfg = source_config(src)  # validated from the header, before the minutes of loading and ternarizing
    if cfg.quant == "ternary":
        raise ValueError(f"{name}: already a ternary model; use `bitnet convert` to change its format")
    if to == "gguf":
        qtype = _gguf_type(cfg.replace(quant="ternary"), qtype)
    if not quiet:
        print(PTQ_WARNING, file=sys.stderr)
    model, tok_files = load_source(src, mode="fp")
    q = ternarize_model(model)
    # embeddings as F16 in GGUF, as llama.cpp's converters write them (the ternarization is lossy anyway)
    return save_model(q, out, to, tok_files, qtype, force, embed_type="f16")


def describe(path: str | os.PathLike, to: str) -> dict:
    """What was written (for --json): path, format and bytes on disk (a directory's files summed)."""
    p = Path(path)
    files = [f for f in p.rglob("*") if f.is_file()] if p.is_dir() else [p]
    return {"path": str(p), "format": to, "bytes": sum(f.stat().st_size for f in files)}
