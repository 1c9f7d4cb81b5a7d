"""Config dataclasses and architectures (BitNet b1.58 2B4T, 1bitLLM, LLaMA family)."""

from bitnetlm.models.cache import KVCache
from bitnetlm.models.config import ModelConfig
from bitnetlm.models.transformer import CausalLM


def build_model(config: ModelConfig, mode: str = "infer") -> CausalLM:
    """A model for `config`: mode "infer" (packed ternary), "train" (latent fp32 + STE) or "fp" (nn.Linear)."""
    return CausalLM(config, mode)


__all__ = ["CausalLM", "KVCache", "ModelConfig", "build_model"]
