"""GGUF models: read and write BitNet (`bitnet`, `bitnet-b1.58`, `bitnet-25`), LLaMA-family, Qwen3, Gemma 3 and
GPT-2 GGUF files (the last three: `bitnetlm.formats.gguf_families`; `bert` encoders: `bitnetlm.formats.gguf_bert`).

Ternary projections are TQ1_0 / TQ2_0 / I2_S (multiply convention, W = T*s); everything else F32/F16/BF16
(any type `gguf.quants` dequantizes on read: Q8_0 embeddings, Q4_0/Q4_1/Q4_K/Q6_K llama files, ...).

Architectures and the activation each implies: `bitnetlm.formats.gguf_arch`. `llama` files store q/k rows
permuted for GGML's interleaved RoPE and are un-permuted here. Tokenizer and chat template:
`bitnetlm.formats.gguf_tokenizer`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from bitnetlm.formats import gguf_codecs as codecs
from bitnetlm.formats import gguf_families as families
from bitnetlm.formats.gguf_arch import config_from_gguf, gguf_arch_name
from bitnetlm.formats.gguf_file import GGUFError, TensorToWrite, read_gguf, write_gguf
from bitnetlm.formats.gguf_tensors import (
    FLOAT_TYPES,
    GGML_QUANT_VERSION,
    GGUF_FORMAT_VERSION,
    float_entry,
    float_tensor,
    permute_qk,
    projection,
    smallest_lossless,
    ternary_entry,
)
from bitnetlm.formats.gguf_tokenizer import load_gguf_tokenizer  # noqa: F401  (bitnetlm.load uses it from here)
from bitnetlm.formats.names import model_modules
from bitnetlm.models import CausalLM, Encoder, build_empty_model
from bitnetlm.models.transformer import rope_inv_freq
from bitnetlm.quant.bitlinear import BitLinear
from bitnetlm.quant.packing import PackingFormat

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


# ---- reading --------------------------------------------------------------------------------------


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
    shift = families.NORM_SHIFT.get(cfg.arch, 0.0)
    sd: dict[str, torch.Tensor] = {}
    used = set()
    for name, kind in _progress(list(model_modules(cfg)), f"loading {f.path.name}"):
        module = model.get_submodule(name)
        base = gguf_name(name) if cfg.family == "llama" else families.tensor_name(name, cfg.arch)
        g = base + ".weight"
        used.update((g, base + ".scale", base + ".bias"))
        if kind == "proj":
            shape = (module.out_features, module.in_features)
            sd.update(projection(f, g, name, module, shape, cfg, permute, dtype, strict_scales))
        else:
            w = float_tensor(f, g, tuple(module.weight.shape), torch.float32)
            sd[name + ".weight"] = (w - shift if kind == "norm" else w).to(dtype)
        if getattr(module, "bias", None) is not None:
            b = float_tensor(f, base + ".bias", tuple(module.bias.shape), dtype)
            sd[name + ".bias"] = b.float() if isinstance(module, BitLinear) else b
    if model.lm_head is not None:
        used.add("output.weight")
        sd["lm_head.weight"] = float_tensor(f, "output.weight", (cfg.vocab_size, cfg.hidden_size), dtype)
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


# ---- writing --------------------------------------------------------------------------------------


def _ternary_type(cfg, qtype: str | None) -> str:
    """The lower-cased ternary GGUF type to write ("" for a full-precision model without one); checked."""
    qkey = (qtype or "").lower()  # (a full-precision model has no ternary type)
    if cfg.quant == "ternary" and qkey not in codecs.TERNARY_TYPES:
        raise ValueError(
            f"--type must be one of {sorted(codecs.TERNARY_TYPES)} for a ternary model, got {qtype!r}"
        )
    return qkey


def _shape_metadata(model, cfg, p: str) -> tuple[dict, dict]:
    """(metadata, value types) every file gets: the name, the LLaMA-shaped hyperparameters under architecture
    prefix `p`, the format versions."""
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
    return meta, types


def _token_metadata(tokenizer, cfg) -> tuple[dict, dict]:
    """The tokenizer's GGUF metadata, or without one just the config's BOS / EOS ids (the first of a list)."""
    if tokenizer is not None:
        from bitnetlm.formats.gguf_tokenizer import tokenizer_metadata

        return tokenizer_metadata(tokenizer, cfg)
    meta, types = {}, {}
    for key, val in (("bos_token_id", cfg.bos_token_id), ("eos_token_id", cfg.eos_token_id)):
        if isinstance(val, list):
            val = val[0] if val else None
        if val is not None:
            meta[f"tokenizer.ggml.{key}"] = int(val)
            types[f"tokenizer.ggml.{key}"] = (4, None)
    return meta, types


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
    if model.config.vocab_subset is not None:
        raise ValueError(
            f"{path}: GGUF has no reduced vocabulary (vocab_subset); keep this model in the HF format"
        )
    cfg = model.config
    qkey = _ternary_type(cfg, qtype)
    arch = gguf_arch_name(cfg, arch_name)
    if cfg.family == "llama":
        tensors = _llama_tensors(model, cfg, arch, qkey, embed_type, Path(path).name)
    else:
        tensors = _family_tensors(model, cfg, qkey, embed_type, Path(path).name)
    meta, types = _shape_metadata(model, cfg, arch)
    if cfg.rope_scaling:
        raise ValueError("writing GGUF for models with rope_scaling is not supported yet")
    if cfg.family != "llama":
        _family_metadata(cfg, arch, meta, types)
    if cfg.quant == "ternary":
        meta["general.file_type"] = {"tq1_0": 36, "tq2_0": 37, "i2_s": 40}[qkey]  # llama_ftype MOSTLY_*
        types["general.file_type"] = (4, None)
    tmeta, ttypes = _token_metadata(tokenizer, cfg)
    meta.update(tmeta)
    types.update(ttypes)
    meta.update(extra_metadata or {})
    path = Path(path)
    write_gguf(path, arch, meta, tensors, value_types=types)
    return path


def _family_metadata(cfg, p: str, meta: dict, types: dict) -> None:
    """Swap the LLaMA-shaped keys for this family's (GPT-2: LayerNorm epsilon, no RoPE)."""
    drop = [f"{p}.attention.layer_norm_rms_epsilon"]
    if cfg.arch == "gpt2":
        drop += [f"{p}.rope.freq_base", f"{p}.rope.dimension_count", f"{p}.attention.head_count_kv"]
    for key in drop:
        meta.pop(key, None)
    fmeta, ftypes = families.metadata(cfg, cfg.arch)
    meta.update(fmeta)
    types.update(ftypes)


def _head_types(model, embed_type: str) -> tuple[int, int, int]:
    """(embedding, float projection, LM head) GGUF types for `embed_type`."""
    emb = model.embed_tokens.weight
    emb_tid = smallest_lossless(emb) if embed_type == "auto" else FLOAT_TYPES[embed_type]
    proj_tid = FLOAT_TYPES["f16" if embed_type == "auto" else embed_type]
    head = model.lm_head
    head_tid = (
        emb_tid
        if head is None
        else (smallest_lossless(head.weight) if embed_type == "auto" else FLOAT_TYPES[embed_type])
    )
    return emb_tid, proj_tid, head_tid


def _llama_tensors(model, cfg, arch: str, qkey: str, embed_type: str, fname: str) -> list[TensorToWrite]:
    """The tensors of a LLaMA/BitNet-shaped model, in llama.cpp's order (q/k rows permuted for `llama`)."""
    permute = arch == "llama"
    emb_tid, proj_tid, head_tid = _head_types(model, embed_type)
    tensors = [float_entry("token_embd.weight", model.embed_tokens.weight, emb_tid)]
    for i, layer in _progress(list(enumerate(model.layers)), f"writing {fname}"):
        for ours, g in LAYER_NAMES.items():
            parent, _, leaf = ours.rpartition(".")
            owner = layer.get_submodule(parent) if parent else layer
            m = getattr(owner, leaf, None)
            if m is None:
                continue
            gname = f"blk.{i}.{g}.weight"
            n_head = None
            if permute and g == "attn_q":
                n_head = cfg.num_attention_heads
            elif permute and g == "attn_k":
                n_head = cfg.num_key_value_heads
            if isinstance(m, BitLinear):
                tensors.append(ternary_entry(gname, m, qkey, n_head))
            elif isinstance(m, torch.nn.Linear):
                w = m.weight.detach()
                tensors.append(float_entry(gname, permute_qk(w, n_head) if n_head else w, proj_tid))
            else:
                tensors.append(float_entry(gname, m.weight))  # norms: F32
    tensors.append(float_entry("output_norm.weight", model.norm.weight))
    if model.lm_head is not None:
        tensors.append(float_entry("output.weight", model.lm_head.weight, head_tid))
    return tensors


def _family_tensors(model, cfg, qkey: str, embed_type: str, fname: str) -> list[TensorToWrite]:
    """The tensors of a Qwen3 / Gemma 3 / GPT-2 model under llama.cpp's names (biases F32 beside weights)."""
    emb_tid, proj_tid, head_tid = _head_types(model, embed_type)
    shift = families.NORM_SHIFT.get(cfg.arch, 0.0)
    tensors = []
    for name, kind in _progress(list(model_modules(cfg)), f"writing {fname}"):
        m = model.get_submodule(name)
        g = families.tensor_name(name, cfg.arch)
        if kind == "embed":
            tensors.append(float_entry(g + ".weight", m.weight, emb_tid))
        elif isinstance(m, BitLinear):
            tensors.append(ternary_entry(g + ".weight", m, qkey))
        elif kind == "proj":
            tensors.append(float_entry(g + ".weight", m.weight, proj_tid))
        else:  # norms: F32, Gemma's as (1 + w)
            tensors.append(float_entry(g + ".weight", m.weight.detach().float() + shift))
        if getattr(m, "bias", None) is not None:
            tensors.append(float_entry(g + ".bias", m.bias))
    if model.lm_head is not None:
        tensors.append(float_entry("output.weight", model.lm_head.weight, head_tid))
    return tensors


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
