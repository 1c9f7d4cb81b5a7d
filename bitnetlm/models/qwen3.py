"""Qwen3: LLaMA layers with an RMSNorm over each head's queries and keys before RoPE, no attention bias."""

from __future__ import annotations

from bitnetlm.models.config import ModelConfig
from bitnetlm.models.transformer import Attention, Block, CausalLM, RMSNorm


class Qwen3Attention(Attention):
    def __init__(self, cfg: ModelConfig, mode: str):
        super().__init__(cfg, mode)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def qk_norm(self, q, k):
        return self.q_norm(q), self.k_norm(k)


class Qwen3Block(Block):
    attention = Qwen3Attention


class Qwen3ForCausalLM(CausalLM):
    block = Qwen3Block
