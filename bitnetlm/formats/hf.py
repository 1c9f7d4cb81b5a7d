"""HF checkpoint directories: config.json + one or sharded safetensors (memory-mapped, never pickle).

Variants read (FORMATS.md): offline packed `autobitlinear` (weight_scale = s, multiply), packed `bitlinear`
(weight_scale = 1/s, divide), online float master weights (ternarized at load), 1bitLLM latent floats, plain
full-precision BitNet / LLaMA. Written: the offline packed autobitlinear layout that transformers loads.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bitnetlm import progress
from bitnetlm.formats import atomic
from bitnetlm.formats.names import IGNORED_SUFFIXES, hf_name, hf_transposed, model_modules
from bitnetlm.models import CausalLM, ModelConfig, build_empty_model
from bitnetlm.models.transformer import rope_inv_freq
from bitnetlm.quant.bitlinear import BitLinear
from bitnetlm.quant.packing import PackingFormat, pack_hf, unpack_hf
from bitnetlm.quant.ternary import ternarize

FORMAT_VERSION = "1"
_LAYER = re.compile(r"(?:model\.layers|transformer\.h)\.(\d+)\.")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def read_config(path: str | os.PathLike) -> ModelConfig:
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file}: no config.json in the model directory {path}")
    try:
        raw = json.loads(cfg_file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({str(e).splitlines()[0]})") from None
    return ModelConfig.from_hf(raw, source=str(cfg_file))


def safetensors_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (single file or sharded index)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_bytes().decode("utf-8"))["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, KeyError, TypeError) as e:
            raise ValueError(
                f"{index}: not a valid safetensors index (expected a 'weight_map' object): {e!r:.120}"
            ) from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index}: 'weight_map' must map tensor names to file names")
        files = [path / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{f}: shard listed in {index.name} is missing")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(path.glob("*.safetensors"))
    if others:
        return others
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise ValueError(
            f"{path}: only pickle checkpoints (*.bin/*.pt) found; they can run arbitrary code and are not loaded. "
            "Convert them to safetensors first."
        )
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")


class _Tensors:
    """name -> tensor over several memory-mapped safetensors files, with file-naming errors."""

    def __init__(self, files: list[Path]):
        self.where: dict[str, Path] = {}
        self.handles = {}
        self.metadata: dict[str, str] = {}
        for f in files:
            try:
                h = safe_open(str(f), framework="pt")
            except Exception as e:
                raise ValueError(f"{f}: not a readable safetensors file (truncated or corrupt?): {e}") from e
            self.handles[f] = h
            self.metadata.update(h.metadata() or {})
            for k in h.keys():
                self.where[k] = f

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise ValueError(
                f"tensor {name!r} is missing from the checkpoint ({', '.join(sorted({str(p) for p in self.where.values()}))})"
            )
        f = self.where[name]
        try:
            return self.handles[f].get_tensor(name)
        except Exception as e:
            raise ValueError(f"{f}: cannot read tensor {name!r} (file truncated or corrupt?): {e}") from e


def check_layer_count(cfg: ModelConfig, names, src: str) -> None:
    """config.json's num_hidden_layers against the `model.layers.N.` tensors the checkpoint holds, before any model
    is built: a corrupt count (1e9) must fail here, not allocate a billion layers first."""
    present = {int(m.group(1)) for n in names if (m := _LAYER.match(n))}
    found = max(present) + 1 if present else 0
    if found != cfg.num_hidden_layers:
        raise ValueError(
            f"{src}: config.json declares num_hidden_layers = {cfg.num_hidden_layers}, "
            f"the checkpoint holds tensors for {found} layers"
        )


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...], file: str, dtypes=None) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"{file}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)} from config.json"
        )
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(
            f"{file}: tensor {name!r} has unsupported dtype {t.dtype}, expected one of {list(dtypes)}"
        )


def load_hf(path: str | os.PathLike, mode: str = "infer", dtype: torch.dtype = torch.float32) -> CausalLM:
    """Load an HF checkpoint directory into a model on the CPU (move/repack with kernels.prepare)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: model directory not found")
    cfg = read_config(path)
    files = safetensors_files(path)
    ts = _Tensors(files)
    src = str(files[0] if len(files) == 1 else path)
    check_layer_count(cfg, ts.where, src)
    model = build_empty_model(cfg, mode)
    sd: dict[str, torch.Tensor] = {}
    modules = list(model_modules(cfg))
    for name, kind in progress.bar(modules, desc=f"loading {path.name}", unit="tensor"):
        key = hf_name(name, cfg.arch) + ".weight"
        module = model.get_submodule(name)
        if kind == "proj":
            sd.update(_load_projection(ts, key, name, module, cfg, dtype, src))
        else:
            w = ts.get(key)
            _expect(key, w, tuple(module.weight.shape), src, _FLOAT_DTYPES)
            sd[name + ".weight"] = w.to(dtype)
        if getattr(module, "bias", None) is not None:
            b = ts.get(key.removesuffix("weight") + "bias")
            _expect(key.removesuffix("weight") + "bias", b, tuple(module.bias.shape), src, _FLOAT_DTYPES)
            sd[name + ".bias"] = b.to(torch.float32 if isinstance(module, BitLinear) else dtype)
    if not cfg.tie_word_embeddings:
        w = ts.get("lm_head.weight")
        _expect("lm_head.weight", w, (cfg.head_rows, cfg.hidden_size), src, _FLOAT_DTYPES)
        sd["lm_head.weight"] = w.to(dtype)
    known = {hf_name(k.rsplit(".", 1)[0], cfg.arch) for k in sd} | {"lm_head"}
    unknown = [k for k in ts.where if k.rsplit(".", 1)[0] not in known and not k.endswith(IGNORED_SUFFIXES)]
    if unknown:
        raise ValueError(
            f"{src}: unexpected tensors for a {cfg.arch} model: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}"
        )
    model.load_state_dict(sd, strict=True, assign=True)
    model.inv_freq = rope_inv_freq(cfg)
    for m in model.modules():
        if isinstance(m, BitLinear) and not m.training_mode:
            m.layout = PackingFormat.HF_2BIT
    model.source_metadata = dict(ts.metadata)
    return model.eval() if mode != "train" else model


def _load_projection(ts: _Tensors, key: str, name: str, module, cfg: ModelConfig, dtype, src: str) -> dict:
    n, k = module.out_features, module.in_features
    w = ts.get(key)
    if w.dtype == torch.uint8:  # offline packed ternary
        rows = (n + 3) // 4
        _expect(key, w, (rows, k), src)
        skey = key.removesuffix(".weight") + ".weight_scale"
        scale = ts.get(skey).float().reshape(-1)
        if scale.numel() != 1:
            raise ValueError(
                f"{src}: tensor {skey!r} has {scale.numel()} values, expected 1 (per-matrix scale)"
            )
        s = scale if cfg.linear_class == "autobitlinear" else 1.0 / scale  # FORMATS.md: opposite meanings
        if cfg.linear_class != "autobitlinear" and float(scale) == 0.0:
            raise ValueError(f"{src}: tensor {skey!r} is 0 but linear_class 'bitlinear' divides by it")
        if isinstance(module, BitLinear) and not module.training_mode:
            return {name + ".packed": w, name + ".weight_scale": s.reshape(1).float()}
        t = unpack_hf(w, n).to(torch.float32)
        if isinstance(module, BitLinear):
            # latent weights whose absmean ternarization gives back exactly (T, s): mean|T * s/p| = s
            p = t.abs().mean().clamp(min=1e-12)
            return {name + ".weight": t * (s / p)}
        return {name + ".weight": (t * s).to(dtype)}
    if hf_transposed(name, cfg.arch):  # GPT-2's Conv1D holds [in, out]
        _expect(key, w, (k, n), src, _FLOAT_DTYPES)
        w = w.t()
    _expect(key, w, (n, k), src, _FLOAT_DTYPES)
    if isinstance(module, BitLinear) and not module.training_mode:  # float master weights -> ternary at load
        t, s = ternarize(w)
        return {name + ".packed": pack_hf(t), name + ".weight_scale": s.reshape(1)}
    return {name + ".weight": w.to(torch.float32 if isinstance(module, BitLinear) else dtype)}


def state_dict_hf(model: CausalLM, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Our model's tensors under HF names, ternary projections in the offline packed autobitlinear layout."""
    cfg = model.config
    out: dict[str, torch.Tensor] = {}
    for name, kind in progress.bar(list(model_modules(cfg)), desc="packing", unit="tensor"):
        m = model.get_submodule(name)
        key = hf_name(name, "bitnet" if cfg.arch == "1bitllm" else cfg.arch)
        if kind == "proj" and isinstance(m, BitLinear):
            if m.training_mode:
                t, s = ternarize(m.weight)
            else:
                t, s = m.ternary_weight(), m.weight_scale
            out[key + ".weight"] = pack_hf(t.cpu())
            out[key + ".weight_scale"] = s.detach().float().reshape(1).cpu()
        else:
            w = m.weight.detach().cpu()
            w = w.t() if hf_transposed(name, cfg.arch) else w
            out[key + ".weight"] = (w.to(dtype) if dtype is not None else w).contiguous()
        if getattr(m, "bias", None) is not None:
            b = m.bias.detach().cpu()
            out[key + ".bias"] = (b.to(dtype) if dtype is not None else b).contiguous()
    if model.lm_head is not None:
        w = model.lm_head.weight.detach().cpu()
        out["lm_head.weight"] = (w.to(dtype) if dtype is not None else w).contiguous()
    return out


def _replace_dir(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` onto `out`; an existing `out` is swapped out under a temporary name first."""
    if not out.exists():
        atomic.commit(tmp, out)
        return
    backup = out.with_name(f".{out.name}{atomic.TAG}old-{os.getpid()}")
    out.rename(backup)
    try:
        atomic.commit(tmp, out)
    except BaseException:
        backup.rename(out)
        raise
    shutil.rmtree(backup, ignore_errors=True)


def save_hf(
    model: CausalLM,
    out_dir: str | os.PathLike,
    tokenizer=None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write a transformers-loadable directory atomically (temp dir, then rename)."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{out}: exists and is not empty; pass overwrite=True (CLI: --force) to replace it"
        )
    cfg = model.config
    hf_cfg = cfg.to_hf()
    if cfg.arch == "1bitllm":  # saved as BitNet with SiLU: transformers has no 1bitLLM class
        hf_cfg["hidden_act"] = cfg.hidden_act
    sd = state_dict_hf(model, dtype)
    hf_cfg["torch_dtype"] = str(sd[hf_name("embed_tokens", cfg.arch) + ".weight"].dtype).removeprefix(
        "torch."
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic.temp_dir(out) as tmp:
        meta = {
            "format": "pt",
            "bitnetlm_format_version": FORMAT_VERSION,
            "bitnetlm_layout": PackingFormat.HF_2BIT.value,
        }
        save_file(sd, str(tmp / "model.safetensors"), metadata=meta)
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
        gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save(tmp)
        for fname, text in (extra_files or {}).items():
            (tmp / fname).write_text(text)
        _replace_dir(tmp, out)
    return out
