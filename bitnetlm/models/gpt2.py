"""GPT-2 (GPT2LMHeadModel): learned absolute positions, pre-LayerNorm blocks with biases, one fused q/k/v
projection (HF's Conv1D c_attn, stored transposed; loaders give it here as [3 * hidden, hidden]), a GELU MLP."""

from __future__ import annotations

import torch
from torch import nn

from bitnetlm.models.config import ModelConfig
from bitnetlm.models.transformer import AttentionCore, CausalLM, _act, attention_mask, make_linear


class GPT2Attention(AttentionCore):
    def __init__(self, cfg: ModelConfig, mode: str):
        super().__init__()
        self.setup(cfg)
        h = cfg.hidden_size
        self.qkv_proj = make_linear(cfg, mode, h, 3 * h, bias=True)
        self.o_proj = make_linear(cfg, mode, h, h, bias=True)

    def qkv(self, x, cos, sin):
        b, t, _ = x.shape
        y = self.qkv_proj(x).view(b, t, 3, self.n_heads, self.head_dim)
        return tuple(y[:, :, j].transpose(1, 2) for j in range(3))  # q, k, v: [B, H, T, D]

    def out(self, o: torch.Tensor) -> torch.Tensor:
        return self.o_proj(o)


class GPT2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, mode: str):
        super().__init__()
        self.up_proj = make_linear(cfg, mode, cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.down_proj = make_linear(cfg, mode, cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = _act(cfg.hidden_act)

    def forward(self, x):
        return self.down_proj(self.act(self.up_proj(x)))


class GPT2Block(nn.Module):
    norm = nn.LayerNorm

    def __init__(self, cfg: ModelConfig, mode: str, index: int = 0):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GPT2Attention(cfg, mode)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GPT2MLP(cfg, mode)

    def forward(self, h, cos, sin, layer, cache, cache_pos, mask):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, layer, cache, cache_pos, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class GPT2LMHeadModel(CausalLM):
    block = GPT2Block

    def __init__(self, cfg: ModelConfig, mode: str = "infer"):
        super().__init__(cfg, mode)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)

    def hidden(self, input_ids, positions=None, cache=None, cache_pos=None, input_mask=None) -> torch.Tensor:
        b, t = input_ids.shape
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        h = self.embed(input_ids)
        h = h + self.embed_positions(positions).to(h.dtype)
        cache_pos, mask = attention_mask(cache, positions, cache_pos, input_mask)
        for i, layer in enumerate(self.layers):
            h = layer(h, None, None, i, cache, cache_pos, mask)
        return h
