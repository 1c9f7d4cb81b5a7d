"""`bitnetlm.load` / `bitnetlm.save`: from a path (or zoo name / Hub id) to a ready model and tokenizer."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from bitnetlm.kernels import prepare
from bitnetlm.runtime import configure
from bitnetlm.runtime.config import RuntimeConfig

# what only a local path looks like: a model file's extension, or a directory prefix / trailing separator
_FILE_SUFFIXES = (".gguf", ".onnx", ".safetensors", ".json", ".bin", ".pt", ".pth", ".yaml", ".yml")
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def is_local_path(name: str) -> bool:
    """Whether `name` can only mean a local path, never a zoo name or a Hub id (`owner/name`): `./m`, `m/`,
    `~/m`, `/abs/m`, `a/b/c`, `m.gguf`."""
    if name.startswith((".", "~", "/", os.sep)) or name.endswith(("/", os.sep)):
        return True
    if (os.sep != "/" and os.sep in name) or name.count("/") > 1:
        return True
    if "/" in name and not _HUB_ID.fullmatch(name):
        return True
    return name.lower().endswith(_FILE_SUFFIXES)


def resolve_path(name_or_path: str | os.PathLike) -> Path:
    """A local path for a model: an existing path, a zoo name, or a Hub repo id `owner/name` (downloaded when
    online). A missing path (`./m`, `m/`, `m.gguf`, ...) is a FileNotFoundError, never looked up on the Hub."""
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    name = str(name_or_path)
    if is_local_path(name):
        raise FileNotFoundError(f"{name}: no such file or directory")
    from bitnetlm import zoo

    return Path(zoo.resolve(name))


def load_model(
    path: str | os.PathLike, runtime: RuntimeConfig | None = None, *, mode: str = "infer", **options
):
    """Load a model (HF directory, GGUF or ONNX file) as `runtime` (or the RuntimeConfig fields in `options`: device,
    dtype, backend, head_dtype, kv_cache_dtype, threads, ...) says: on its device, kernels prepared, the CPU's
    compact head and threads applied. The options are kept for the model's later calls (`runtime.configure`).

    On CUDA the model keeps its float head and head_dtype="int8" picks the CUDA-graph engine's int8 LM head; on
    the CPU head_dtype "bf16" / "int8" changes the model's own embedding + head storage (inference only)."""
    cfg = _config(runtime, options)
    p = resolve_path(path)
    device, dtype = cfg.torch_device, cfg.torch_dtype if cfg.dtype or mode != "train" else torch.float32
    config = None
    if p.is_file() and p.suffix == ".gguf":
        from bitnetlm.formats import gguf

        read = lambda: gguf.load_gguf_model(p, mode=mode, dtype=dtype)
    elif p.is_dir() and _is_encoder_dir(p):
        from bitnetlm.formats.hf_bert import load_bert_hf

        if cfg.head_dtype is not None:
            raise ValueError(f"{p}: head_dtype applies to language models; an encoder has no LM head")
        read = lambda: load_bert_hf(p, mode=mode, dtype=dtype)
    elif p.is_dir():
        from bitnetlm.formats.hf import read_config
        from bitnetlm.formats.native import load_native  # plain HF dirs too; zero-copy for packed ones

        if (p / "config.json").is_file():
            config = read_config(p)
        read = lambda: load_native(p, mode=mode, dtype=dtype)
    elif p.is_file() and p.suffix == ".onnx":
        from bitnetlm.formats.onnx_import import load_onnx_model

        read = lambda: load_onnx_model(p, mode=mode, dtype=dtype)
    else:
        raise ValueError(f"{p}: not a model directory (config.json + safetensors), a .gguf or an .onnx file")
    if (
        mode != "train" and device.type == "cuda"
    ):  # CUDA context, first kernels, compiler keys: beside the read
        from bitnetlm.runtime.cuda import warm

        warm.start(device, cfg.backend or os.environ.get("BITNETLM_BACKEND") or "triton", dtype, config)
    model = read()
    if p.is_dir():
        from bitnetlm import embedding

        embedding.configure(model, embedding.read_spec(p, isinstance(model, embedding.Encoder)))
    if mode == "train":
        return model.to(device)
    model = prepare(model, device, cfg.backend)
    if device.type == "cuda":
        from bitnetlm.runtime.cuda import warm

        warm.join()
    elif device.type == "cpu":
        from bitnetlm.runtime import cpu

        cpu.apply(model, cfg)
    configure(model, cfg.replace(device=str(device)))
    return model


def _is_encoder_dir(p: Path) -> bool:
    """Whether directory `p` holds a BERT-family encoder (its config.json says so)."""
    import json

    from bitnetlm.formats.hf_bert import is_encoder_config

    f = p / "config.json"
    if not f.is_file():
        return False
    try:
        raw = json.loads(f.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return False  # the decoder path reports the bad file
    return isinstance(raw, dict) and is_encoder_config(raw)


def _config(runtime: RuntimeConfig | None, options: dict) -> RuntimeConfig:
    if runtime is None:
        return RuntimeConfig(**options)
    return runtime.replace(**options) if options else runtime


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer stored with a model (tokenizer.json + tokenizer_config.json, or GGUF metadata); None if absent."""
    p = resolve_path(path)
    if p.is_file() and p.suffix == ".gguf":
        from bitnetlm.formats import gguf

        return gguf.load_gguf_tokenizer(p)
    if p.is_file() and p.suffix == ".onnx":
        p = p.parent  # an ONNX graph holds no tokenizer: the one beside it, as ONNX model directories have
    if (p / "tokenizer.json").is_file():
        from bitnetlm.text.tokenizer import Tokenizer

        return Tokenizer.from_dir(p)
    return None


def load(path: str | os.PathLike, runtime: RuntimeConfig | None = None, *, mode: str = "infer", **options):
    """(model, tokenizer) for `path` (a directory, .gguf or .onnx file, or zoo name); tokenizer is None if the
    checkpoint has none (an .onnx file's: tokenizer.json beside it). Runtime options as `load_model` takes them
    (device="auto", kv_cache_dtype="fp8", ...)."""
    return load_model(path, runtime, mode=mode, **options), load_tokenizer(path)


def default_model_name(name: str | None) -> str:
    """`name`, or the zoo's default model when it is None."""
    if name:
        return str(name)
    from bitnetlm import zoo

    return zoo.DEFAULT_MODEL


def load_for_generation(name: str | os.PathLike | None, runtime: RuntimeConfig | None = None, **options):
    """(model, tokenizer) ready to generate: the zoo's default model when `name` is None, in eval mode, with a
    clear error when the checkpoint has no tokenizer."""
    name = default_model_name(name)
    model, tok = load(name, runtime, **options)
    if tok is None:
        beside = "the .onnx file" if str(name).endswith(".onnx") else "config.json"
        raise FileNotFoundError(f"{name}: the model has no tokenizer (tokenizer.json next to {beside})")
    return model.eval(), tok


def load_speculative(spec, runtime: RuntimeConfig | None, tokenizer):
    """`spec` (a SpeculativeConfig or None) with its draft model loaded where it names one (`load_draft`)."""
    if spec is None or not isinstance(spec.draft, (str, os.PathLike)):
        return spec
    return spec.replace(draft=load_draft(spec.draft, runtime, tokenizer))


def load_draft(name: str | os.PathLike, runtime: RuntimeConfig | None, tokenizer):
    """A draft model for speculative decoding: loaded as the target is (`runtime`), and refused unless its
    tokenizer is the target's `tokenizer` (token ids must mean the same text in both)."""
    model, tok = load_for_generation(name, runtime)
    if tok is not None and tokenizer is not None and tok.backend.get_vocab() != tokenizer.backend.get_vocab():
        raise ValueError(
            f"--draft-model {name}: its tokenizer differs from the target model's ({tok.vocab_size} vs "
            f"{tokenizer.vocab_size} tokens, or the same count with other ids); a draft model must share the "
            "target's tokenizer"
        )
    return model


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
