"""GGUF architectures: which `general.architecture` describes a model, and the ModelConfig a file describes.

A GGUF file carries no activation key: the architecture name alone decides the MLP, in llama.cpp as here.
  bitnet-b1.58, bitnet-25  microsoft/BitNet's fork (bitnet.cpp, `build_bitnet_158`): ReLU^2 gated MLP, sub-norms
                           (BitNet b1.58 2B4T, bitnet-tiny)
  bitnet                   llama.cpp's `build_bitnet`: SiLU gated MLP, sub-norms (1bitLLM, smollm2-135m-1.58)
  llama                    SiLU gated MLP, no sub-norms (LLaMA family, ternarized or not)
  qwen3, gemma3, gpt2      llama.cpp's own, with their names and keys in `bitnetlm.formats.gguf_families`
The BitNet names use NEOX (rotate-half) RoPE, so their q/k rows are stored as in HF; `llama` files hold q/k rows
permuted for GGML's interleaved RoPE (`gguf.permute_qk`). llama.cpp's `bitnet` has no `output` tensor (its head is
the embedding): an untied SiLU BitNet is written with one all the same, which bitnet-lm reads and llama.cpp refuses.
"""

from __future__ import annotations

import math
import re

from bitnetlm.formats import gguf_codecs as codecs
from bitnetlm.formats import gguf_families as families
from bitnetlm.formats.gguf_file import GGUFError, GGUFFile
from bitnetlm.models import ModelConfig

# GGUF architecture -> (our arch, hidden_act); every BitNet name has sub-norms, llama has none
ARCHS = {
    "bitnet-b1.58": ("bitnet", "relu2"),
    "bitnet-25": ("bitnet", "relu2"),
    "bitnet": ("1bitllm", "silu"),
    "llama": ("llama", "silu"),
}
SUPPORTED_ARCHS = tuple(ARCHS)
_BLOCK = re.compile(r"blk\.(\d+)\.")
# the seven projections' GGUF names inside blk.N
PROJ_NAMES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _describes(name: str, cfg: ModelConfig) -> bool:
    arch, act = ARCHS[name]
    return act == cfg.hidden_act and (arch != "llama") == cfg.has_sub_norms


def gguf_arch_name(cfg: ModelConfig, arch_name: str | None = None) -> str:
    """The `general.architecture` that runs `cfg`'s model (its sub-norms and its MLP activation)."""
    if cfg.family != "llama":
        name = families.gguf_arch(cfg.arch)
        if arch_name not in (None, name):
            raise ValueError(
                f"GGUF architecture {arch_name!r} does not describe a {cfg.arch} model; it is {name!r}"
            )
        return name
    if arch_name is not None and arch_name not in ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch_name!r}; choose from {SUPPORTED_ARCHS}")
    fits = [name for name in ARCHS if _describes(name, cfg)]
    if arch_name is None and fits:
        return fits[0]
    if arch_name in fits:
        return arch_name
    kind = f"a {cfg.arch} model ({'with' if cfg.has_sub_norms else 'without'} sub-norms, hidden_act {cfg.hidden_act!r})"
    if arch_name is not None:
        arch, act = ARCHS[arch_name]
        raise ValueError(
            f"GGUF architecture {arch_name!r} ({act} MLP, {'no ' if arch == 'llama' else ''}sub-norms) does not "
            f"describe {kind}; it fits: {', '.join(fits) or 'none'}"
        )
    raise ValueError(
        f"no GGUF architecture describes {kind}: bitnet-b1.58 is ReLU^2 with sub-norms, bitnet SiLU with "
        "sub-norms, llama SiLU without"
    )


def _meta(f: GGUFFile, key: str, default=None, required: bool = False, kind=int):
    full = f"{f.metadata.get('general.architecture')}.{key}"
    if full not in f.metadata:
        if required:
            raise GGUFError(f"{f.path}: metadata {full!r} is missing (needed to build the model)")
        return default
    v = f.metadata[full]
    if kind is int and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
        raise GGUFError(f"{f.path}: metadata {full!r} must be a non-negative integer, found {v!r}")
    if kind is float and (
        isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
    ):
        raise GGUFError(f"{f.path}: metadata {full!r} must be a positive finite number, found {v!r}")
    return v


def _check_blocks(f: GGUFFile, n_layers: int) -> None:
    """block_count against the blk.N tensors present, before anything is built (a corrupt 1e9 must not hang)."""
    present = {int(m.group(1)) for name in f.tensors if (m := _BLOCK.match(name))}
    found = max(present) + 1 if present else 0
    if found != n_layers:
        key = f"{f.metadata.get('general.architecture')}.block_count"
        raise GGUFError(
            f"{f.path}: metadata {key!r} is {n_layers}, the file holds tensors for {found} blocks"
        )


def config_from_gguf(f: GGUFFile) -> ModelConfig:
    """ModelConfig from a GGUF file's metadata (and tensor shapes where metadata is silent)."""
    name = f.metadata.get("general.architecture")
    family = families.family_of(name) if name not in ARCHS and isinstance(name, str) else None
    if name not in ARCHS and family is None:
        supported = SUPPORTED_ARCHS + tuple(families.gguf_arch(a) for a in families.FAMILIES)
        raise GGUFError(f"{f.path}: general.architecture is {name!r}; supported: {', '.join(supported)}")
    hidden = _meta(f, "embedding_length", required=True)
    n_layers = _meta(f, "block_count", required=True)
    n_heads = _meta(f, "attention.head_count", required=True)
    if not hidden or not n_layers or not n_heads:
        raise GGUFError(f"{f.path}: embedding_length, block_count and head_count must be positive")
    _check_blocks(f, n_layers)
    n_kv = _meta(f, "attention.head_count_kv", n_heads)
    if "token_embd.weight" not in f.tensors:
        raise GGUFError(f"{f.path}: tensor 'token_embd.weight' is missing")
    emb_shape = f.tensors["token_embd.weight"].shape
    if len(emb_shape) != 2 or emb_shape[1] != hidden:
        raise GGUFError(f"{f.path}: token_embd.weight has shape {emb_shape}, expected [vocab, {hidden}]")
    ffn = _meta(f, "feed_forward_length")
    if ffn is None:
        up = f.tensors.get("blk.0.ffn_up.weight")
        if up is None:
            raise GGUFError(f"{f.path}: feed_forward_length missing and no blk.0.ffn_up.weight to infer it")
        ffn = up.shape[0]
    ours, act = ARCHS[name] if family is None else (family, families.ACTS[family])
    meta = f.metadata
    ternary = any(
        (ti := f.tensors.get(f"blk.0.{p}.weight")) is not None and ti.type_id in codecs.TYPE_NAMES
        for p in PROJ_NAMES + ("attn_qkv",)
    )
    extra = {} if family is None else families.config_fields(meta, family, f.path)
    try:
        return ModelConfig(
            arch=ours,
            vocab_size=_meta(f, "vocab_size", emb_shape[0]),
            hidden_size=hidden,
            intermediate_size=ffn,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv or n_heads,
            head_dim=_meta(f, "attention.key_length", _meta(f, "rope.dimension_count", hidden // n_heads)),
            max_position_embeddings=_meta(f, "context_length", 4096),
            rope_theta=float(_meta(f, "rope.freq_base", 10000.0, kind=float)),
            rms_norm_eps=extra.pop(
                "rms_norm_eps", float(_meta(f, "attention.layer_norm_rms_epsilon", 1e-5, kind=float))
            ),
            hidden_act=act,
            tie_word_embeddings="output.weight" not in f.tensors,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
            quant="ternary" if (ours in ("bitnet", "1bitllm") or ternary) else "none",
            **extra,
        )
    except ValueError as e:
        raise GGUFError(f"{f.path}: {e}") from None
