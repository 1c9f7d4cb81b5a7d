"""BERT-family checkpoint directories: transformers' BertModel files plus sentence-transformers' module files.

Read: config.json (model_type "bert"; full precision, or ternary with transformers' bitnet quantization_config:
online float masters or offline packed, as for the decoders), model.safetensors, and where present modules.json,
the Pooling module's config.json, a Normalize module and sentence_bert_config.json (max_seq_length).
Written: the offline packed autobitlinear layout with the same sentence-transformers files.
Biases of offline autobitlinear projections are stored divided by the weight scale: transformers' AutoBitLinear
computes (x T^T + b) * s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from bitnetlm.formats import atomic
from bitnetlm.formats.hf import (
    FORMAT_VERSION,
    _expect,
    _load_projection,
    _replace_dir,
    _Tensors,
    safetensors_files,
)
from bitnetlm.formats.names import BERT_IGNORED_PREFIXES, bert_modules
from bitnetlm.models import build_empty_encoder
from bitnetlm.models.bert import POOLING_MODES, Encoder, EncoderConfig
from bitnetlm.quant.bitlinear import BitLinear
from bitnetlm.quant.packing import PackingFormat, pack_hf
from bitnetlm.quant.ternary import ternarize

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# sentence-transformers' legacy pooling flags, in the order it concatenates the modes
_LEGACY_POOLING = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


def _json(path: Path):
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: not valid JSON ({str(e).splitlines()[0]})") from None


def is_encoder_config(raw: dict) -> bool:
    archs = raw.get("architectures") or []
    return raw.get("model_type") == "bert" or any(isinstance(a, str) and a.startswith("Bert") for a in archs)


def read_encoder_config(path: str | os.PathLike) -> EncoderConfig:
    """The encoder's config: config.json, then the sentence-transformers pooling / normalisation / length."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file}: no config.json in the model directory {path}")
    raw = _json(cfg_file)
    if not isinstance(raw, dict):
        raise ValueError(f"{cfg_file}: expected a JSON object, found {type(raw).__name__}")
    cfg = EncoderConfig.from_hf(raw, source=str(cfg_file))
    pooling, normalize = _sentence_modules(path)
    max_len = None
    st = path / "sentence_bert_config.json"
    if st.is_file():
        st_cfg = _json(st)
        max_len = st_cfg.get("max_seq_length") if isinstance(st_cfg, dict) else None
        if max_len is not None and not (isinstance(max_len, int) and max_len > 0):
            raise ValueError(
                f"{st}: field 'max_seq_length' must be a positive integer, found {max_len!r:.80}"
            )
    try:
        return cfg.replace(pooling=pooling, normalize=normalize, max_seq_length=max_len)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _sentence_modules(path: Path) -> tuple[tuple[str, ...], bool]:
    """(pooling modes, normalize) from modules.json; a plain BertModel pools by mean, as sentence-transformers does."""
    mfile = path / "modules.json"
    if not mfile.is_file():
        return ("mean",), False
    mods = _json(mfile)
    if not isinstance(mods, list) or not all(isinstance(m, dict) for m in mods):
        raise ValueError(f"{mfile}: expected a list of module objects")
    pooling, normalize = ("mean",), False
    for m in mods:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            pooling = _pooling_modes(path / str(m.get("path", "")) / "config.json")
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ValueError(
                f"{mfile}: module type {m.get('type')!r} is not supported (expected Transformer, Pooling, Normalize)"
            )
    return pooling, normalize


def _pooling_modes(file: Path) -> tuple[str, ...]:
    if not file.is_file():
        raise FileNotFoundError(f"{file}: the Pooling module's config.json named by modules.json is missing")
    c = _json(file)
    if not isinstance(c, dict):
        raise ValueError(f"{file}: expected a JSON object")
    modes = c.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in _LEGACY_POOLING.items() if c.get(key)] or ["mean"]
    modes = (modes,) if isinstance(modes, str) else tuple(modes)
    bad = [m for m in modes if m not in POOLING_MODES]
    if bad:
        raise ValueError(
            f"{file}: pooling mode {bad[0]!r} is not supported; supported: {', '.join(POOLING_MODES)}"
        )
    if c.get("include_prompt") is False:
        raise ValueError(
            f"{file}: 'include_prompt': false is not supported (prompts are pooled with the text)"
        )
    return modes


def load_bert_hf(path: str | os.PathLike, mode: str = "infer", dtype: torch.dtype = torch.float32) -> Encoder:
    """Load a BERT-family HF directory into an Encoder on the CPU (move/repack with kernels.prepare)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: model directory not found")
    cfg = read_encoder_config(path)
    files = safetensors_files(path)
    ts = _Tensors(files)
    src = str(files[0] if len(files) == 1 else path)
    prefix = "bert." if any(k.startswith("bert.embeddings.") for k in ts.where) else ""
    _check_layers(cfg, ts.where, prefix, src)
    model = build_empty_encoder(cfg, mode)
    sd: dict[str, torch.Tensor] = {}
    used = set()
    for name, hf, kind in bert_modules(cfg.num_hidden_layers):
        key, module = prefix + hf, model.get_submodule(name)
        if kind == "proj":
            sd.update(_load_projection(ts, key + ".weight", name, module, cfg, dtype, src))
            used.update((key + ".weight", key + ".weight_scale"))
        else:
            w = ts.get(key + ".weight")
            _expect(key + ".weight", w, tuple(module.weight.shape), src, _FLOAT_DTYPES)
            sd[name + ".weight"] = w.to(dtype)
            used.add(key + ".weight")
        if kind != "embed":
            b = ts.get(key + ".bias")
            _expect(
                key + ".bias",
                b,
                (module.weight.shape[0] if kind == "norm" else module.out_features,),
                src,
                _FLOAT_DTYPES,
            )
            if kind == "proj" and cfg.linear_class == "autobitlinear" and key + ".weight_scale" in ts:
                # transformers' offline AutoBitLinear scales the bias with the output: y = (x T^T + b) * s
                b = b.float() * ts.get(key + ".weight_scale").float().reshape(())
            sd[name + ".bias"] = b.to(torch.float32 if isinstance(module, BitLinear) else dtype)
            used.add(key + ".bias")
    unknown = [
        k for k in ts.where if k not in used and not k.removeprefix(prefix).startswith(BERT_IGNORED_PREFIXES)
    ]
    if unknown:
        raise ValueError(
            f"{src}: unexpected tensors for a bert model: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}"
        )
    model.load_state_dict(sd, strict=True, assign=True)
    for m in model.modules():
        if isinstance(m, BitLinear) and not m.training_mode:
            m.layout = PackingFormat.HF_2BIT
    return model.eval() if mode != "train" else model


def _check_layers(cfg: EncoderConfig, names, prefix: str, src: str) -> None:
    head = prefix + "encoder.layer."
    present = {int(n[len(head) :].split(".", 1)[0]) for n in names if n.startswith(head)}
    found = max(present) + 1 if present else 0
    if found != cfg.num_hidden_layers:
        raise ValueError(
            f"{src}: config.json declares num_hidden_layers = {cfg.num_hidden_layers}, "
            f"the checkpoint holds tensors for {found} layers"
        )


def state_dict_bert(model: Encoder, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The encoder's tensors under BertModel's names, ternary projections packed (autobitlinear: W ~= T * s)."""
    out: dict[str, torch.Tensor] = {}
    for name, hf, kind in bert_modules(model.config.num_hidden_layers):
        m = model.get_submodule(name)
        bias = None if kind == "embed" else m.bias.detach().float().cpu()
        if kind == "proj" and isinstance(m, BitLinear):
            t, s = ternarize(m.weight) if m.training_mode else (m.ternary_weight(), m.weight_scale)
            s = s.detach().float().reshape(1).cpu()
            out[hf + ".weight"] = pack_hf(t.cpu())
            out[hf + ".weight_scale"] = s
            bias = bias / s  # read back as (x T^T + b) * s, as transformers' AutoBitLinear computes it
        else:
            w = m.weight.detach().cpu()
            out[hf + ".weight"] = (w.to(dtype) if dtype is not None else w).contiguous()
        if bias is not None:
            out[hf + ".bias"] = bias.contiguous()
    return out


def sentence_files(cfg: EncoderConfig) -> dict[str, str]:
    """sentence-transformers' module files for the encoder's pooling and normalisation."""
    mods = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if cfg.normalize:
        mods.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    pooling = {"word_embedding_dimension": cfg.hidden_size}
    pooling.update({key: mode in cfg.pooling for key, mode in _LEGACY_POOLING.items()})
    files = {
        "modules.json": json.dumps(mods, indent=2) + "\n",
        "1_Pooling/config.json": json.dumps(pooling, indent=2) + "\n",
        "sentence_bert_config.json": json.dumps({"max_seq_length": cfg.max_tokens, "do_lower_case": False})
        + "\n",
    }
    if cfg.normalize:
        files["2_Normalize/.keep"] = ""
    return files


def save_bert_hf(model: Encoder, out_dir: str | os.PathLike, tokenizer=None, overwrite: bool = False) -> Path:
    """Write the encoder as a BertModel directory with its sentence-transformers files (temp dir, then rename)."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{out}: exists and is not empty; pass overwrite=True (CLI: --force) to replace it"
        )
    cfg = model.config
    sd = state_dict_bert(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic.temp_dir(out) as tmp:
        meta = {
            "format": "pt",
            "bitnetlm_format_version": FORMAT_VERSION,
            "bitnetlm_layout": PackingFormat.HF_2BIT.value,
        }
        save_file(sd, str(tmp / "model.safetensors"), metadata=meta)
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
        for fname, text in sentence_files(cfg).items():
            (tmp / fname).parent.mkdir(parents=True, exist_ok=True)
            (tmp / fname).write_text(text)
        if tokenizer is not None:
            tokenizer.save(tmp)
        _replace_dir(tmp, out)
    return out
