"""The one table of tensor names: HF checkpoint names <-> our module names."""

from __future__ import annotations

PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
SUB_NORMS = ("self_attn.attn_sub_norm", "mlp.ffn_sub_norm")
# 1bitLLM spells the sub-norms differently
ONEBIT_SUB_NORMS = {
    "self_attn.attn_sub_norm": "self_attn.inner_attn_ln",
    "mlp.ffn_sub_norm": "mlp.ffn_layernorm",
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_name(ours: str, arch: str) -> str:
    """HF checkpoint name of our parameter `ours` (e.g. 'layers.0.self_attn.q_proj' -> 'model.layers.0....')."""
    if ours.startswith("lm_head"):
        return ours
    if arch == "1bitllm":
        for a, b in ONEBIT_SUB_NORMS.items():
            ours = ours.replace(a, b)
    return "model." + ours


def layer_modules(num_layers: int, sub_norms: bool):
    """Yield (our module name, kind) for every weight-bearing module of a decoder: kind in proj/norm/embed."""
    yield "embed_tokens", "embed"
    for i in range(num_layers):
        for p in PROJECTIONS:
            yield f"layers.{i}.{p}", "proj"
        for n in LAYER_NORMS:
            yield f"layers.{i}.{n}", "norm"
        if sub_norms:
            for n in SUB_NORMS:
                yield f"layers.{i}.{n}", "norm"
    yield "norm", "norm"
