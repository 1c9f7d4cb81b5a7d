"""GGUF models: read and write BitNet (`bitnet`, `bitnet-b1.58`, `bitnet-25`) and LLaMA-family GGUF files
(`bert` encoders: `bitnetlm.formats.gguf_bert`).

Ternary projections are TQ1_0 / TQ2_0 / I2_S (multiply convention, W = T*s); everything else F32/F16/BF16
(any type `gguf.quants` dequantizes on read: Q8_0 embeddings, Q4_0/Q4_1/Q4_K/Q6_K llama files, ...).

Architectures and the activation each implies: `bitnetlm.formats.gguf_arch`. `llama` files store q/k rows
permuted for GGML's interleaved RoPE and are un-permuted here. Tokenizer and chat template:
`bitnetlm.formats.gguf_tokenizer`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from bitnetlm.formats import gguf_codecs as codecs
from bitnetlm.formats.gguf_arch import config_from_gguf, gguf_arch_name
from bitnetlm.formats.gguf_file import GGUFError, GGUFFile, TensorToWrite, read_gguf, write_gguf
from bitnetlm.formats.gguf_tokenizer import load_gguf_tokenizer  # noqa: F401  (bitnetlm.load uses it from here)
from bitnetlm.formats.names import layer_modules
from bitnetlm.models import CausalLM, Encoder, build_empty_model
from bitnetlm.models.transformer import rope_inv_freq
from bitnetlm.quant.bitlinear import BitLinear
from bitnetlm.quant.packing import PackingFormat, pack_hf
from bitnetlm.quant.ternary import ternarize

GGUF_FORMAT_VERSION = 1  # bitnetlm.format_version written to files we produce
GGML_QUANT_VERSION = 2  # general.quantization_version, as llama.cpp's converter writes it

# our module name (inside layers.N) <-> GGUF tensor name (inside blk.N)
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.attn_sub_norm": "attn_sub_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.ffn_sub_norm": "ffn_sub_norm",
}
FLOAT_TYPES = {"f32": codecs.TYPE_F32, "f16": codecs.TYPE_F16, "bf16": codecs.TYPE_BF16}


def gguf_name(ours: str) -> str:
    """GGUF tensor name of our parameter name (e.g. 'layers.3.mlp.up_proj' -> 'blk.3.ffn_up')."""
    if ours == "embed_tokens":
        return "token_embd"
    if ours == "norm":
        return "output_norm"
    if ours == "lm_head":
        return "output"
    _, i, rest = ours.split(".", 2)
    return f"blk.{i}.{LAYER_NAMES[rest]}"


def _progress(items: list, desc: str):
    """A bar over a long loop (loading dequantizes every tensor, writing encodes every layer)."""
    from bitnetlm import progress

    return progress.bar(items, desc=desc, unit="tensor" if desc.startswith("loading") else "layer")


# ---- q/k row permutation of llama.cpp's llama converter ---------------------------------------------


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF (rotate-half) row order -> GGML interleaved order, as llama.cpp's convert_hf_to_gguf does."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- reading --------------------------------------------------------------------------------------


def _float_tensor(f: GGUFFile, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if name not in f.tensors:
        raise GGUFError(f"{f.path}: tensor {name!r} is missing")
    ti = f.tensors[name]
    if tuple(ti.shape) != tuple(shape):
        raise GGUFError(f"{f.path}: tensor {name!r} has shape {ti.shape}, expected {tuple(shape)}")
    arr = np.asarray(f.array(name), dtype=np.float32)
    return torch.from_numpy(arr.copy()).to(dtype)


def load_gguf_model(
    path: str | os.PathLike,
    mode: str = "infer",
    dtype: torch.dtype = torch.float32,
    strict_scales: bool = False,
) -> CausalLM:
    """A model from a GGUF file (CPU). Ternary tensors give packed BitLinear weights without a float detour."""
    f = read_gguf(path)
    if f.metadata.get("general.architecture") == "bert":
        from bitnetlm.formats.gguf_bert import load_bert_gguf

        model = load_bert_gguf(f, mode=mode, dtype=dtype)
        f.close()
        return model
    cfg = config_from_gguf(f)
    model = build_empty_model(cfg, mode)
    permute = f.metadata.get("general.architecture") == "llama"
    sd: dict[str, torch.Tensor] = {}
    used = set()
    for name, kind in _progress(
        list(layer_modules(cfg.num_hidden_layers, cfg.has_sub_norms)), f"loading {f.path.name}"
    ):
        module = model.get_submodule(name)
        g = gguf_name(name) + ".weight"
        used.add(g)
        used.add(g.removesuffix(".weight") + ".scale")
        if kind == "proj":
            shape = (module.out_features, module.in_features)
            sd.update(_projection(f, g, name, module, shape, cfg, permute, dtype, strict_scales))
        else:
            sd[name + ".weight"] = _float_tensor(f, g, tuple(module.weight.shape), dtype)
    if model.lm_head is not None:
        used.add("output.weight")
        sd["lm_head.weight"] = _float_tensor(f, "output.weight", (cfg.vocab_size, cfg.hidden_size), dtype)
    extra = sorted(set(f.tensors) - used - {"rope_freqs.weight"})
    if extra:
        raise GGUFError(f"{f.path}: unexpected tensors for a {cfg.arch} model: {extra[:5]}")
    model.load_state_dict(sd, strict=True, assign=True)
    model.inv_freq = rope_inv_freq(cfg)
    for m in model.modules():
        if isinstance(m, BitLinear) and not m.training_mode:
            m.layout = PackingFormat.HF_2BIT
    model.source_metadata = {"format": "gguf", "path": str(f.path)}
    f.close()
    return model.eval() if mode != "train" else model


def _scale_tensor(f: GGUFFile, g: str) -> float:
    sname = g.removesuffix(".weight") + ".scale"
    if sname not in f.tensors:
        return 1.0
    v = np.asarray(f.array(sname), dtype=np.float32).reshape(-1)
    if v.size != 1 or not np.isfinite(v[0]):
        raise GGUFError(f"{f.path}: tensor {sname!r} must hold one finite value, found {v.size} values")
    return float(v[0])


def _exact_ternary(w: torch.Tensor):
    """(T, s) if the float matrix already holds ternary values {-s, 0, s} (converters store T*s as F16/F32)."""
    a = w.abs()
    s = a.amax()
    if s == 0 or not bool(((a == 0) | (a == s)).all()):
        return None, None
    return torch.sign(w).to(torch.int8), s.reshape(1).float()


def _projection(f, g, name, module, shape, cfg, permute, dtype, strict) -> dict[str, torch.Tensor]:
    if g not in f.tensors:
        raise GGUFError(f"{f.path}: tensor {g!r} is missing")
    ti = f.tensors[g]
    if tuple(ti.shape) != shape:
        raise GGUFError(f"{f.path}: tensor {g!r} has shape {ti.shape}, expected {shape}")
    n_head = None
    if permute and ".attn_q." in g:
        n_head = cfg.num_attention_heads
    elif permute and ".attn_k." in g:
        n_head = cfg.num_key_value_heads
    # llama.cpp's BitNet files may carry the matrix scale as a separate [1] tensor `<name>.scale` (y *= scale)
    extra = _scale_tensor(f, g)
    if ti.type_id in codecs.TYPE_NAMES:
        t_np, s = f.ternary(g, strict=strict)
        s *= extra
        t = torch.from_numpy(t_np.copy())
        if n_head:
            t = unpermute_qk(t, n_head)
        if isinstance(module, BitLinear) and not module.training_mode:
            return {
                name + ".packed": pack_hf(t),
                name + ".weight_scale": torch.tensor([s], dtype=torch.float32),
            }
        w = t.float() * s
    else:
        w = torch.from_numpy(np.asarray(f.array(g), dtype=np.float32).copy()) * extra
        if n_head:
            w = unpermute_qk(w, n_head)
        if isinstance(module, BitLinear) and not module.training_mode:
            tt, ss = _exact_ternary(w)
            if tt is None:  # genuinely full-precision weights: absmean ternarization
                tt, ss = ternarize(w)
            return {name + ".packed": pack_hf(tt), name + ".weight_scale": ss.reshape(1)}
    return {name + ".weight": w.to(torch.float32 if isinstance(module, BitLinear) else dtype)}


# ---- writing --------------------------------------------------------------------------------------


def _smallest_lossless(w: torch.Tensor) -> int:
    """BF16 or F16 if every value survives the round trip, else F32 (token_embd and lm_head)."""
    wf = w.detach().float()
    if w.dtype == torch.bfloat16 or torch.equal(wf.to(torch.bfloat16).float(), wf):
        return codecs.TYPE_BF16
    if w.dtype == torch.float16 or torch.equal(wf.to(torch.float16).float(), wf):
        return codecs.TYPE_F16
    return codecs.TYPE_F32


def _float_bytes(w: torch.Tensor, type_id: int) -> np.ndarray:
    wf = w.detach().cpu().float().contiguous()
    if type_id == codecs.TYPE_F32:
        return wf.numpy()
    if type_id == codecs.TYPE_F16:
        return wf.to(torch.float16).numpy()
    return wf.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8).reshape(*wf.shape[:-1], -1)


def _ternary_of(module) -> tuple[torch.Tensor, float]:
    if isinstance(module, BitLinear):
        if module.training_mode:
            t, s = ternarize(module.weight)
        else:
            t, s = module.ternary_weight(), module.weight_scale
        return t.cpu(), float(s.reshape(-1)[0])
    raise TypeError("not a ternary projection")


def save_gguf(
    model: CausalLM,
    path: str | os.PathLike,
    qtype: str = "tq2_0",
    tokenizer=None,
    arch_name: str | None = None,
    embed_type: str = "auto",
    extra_metadata: dict | None = None,
) -> Path:
    """Write `model` as GGUF (atomically). qtype: tq1_0 | tq2_0 | i2_s for the seven projections of a ternary
    model; a full-precision llama model is written with `embed_type` floats everywhere (f32/f16/bf16).
    `tokenizer`: a bitnetlm Tokenizer or a path to a directory with tokenizer.json (+ tokenizer_config.json).
    """
    if isinstance(model, Encoder):
        from bitnetlm.formats.gguf_bert import save_bert_gguf

        if arch_name not in (None, "bert"):
            raise ValueError(
                f"GGUF architecture {arch_name!r} does not describe a BERT-family encoder (bert)"
            )
        return save_bert_gguf(model, path, qtype, tokenizer=tokenizer, embed_type=embed_type)
    cfg = model.config
    ternary = cfg.quant == "ternary"
    qkey = qtype.lower()
    if ternary and qkey not in codecs.TERNARY_TYPES:
        raise ValueError(
            f"--type must be one of {sorted(codecs.TERNARY_TYPES)} for a ternary model, got {qtype!r}"
        )
    arch = gguf_arch_name(cfg, arch_name)
    permute = arch == "llama"
    tensors: list[TensorToWrite] = []

    def add_float(gname: str, w: torch.Tensor, type_id: int | None = None):
        tid = type_id if type_id is not None else codecs.TYPE_F32
        arr = _float_bytes(w, tid)
        tensors.append(TensorToWrite(gname + ".weight", arr, tid, tuple(w.shape)))

    emb_tid = (
        _smallest_lossless(model.embed_tokens.weight) if embed_type == "auto" else FLOAT_TYPES[embed_type]
    )
    add_float("token_embd", model.embed_tokens.weight, emb_tid)
    for i, layer in _progress(list(enumerate(model.layers)), f"writing {Path(path).name}"):
        for ours, g in LAYER_NAMES.items():
            parent, _, leaf = ours.rpartition(".")
            owner = layer.get_submodule(parent) if parent else layer
            m = getattr(owner, leaf, None)
            if m is None:
                continue
            gname = f"blk.{i}.{g}"
            n_head = None
            if permute and g == "attn_q":
                n_head = cfg.num_attention_heads
            elif permute and g == "attn_k":
                n_head = cfg.num_key_value_heads
            if isinstance(m, BitLinear):
                t, s = _ternary_of(m)
                if n_head:
                    t = permute_qk(t, n_head)
                tid = codecs.TERNARY_TYPES[qkey]
                try:
                    data = codecs.encode(t.numpy(), s, tid)
                except codecs.CodecError as e:
                    hint = (
                        " (I2_S needs only a multiple of 128 values per matrix: --type i2_s)"
                        if tid != 36
                        else ""
                    )
                    raise ValueError(f"tensor {gname}.weight {tuple(t.shape)}: {e}{hint}") from e
                tensors.append(TensorToWrite(gname + ".weight", data, tid, tuple(t.shape)))
            elif isinstance(m, torch.nn.Linear):
                w = m.weight.detach()
                if n_head:
                    w = permute_qk(w, n_head)
                tid = FLOAT_TYPES["f16" if embed_type == "auto" else embed_type]
                add_float(gname, w, tid)
            else:
                add_float(gname, m.weight)  # norms: F32
    add_float("output_norm", model.norm.weight)
    if model.lm_head is not None:
        w = model.lm_head.weight
        add_float("output", w, _smallest_lossless(w) if embed_type == "auto" else FLOAT_TYPES[embed_type])

    p = arch
    meta: dict = {
        "general.name": getattr(model, "name", None)
        or f"{cfg.arch} {cfg.num_hidden_layers}L {cfg.hidden_size}d",
        f"{p}.vocab_size": cfg.vocab_size,
        f"{p}.context_length": cfg.max_position_embeddings,
        f"{p}.embedding_length": cfg.hidden_size,
        f"{p}.feed_forward_length": cfg.intermediate_size,
        f"{p}.block_count": cfg.num_hidden_layers,
        f"{p}.attention.head_count": cfg.num_attention_heads,
        f"{p}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{p}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{p}.rope.freq_base": float(cfg.rope_theta),
        f"{p}.rope.dimension_count": cfg.head_dim,
        "bitnetlm.format_version": GGUF_FORMAT_VERSION,
        "general.quantization_version": GGML_QUANT_VERSION,
    }
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        meta[f"{p}.attention.key_length"] = cfg.head_dim
        meta[f"{p}.attention.value_length"] = cfg.head_dim
    if cfg.rope_scaling:
        raise ValueError("writing GGUF for models with rope_scaling is not supported yet")
    types = {
        f"{p}.vocab_size": (4, None),  # UINT32, as llama.cpp writes them
        f"{p}.context_length": (4, None),
        f"{p}.embedding_length": (4, None),
        f"{p}.feed_forward_length": (4, None),
        f"{p}.block_count": (4, None),
        f"{p}.attention.head_count": (4, None),
        f"{p}.attention.head_count_kv": (4, None),
        f"{p}.rope.dimension_count": (4, None),
        f"{p}.attention.key_length": (4, None),
        f"{p}.attention.value_length": (4, None),
        "bitnetlm.format_version": (4, None),
        "general.quantization_version": (4, None),
    }
    if ternary:
        meta["general.file_type"] = {"tq1_0": 36, "tq2_0": 37, "i2_s": 40}[qkey]  # llama_ftype MOSTLY_*
        types["general.file_type"] = (4, None)
    if tokenizer is not None:
        from bitnetlm.formats.gguf_tokenizer import tokenizer_metadata

        tmeta, ttypes = tokenizer_metadata(tokenizer, cfg)
        meta.update(tmeta)
        types.update(ttypes)
    else:
        for key, val in (("bos_token_id", cfg.bos_token_id), ("eos_token_id", cfg.eos_token_id)):
            if isinstance(val, list):
                val = val[0] if val else None
            if val is not None:
                meta[f"tokenizer.ggml.{key}"] = int(val)
                types[f"tokenizer.ggml.{key}"] = (4, None)
    meta.update(extra_metadata or {})
    path = Path(path)
    write_gguf(path, arch, meta, tensors, value_types=types)
    return path


# ---- inspect --------------------------------------------------------------------------------------


def inspect_gguf(path: str | os.PathLike) -> dict:
    """`bitnet inspect` report of a GGUF file: metadata (long arrays summarized), tensor table, bits per weight."""
    from bitnetlm.formats.gguf_file import read_gguf

    f = read_gguf(path)
    tensors, ternary_n, ternary_b, total_n = [], 0, 0, 0
    for ti in f.tensors.values():
        n = ti.n_values
        total_n += n
        if ti.type_id in codecs.TYPE_NAMES:
            ternary_n += n
            ternary_b += ti.nbytes
        tensors.append(
            {
                "name": ti.name,
                "dtype": ti.type_name,
                "shape": list(ti.shape),
                "bits_per_weight": round(8 * ti.nbytes / max(n, 1), 4),
            }
        )
    meta = {}
    for k, v in f.metadata.items():
        if isinstance(v, list) and len(v) > 8:
            meta[k] = f"[{len(v)} items]"
        elif isinstance(v, str) and len(v) > 200:
            meta[k] = v[:200] + f"... ({len(v)} chars)"
        else:
            meta[k] = v
    data_bytes = sum(ti.nbytes for ti in f.tensors.values())
    try:
        if f.metadata.get("general.architecture") == "bert":
            from bitnetlm.formats.gguf_bert import encoder_config_from_gguf

            cfg = encoder_config_from_gguf(f)
        else:
            cfg = config_from_gguf(f)
        arch, quant = cfg.arch, cfg.quant
    except GGUFError as e:
        arch, quant = f.metadata.get("general.architecture"), f"unknown ({e})"
    types = sorted({t["dtype"] for t in tensors})
    return {
        "path": str(path),
        "format": f"gguf v{f.version}",
        "architecture": f"{arch} (gguf: {f.metadata.get('general.architecture')})",
        "quantization": quant
        if quant != "ternary"
        else "ternary ("
        + ", ".join(sorted({t["dtype"] for t in tensors if t["dtype"] in ("TQ1_0", "TQ2_0", "I2_S")}))
        + ")",
        "layout": ", ".join(types),
        "parameters": total_n,
        "ternary_parameters": ternary_n,
        "bits_per_ternary_weight": (8 * ternary_b / ternary_n) if ternary_n else None,
        "bits_per_weight_overall": 8 * data_bytes / max(total_n, 1),
        "file_bytes": Path(path).stat().st_size,
        "config": meta,
        "tensors": tensors,
    }
