"""Our native format: an HF-compatible directory plus the layout/version metadata, and a denser distribution variant.

storage "2bit" (default): exactly what `formats.hf.save_hf` writes (transformers loads it): safetensors metadata
  `bitnetlm_format_version`, `bitnetlm_layout` = "hf-2bit".
storage "base3": each projection's `.weight` holds 5 trits per byte (1.6 bits/weight, `quant.packing.pack_base3`,
  flat uint8, row-major), `bitnetlm_layout` = "base3-5". 20% smaller than 2-bit; NOT loadable by transformers;
  decoded to the 2-bit layout at load (`load_native`, or `bitnet convert DIR OUT --to hf` to get a plain HF dir).
Loading maps the safetensors files into memory: packed ternary tensors are views of the file pages (zero-copy).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from bitnetlm import progress
from bitnetlm.formats import atomic
from bitnetlm.formats.safetensors_header import read_header
from bitnetlm.quant.packing import PackingFormat, pack_base3, pack_hf, unpack_base3

LAYOUT_KEY = "bitnetlm_layout"
VERSION_KEY = "bitnetlm_format_version"
STORAGES = ("2bit", "base3")

_ST_DTYPES = {
    "U8": torch.uint8,
    "I8": torch.int8,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
    "I16": torch.int16,
}


def mmap_safetensors(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors of a safetensors file as zero-copy views of a copy-on-write memory map, and its metadata.

    Pages are read from disk only when touched and shared with the page cache; writing to a tensor never
    modifies the file (copy-on-write). The header is validated first (`safetensors_header.read_header`). A
    tensor whose data does not start at a multiple of its element size (legal in safetensors) is copied.
    """
    header = read_header(path)
    mm = np.memmap(header.path, dtype=np.uint8, mode="c")
    out = {}
    for name, e in header.tensors.items():
        dtype = _ST_DTYPES.get(e.dtype)
        if dtype is None:
            raise ValueError(
                f"{header.path}: tensor {name!r} has dtype {e.dtype}; supported: {', '.join(_ST_DTYPES)}"
            )
        a, b = header.data_start + e.start, header.data_start + e.end
        buf = torch.from_numpy(mm[a:b])
        if a % dtype.itemsize:  # no kernel gets an unaligned pointer
            buf = buf.clone()
        out[name] = buf.view(dtype).reshape(e.shape)
    meta = dict(header.metadata)
    # the map's address range, so callers can verify zero-copy
    meta["_mmap_region"] = f"{mm.ctypes.data}:{header.file_size}"
    return out, meta


def file_layout(model_dir: str | os.PathLike) -> tuple[str, str | None]:
    """(layout, format version) recorded in a model directory's safetensors metadata ('hf-2bit' if absent)."""
    from bitnetlm.formats.hf import safetensors_files

    files = safetensors_files(Path(model_dir))
    meta = read_header(files[0]).metadata
    return meta.get(LAYOUT_KEY, PackingFormat.HF_2BIT.value), meta.get(VERSION_KEY)


def save_native(
    model,
    out_dir: str | os.PathLike,
    tok_files: dict[str, str] | None = None,
    overwrite: bool = False,
    storage: str = "2bit",
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `model` as our native directory (see module doc), atomically; tokenizer files copied verbatim."""
    if model.config.vocab_subset is not None:
        raise ValueError(
            f"{out_dir}: the native format has no reduced vocabulary (vocab_subset); use the HF format"
        )
    from bitnetlm.formats.hf import save_hf

    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
    out = Path(out_dir)
    if storage == "2bit":
        return save_hf(model, out, dtype=dtype, overwrite=overwrite, extra_files=tok_files or {})
    if model.config.quant != "ternary":
        raise ValueError("base3 storage needs a ternary model (quantize it first)")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out}: exists; pass overwrite=True (CLI: --force) to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic.temp_dir(out) as tmp:
        save_hf(model, tmp / "d", dtype=dtype, extra_files=tok_files or {})
        from safetensors.torch import load_file, save_file

        st = tmp / "d" / "model.safetensors"
        sd = load_file(str(st))
        from bitnetlm.formats.hf import read_config
        from bitnetlm.quant.packing import unpack_hf

        cfg = read_config(tmp / "d")
        for key in progress.bar(list(sd), desc="base-3 packing", unit="tensor"):
            if key.endswith(".weight") and sd[key].dtype == torch.uint8:
                n_out = _out_features(key, cfg)
                sd[key] = pack_base3(unpack_hf(sd[key], n_out))
        meta = {"format": "pt", VERSION_KEY: "1", LAYOUT_KEY: PackingFormat.BASE3.value}
        save_file(sd, str(st), metadata=meta)
        if out.exists():
            shutil.rmtree(out)
        atomic.commit(tmp / "d", out)
    return out


def _out_features(key: str, cfg) -> int:
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    for suffix, n in (
        ("q_proj", q),
        ("k_proj", kv),
        ("v_proj", kv),
        ("o_proj", cfg.hidden_size),
        ("gate_proj", cfg.intermediate_size),
        ("up_proj", cfg.intermediate_size),
        ("down_proj", cfg.hidden_size),
        ("attn.c_attn", 3 * cfg.hidden_size),  # GPT-2
        ("attn.c_proj", cfg.hidden_size),
        ("mlp.c_fc", cfg.intermediate_size),
        ("mlp.c_proj", cfg.hidden_size),
    ):
        if key.endswith(f"{suffix}.weight"):
            return n
    raise ValueError(f"tensor {key!r}: not a projection")


def _in_features(key: str, cfg) -> int:
    if key.endswith("o_proj.weight"):
        return cfg.num_attention_heads * cfg.head_dim
    if key.endswith(("down_proj.weight", "mlp.c_proj.weight")):
        return cfg.intermediate_size
    return cfg.hidden_size


def load_native(
    path: str | os.PathLike, mode: str = "infer", dtype: torch.dtype = torch.float32, mmap: bool = True
):
    """Load a native or plain HF directory. base3 storage is decoded to the 2-bit layout at load.

    Inference-mode loads of offline-packed autobitlinear checkpoints are zero-copy (`load_mmap`); every other
    variant goes through `formats.hf.load_hf`.
    """
    from bitnetlm.formats.hf import load_hf, read_config

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: model directory not found")
    read_config(path)  # a missing/invalid config.json is the first error to report
    layout, _ = file_layout(path)
    if layout == PackingFormat.HF_2BIT.value:
        if mmap and mode == "infer":
            model = load_mmap(path, dtype=dtype)
            if model is not None:
                return model
        return load_hf(path, mode=mode, dtype=dtype)
    if layout != PackingFormat.BASE3.value:
        raise ValueError(f"{path}: unknown {LAYOUT_KEY} {layout!r} (this version reads hf-2bit and base3-5)")
    # decode into a temporary plain 2-bit directory view: rewrite tensors in memory, then reuse load_hf
    from safetensors.torch import save_file

    from bitnetlm.formats.hf import read_config, safetensors_files

    cfg = read_config(path)
    with tempfile.TemporaryDirectory() as td:
        for name in os.listdir(path):
            if not name.endswith(".safetensors"):
                src = path / name
                if src.is_file():
                    shutil.copy(src, Path(td) / name)
        for f in safetensors_files(path):
            tensors, meta = mmap_safetensors(f)
            meta.pop("_mmap_region")
            sd = {}
            for key, t in tensors.items():
                if key.endswith(".weight") and t.dtype == torch.uint8 and t.dim() == 1:
                    n, k = _out_features(key, cfg), _in_features(key, cfg)
                    try:
                        sd[key] = pack_hf(unpack_base3(t, (n, k)))
                    except ValueError as e:
                        raise ValueError(f"{f}: tensor {key!r}: {e}") from e
                else:
                    sd[key] = t.clone()
            save_file(sd, str(Path(td) / f.name), metadata={**meta, LAYOUT_KEY: PackingFormat.HF_2BIT.value})
        return load_hf(td, mode=mode, dtype=dtype)


def _mmap_files(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str], list[tuple[int, int]]]:
    """Every safetensors file of the directory memory-mapped: (tensors, metadata, (address, bytes) of each map)."""
    from bitnetlm.formats.hf import safetensors_files

    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, str] = {}
    regions = []
    for f in safetensors_files(path):
        t, m = mmap_safetensors(f)
        start, size = m.pop("_mmap_region").split(":")
        regions.append((int(start), int(size)))
        tensors.update(t)
        meta.update(m)
    return tensors, meta, regions


def _mmap_state_dict(cfg, model, tensors: dict[str, torch.Tensor], src: str, dtype: torch.dtype):
    """The model's state dict over the mapped tensors (checked: shapes, scales, lm_head); None where the
    projections hold float master weights."""
    from bitnetlm.formats.hf import _expect
    from bitnetlm.formats.names import hf_name, layer_modules

    sd: dict[str, torch.Tensor] = {}
    floats = (torch.float32, torch.float16, torch.bfloat16)
    for name, kind in layer_modules(cfg.num_hidden_layers, cfg.has_sub_norms):
        key = hf_name(name, cfg.arch) + ".weight"
        if key not in tensors:
            raise ValueError(f"{src}: tensor {key!r} is missing from the checkpoint")
        w = tensors[key]
        module = model.get_submodule(name)
        if kind == "proj":
            if w.dtype != torch.uint8:
                return None  # float master weights: ternarized by load_hf
            _expect(key, w, ((module.out_features + 3) // 4, module.in_features), src)
            skey = key.removesuffix(".weight") + ".weight_scale"
            if skey not in tensors or tensors[skey].numel() != 1:
                raise ValueError(f"{src}: tensor {skey!r} must hold exactly one value")
            sd[name + ".packed"] = w
            sd[name + ".weight_scale"] = tensors[skey].reshape(1).to(torch.float32)
        else:
            _expect(key, w, tuple(module.weight.shape), src, floats)
            sd[name + ".weight"] = w.to(dtype)  # a view when the file already holds `dtype`
    if not cfg.tie_word_embeddings:
        w = tensors.get("lm_head.weight")
        if w is None:
            raise ValueError(f"{src}: tensor 'lm_head.weight' is missing (tie_word_embeddings is false)")
        _expect("lm_head.weight", w, (cfg.head_rows, cfg.hidden_size), src, floats)
        sd["lm_head.weight"] = w.to(dtype)
    return sd


def _check_unknown(cfg, sd: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], src: str) -> None:
    """Raises where the files hold tensors the model has no place for."""
    from bitnetlm.formats.hf import IGNORED_SUFFIXES
    from bitnetlm.formats.names import hf_name

    known = {hf_name(k.rsplit(".", 1)[0], cfg.arch) for k in sd} | {"lm_head"}
    unknown = [k for k in tensors if k.rsplit(".", 1)[0] not in known and not k.endswith(IGNORED_SUFFIXES)]
    if unknown:
        raise ValueError(f"{src}: unexpected tensors for a {cfg.arch} model: {unknown[:5]}")


def load_mmap(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """Zero-copy inference load of an offline-packed `autobitlinear` directory; None for other variants.

    Packed projections and their scales (and float tensors already in `dtype`) are views of copy-on-write
    memory maps of the safetensors files: nothing is read until used, and the page cache is shared between
    processes serving the same model. Tensors that need a dtype conversion are converted (copied).
    """
    from bitnetlm.formats.hf import check_layer_count, read_config
    from bitnetlm.models import build_empty_model
    from bitnetlm.models.transformer import rope_inv_freq
    from bitnetlm.quant.bitlinear import BitLinear

    path = Path(path)
    cfg = read_config(path)
    if cfg.quant != "ternary" or cfg.linear_class != "autobitlinear" or cfg.quantization_mode != "offline":
        return None
    if cfg.family != "llama":  # biases, transposed weights: load_hf reads these
        return None
    tensors, meta, regions = _mmap_files(path)
    src = str(path)
    check_layer_count(cfg, tensors, src)
    model = build_empty_model(cfg, "infer")
    sd = _mmap_state_dict(cfg, model, tensors, src, dtype)
    if sd is None:
        return None
    _check_unknown(cfg, sd, tensors, src)
    model.load_state_dict(sd, strict=True, assign=True)
    model.inv_freq = rope_inv_freq(cfg)
    for m in model.modules():
        if isinstance(m, BitLinear):
            m.layout = PackingFormat.HF_2BIT
    model.source_metadata = dict(meta)
    model.mmap_regions = regions  # (address, bytes) of the file maps the weights live in
    return model.eval()
