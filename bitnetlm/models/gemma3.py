"""Gemma 3 text decoder (Gemma3ForCausalLM).

  h = embed(ids) * sqrt(hidden)                      (the scale rounded to the activations' dtype)
  h += post_attention_norm(attn(input_norm(h)))      per-head q/k norms, scale query_pre_attn_scalar^-0.5
  h += post_ffw_norm(down(gelu_tanh(gate(x)) * up(x)))   with x = pre_ffw_norm(h)
Every norm multiplies by (1 + w). Local layers attend to the last `sliding_window` positions only and rotate with
their own RoPE base; global layers see everything. The final logits are soft-capped where configured (the
attention scores are not: Gemma 3 has no attention soft-capping in transformers or llama.cpp).
"""

from __future__ import annotations

import torch

from bitnetlm.models.config import ModelConfig
from bitnetlm.models.transformer import Attention, Block, CausalLM, RMSNorm, attention_mask, window_mask


class GemmaRMSNorm(RMSNorm):
    """RMSNorm with weight w applied as (1 + w), computed in float32 (zero init is the identity)."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


class Gemma3Attention(Attention):
    def __init__(self, cfg: ModelConfig, mode: str):
        super().__init__(cfg, mode)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.query_pre_attn_scalar**-0.5
        # attn_logit_softcapping is carried, not applied: transformers' Gemma3 attention (and llama.cpp's) has none

    def qk_norm(self, q, k):
        return self.q_norm(q), self.k_norm(k)


class Gemma3Block(Block):
    attention = Gemma3Attention
    norm = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, mode: str, index: int = 0):
        super().__init__(cfg, mode, index)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, layer, cache, cache_pos, mask):
        a = self.self_attn(self.input_layernorm(h), cos, sin, layer, cache, cache_pos, mask)
        h = h + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3ForCausalLM(CausalLM):
    """inv_freq is [2, D/2]: the global layers' RoPE frequencies, then the local layers'."""

    block = Gemma3Block

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        return h * torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32).to(h.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return softcap(super().logits(h), self.config.final_logit_softcapping)

    def hidden(self, input_ids, positions=None, cache=None, cache_pos=None, input_mask=None) -> torch.Tensor:
        b, t = input_ids.shape
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        h = self.embed(input_ids)
        ropes = [self.rope(positions, h.dtype, inv) for inv in self.inv_freq]  # global, local
        cache_pos, mask = attention_mask(cache, positions, cache_pos, input_mask)
        local = window_mask(mask, positions, cache, cache_pos, self.config.sliding_window, input_mask)
        for i, layer in enumerate(self.layers):
            sliding = self.config.is_sliding(i)
            cos, sin = ropes[sliding]
            h = layer(h, cos, sin, i, cache, cache_pos, local if sliding else mask)
        return h
