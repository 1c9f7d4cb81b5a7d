"""GGUF names and metadata of the Qwen3, Gemma 3 and GPT-2 families, from the `gguf` package's own tables
(`MODEL_ARCH_NAMES`, `TENSOR_NAMES`, `Keys`), as llama.cpp's converter writes them.

Qwen3 and Gemma 3 rotate NEOX-style (rotate-half), so their q/k rows are stored as in HF. Gemma 3's norm weights
are stored as (1 + w), the factor llama.cpp multiplies by; its local layers follow llama.cpp's defaults (every
sixth layer global, local RoPE base 10000, attention scale head_dim^-0.5) unless the file says otherwise in
`attention.sliding_window_pattern`, `rope.freq_base_swa`, `attention.scale`. GPT-2's fused q/k/v and its other
projections are stored [out, in] with their biases beside them (`.bias`); its GELU is the tanh approximation.
"""

from __future__ import annotations

import math

FAMILIES = ("qwen3", "gemma3", "gpt2")
# the hidden_act each family's GGUF architecture implies (llama.cpp has no activation key)
ACTS = {"qwen3": "silu", "gemma3": "gelu_pytorch_tanh", "gpt2": "gelu_pytorch_tanh"}
NORM_SHIFT = {"gemma3": 1.0}
_GEMMA_PATTERN = 6  # llama.cpp's gemma3: layers 6, 12, ... global


def _arch_enum(arch: str):
    import gguf

    return {"qwen3": gguf.MODEL_ARCH.QWEN3, "gemma3": gguf.MODEL_ARCH.GEMMA3, "gpt2": gguf.MODEL_ARCH.GPT2}[
        arch
    ]


def gguf_arch(arch: str) -> str:
    """llama.cpp's architecture name of our family `arch`."""
    import gguf

    return gguf.MODEL_ARCH_NAMES[_arch_enum(arch)]


def family_of(name: str) -> str | None:
    """Our family of a `general.architecture` value, or None."""
    return next((a for a in FAMILIES if gguf_arch(a) == name), None)


def _tensor_ids(arch: str) -> dict:
    import gguf

    T = gguf.MODEL_TENSOR
    post_attn = T.ATTN_POST_NORM if arch == "gemma3" else T.FFN_NORM
    return {
        "embed_tokens": T.TOKEN_EMBD,
        "embed_positions": T.POS_EMBD,
        "norm": T.OUTPUT_NORM,
        "lm_head": T.OUTPUT,
        "input_layernorm": T.ATTN_NORM,
        "self_attn.q_proj": T.ATTN_Q,
        "self_attn.k_proj": T.ATTN_K,
        "self_attn.v_proj": T.ATTN_V,
        "self_attn.qkv_proj": T.ATTN_QKV,
        "self_attn.o_proj": T.ATTN_OUT,
        "self_attn.q_norm": T.ATTN_Q_NORM,
        "self_attn.k_norm": T.ATTN_K_NORM,
        "post_attention_layernorm": post_attn,
        "pre_feedforward_layernorm": T.FFN_PRE_NORM,
        "post_feedforward_layernorm": T.FFN_POST_NORM,
        "mlp.gate_proj": T.FFN_GATE,
        "mlp.up_proj": T.FFN_UP,
        "mlp.down_proj": T.FFN_DOWN,
    }


def tensor_name(ours: str, arch: str) -> str:
    """GGUF tensor name (without .weight) of our module `ours` in a model of family `arch`."""
    import gguf

    ids = _tensor_ids(arch)
    block, rest = None, ours
    if ours.startswith("layers."):
        _, block, rest = ours.split(".", 2)
    t = ids[rest]
    if t not in gguf.MODEL_TENSORS[_arch_enum(arch)]:
        raise ValueError(
            f"llama.cpp's {gguf_arch(arch)} has no tensor {gguf.TENSOR_NAMES[t]!r} (module {ours})"
        )
    return gguf.TENSOR_NAMES[t].format(bid=block)


def _keys():
    import gguf

    K = gguf.Keys
    return K.LLM, K.Attention, K.Rope


def config_fields(meta: dict, arch: str, path) -> dict:
    """ModelConfig fields that this family's metadata carries beyond the common ones."""
    from bitnetlm.formats.gguf_file import GGUFError

    llm, att, rope = _keys()
    name = gguf_arch(arch)

    def get(key, default=None):
        return meta.get(key.format(arch=name), default)

    if arch == "gpt2":
        return {"rms_norm_eps": float(get(att.LAYERNORM_EPS, 1e-5))}
    out = {"rms_norm_eps": float(get(att.LAYERNORM_RMS_EPS, 1e-6))}
    if arch != "gemma3":
        return out
    n = meta.get(llm.BLOCK_COUNT.format(arch=name))
    pattern = get(att.SLIDING_WINDOW_PATTERN, _GEMMA_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != n or not all(isinstance(x, bool) for x in pattern):
            raise GGUFError(f"{path}: {att.SLIDING_WINDOW_PATTERN.format(arch=name)} must be {n} booleans")
        sliding = pattern
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        sliding = [(i + 1) % pattern != 0 for i in range(n)]
    else:
        raise GGUFError(f"{path}: {att.SLIDING_WINDOW_PATTERN.format(arch=name)} is {pattern!r}")
    heads = meta.get(att.HEAD_COUNT.format(arch=name)) or 1
    head_dim = meta.get(att.KEY_LENGTH.format(arch=name)) or (
        meta.get(llm.EMBEDDING_LENGTH.format(arch=name)) // heads
    )
    scale = get(att.SCALE)
    cap = get(llm.FINAL_LOGIT_SOFTCAPPING)
    return out | {
        "sliding_window": get(att.SLIDING_WINDOW, 4096),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_local_theta": float(get(rope.FREQ_BASE_SWA, 10000.0)),
        "query_pre_attn_scalar": (scale**-2 if scale else head_dim),
        "final_logit_softcapping": None if cap is None else float(cap),
    }


def metadata(cfg, arch: str) -> tuple[dict, dict]:
    """(metadata, value types) of this family beyond the common keys; refuses what llama.cpp's graph cannot
    express here (another activation, soft-capped attention, a Qwen3 window)."""
    if cfg.hidden_act != ACTS[arch]:
        raise ValueError(
            f"GGUF {gguf_arch(arch)} implies hidden_act {ACTS[arch]!r}, the model has {cfg.hidden_act!r}"
        )
    llm, att, rope = _keys()
    name = gguf_arch(arch)
    k = lambda key: key.format(arch=name)  # noqa: E731
    if arch == "gpt2":
        return {k(att.LAYERNORM_EPS): float(cfg.rms_norm_eps)}, {}
    meta: dict = {
        k(att.LAYERNORM_RMS_EPS): float(cfg.rms_norm_eps),
        k(att.KEY_LENGTH): cfg.head_dim,
        k(att.VALUE_LENGTH): cfg.head_dim,
    }
    types = {k(att.KEY_LENGTH): (4, None), k(att.VALUE_LENGTH): (4, None)}
    if arch != "gemma3":
        if cfg.layer_types and "sliding_attention" in cfg.layer_types:
            raise ValueError(f"GGUF {name} has no sliding-window attention; the model's layer_types use it")
        return meta, types
    if cfg.attn_logit_softcapping is not None:
        raise ValueError("GGUF gemma3 has no attention soft-capping; the model sets attn_logit_softcapping")
    sliding = [cfg.is_sliding(i) for i in range(cfg.num_hidden_layers)]
    if sliding != [(i + 1) % _GEMMA_PATTERN != 0 for i in range(cfg.num_hidden_layers)]:
        meta[k(att.SLIDING_WINDOW_PATTERN)] = sliding
        types[k(att.SLIDING_WINDOW_PATTERN)] = (9, 7)  # ARRAY of BOOL
    meta[k(att.SLIDING_WINDOW)] = cfg.sliding_window or 0
    types[k(att.SLIDING_WINDOW)] = (4, None)
    if cfg.rope_local_theta != 10000.0:
        meta[k(rope.FREQ_BASE_SWA)] = float(cfg.rope_local_theta)
    if not math.isclose(cfg.query_pre_attn_scalar, cfg.head_dim):
        meta[k(att.SCALE)] = float(cfg.query_pre_attn_scalar) ** -0.5
    if cfg.final_logit_softcapping is not None:
        meta[k(llm.FINAL_LOGIT_SOFTCAPPING)] = float(cfg.final_logit_softcapping)
    return meta, types
