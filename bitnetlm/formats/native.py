"""Our native format: an HF-compatible directory plus the layout/version metadata, and a denser distribution variant.

storage "2bit" (default): exactly what `formats.hf.save_hf` writes (transformers loads it): safetensors metadata
  `bitnetlm_format_version`, `bitnetlm_layout` = "hf-2bit".
storage "base3": each projection's `.weight` holds 5 trits per byte (1.6 bits/weight, `quant.packing.pack_base3`,
  flat uint8, row-major), `bitnetlm_layout` = "base3-5". 20% smaller than 2-bit; NOT loadable by transformers;
  decoded to the 2-bit layout at load (`load_native`, or `bitnet convert DIR OUT --to hf` to get a plain HF dir).
Loading maps the safetensors files into memory: packed ternary tensors are views of the file pages (zero-copy).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

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
    modifies the file (copy-on-write).
    """
    path = Path(path)
    size = path.stat().st_size
    mm = np.memmap(path, dtype=np.uint8, mode="c")
    if size < 8:
        raise ValueError(f"{path}: not a safetensors file ({size} bytes)")
    n = int(mm[:8].view("<u8")[0])
    if n > size - 8 or n > 100_000_000:
        raise ValueError(f"{path}: safetensors header length {n} exceeds the file size {size} (truncated?)")
    try:
        header = json.loads(bytes(mm[8 : 8 + n]))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: corrupt safetensors header: {e}") from e
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    out = {}
    for name, info in header.items():
        dtype = _ST_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
        start, end = info["data_offsets"]
        if not (0 <= start <= end <= size - base):
            raise ValueError(f"{path}: tensor {name!r} data [{start}, {end}) runs past the end of the file")
        buf = torch.from_numpy(mm[base + start : base + end])
        out[name] = buf.view(dtype).reshape(info["shape"])
    return out, meta


def file_layout(model_dir: str | os.PathLike) -> tuple[str, str | None]:
    """(layout, format version) recorded in a model directory's safetensors metadata ('hf-2bit' if absent)."""
    from bitnetlm.formats.hf import safetensors_files

    files = safetensors_files(Path(model_dir))
    n = int(np.fromfile(files[0], dtype="<u8", count=1)[0])
    with open(files[0], "rb") as fh:
        fh.seek(8)
        meta = json.loads(fh.read(min(n, 100_000_000))).get("__metadata__") or {}
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
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_hf(model, tmp / "d", dtype=dtype, extra_files=tok_files or {})
        from safetensors.torch import load_file, save_file

        st = tmp / "d" / "model.safetensors"
        sd = load_file(str(st))
        from bitnetlm.formats.hf import read_config
        from bitnetlm.quant.packing import unpack_hf

        cfg = read_config(tmp / "d")
        for key in list(sd):
            if key.endswith(".weight") and sd[key].dtype == torch.uint8:
                n_out = _out_features(key, cfg)
                sd[key] = pack_base3(unpack_hf(sd[key], n_out))
        meta = {"format": "pt", VERSION_KEY: "1", LAYOUT_KEY: PackingFormat.BASE3.value}
        save_file(sd, str(st), metadata=meta)
        if out.exists():
            shutil.rmtree(out)
        (tmp / "d").rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
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
    ):
        if key.endswith(f"{suffix}.weight"):
            return n
    raise ValueError(f"tensor {key!r}: not a projection")


def _in_features(key: str, cfg) -> int:
    if key.endswith("o_proj.weight"):
        return cfg.num_attention_heads * cfg.head_dim
    if key.endswith("down_proj.weight"):
        return cfg.intermediate_size
    return cfg.hidden_size


def load_native(path: str | os.PathLike, mode: str = "infer", dtype: torch.dtype = torch.float32):
    """Load a native or plain HF directory. base3 storage is decoded to the 2-bit layout at load."""
    from bitnetlm.formats.hf import load_hf

    path = Path(path)
    layout, _ = file_layout(path)
    if layout == PackingFormat.HF_2BIT.value:
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
