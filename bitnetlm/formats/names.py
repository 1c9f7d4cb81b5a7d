"""The one table of tensor names: HF checkpoint names <-> our module names, per architecture family."""

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
QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
GEMMA_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
# 1bitLLM spells the sub-norms differently
ONEBIT_SUB_NORMS = {
    "self_attn.attn_sub_norm": "self_attn.inner_attn_ln",
    "mlp.ffn_sub_norm": "mlp.ffn_layernorm",
}
# GPT-2: our module (inside layers.N) -> HF module (inside transformer.h.N); its projections are Conv1D ([in, out])
GPT2_LAYER = {
    "input_layernorm": "ln_1",
    "self_attn.qkv_proj": "attn.c_attn",
    "self_attn.o_proj": "attn.c_proj",
    "post_attention_layernorm": "ln_2",
    "mlp.up_proj": "mlp.c_fc",
    "mlp.down_proj": "mlp.c_proj",
}
GPT2_TOP = {"embed_tokens": "wte", "embed_positions": "wpe", "norm": "ln_f"}
GPT2_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")
# buffers some checkpoints carry (rotary tables, GPT-2's causal mask), never weights
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def hf_name(ours: str, arch: str) -> str:
    """HF checkpoint name of our module `ours` (e.g. 'layers.0.self_attn.q_proj' -> 'model.layers.0....')."""
    if ours.startswith("lm_head"):
        return ours
    if arch == "gpt2":
        if ours in GPT2_TOP:
            return "transformer." + GPT2_TOP[ours]
        _, i, rest = ours.split(".", 2)
        return f"transformer.h.{i}.{GPT2_LAYER[rest]}"
    if arch == "1bitllm":
        for a, b in ONEBIT_SUB_NORMS.items():
            ours = ours.replace(a, b)
    return "model." + ours


def hf_transposed(ours: str, arch: str) -> bool:
    """Whether the HF checkpoint stores module `ours`'s float weight transposed ([in, out]: GPT-2's Conv1D)."""
    return arch == "gpt2" and ours.split(".", 2)[-1] in GPT2_PROJECTIONS


def layer_modules(num_layers: int, sub_norms: bool):
    """Yield (our module name, kind) for every weight-bearing module of a LLaMA/BitNet decoder: kind in
    proj/norm/embed."""
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


def model_modules(cfg):
    """(our module name, kind) for every weight-bearing module of `cfg`'s model (kind: proj/norm/embed); a
    module's bias, where it has one, travels with its weight."""
    if cfg.arch == "gpt2":
        yield "embed_tokens", "embed"
        yield "embed_positions", "embed"
        for i in range(cfg.num_hidden_layers):
            for n in GPT2_LAYER:
                yield f"layers.{i}.{n}", "proj" if n in GPT2_PROJECTIONS else "norm"
        yield "norm", "norm"
        return
    if cfg.arch not in ("qwen3", "gemma3"):
        yield from layer_modules(cfg.num_hidden_layers, cfg.has_sub_norms)
        return
    yield "embed_tokens", "embed"
    for i in range(cfg.num_hidden_layers):
        for p in PROJECTIONS:
            yield f"layers.{i}.{p}", "proj"
        for n in LAYER_NORMS + QK_NORMS + (GEMMA_NORMS if cfg.arch == "gemma3" else ()):
            yield f"layers.{i}.{n}", "norm"
    yield "norm", "norm"


# BERT-family encoders: our module name -> transformers' BertModel name (an optional "bert." prefix is accepted)
BERT_EMBEDDINGS = {
    "word_embeddings": "embeddings.word_embeddings",
    "position_embeddings": "embeddings.position_embeddings",
    "token_type_embeddings": "embeddings.token_type_embeddings",
    "embed_norm": "embeddings.LayerNorm",
}
BERT_LAYER = {
    "query": "attention.self.query",
    "key": "attention.self.key",
    "value": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "ffn_norm": "output.LayerNorm",
}
BERT_PROJECTIONS = ("query", "key", "value", "attn_output", "ffn_up", "ffn_down")
# tensors of a BERT checkpoint that an encoder does not use: the pooler (sentence pooling replaces it, as in
# llama.cpp's converter), task heads, transformers' position-id buffer
BERT_IGNORED_PREFIXES = ("pooler.", "cls.", "embeddings.position_ids")


def bert_modules(num_layers: int):
    """Yield (our module name, HF module name, kind) for every weight-bearing module of an encoder: kind in
    embed / norm / proj."""
    for ours, hf in BERT_EMBEDDINGS.items():
        yield ours, hf, "norm" if ours == "embed_norm" else "embed"
    for i in range(num_layers):
        for ours, hf in BERT_LAYER.items():
            yield (
                f"layers.{i}.{ours}",
                f"encoder.layer.{i}.{hf}",
                "proj" if ours in BERT_PROJECTIONS else "norm",
            )
