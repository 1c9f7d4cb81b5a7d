"""Config dataclasses and architectures (BitNet b1.58 2B4T, 1bitLLM, LLaMA family, Qwen3, Gemma 3 text, GPT-2;
BERT-family encoders)."""

import contextlib

import torch
from torch import nn

from bitnetlm.models.bert import Encoder, EncoderConfig
from bitnetlm.models.cache import KVCache
from bitnetlm.models.config import ModelConfig
from bitnetlm.models.transformer import CausalLM

_INIT_FNS = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_", "zeros_", "ones_")


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The model class of `config`'s architecture family."""
    if config.arch == "qwen3":
        from bitnetlm.models.qwen3 import Qwen3ForCausalLM

        return Qwen3ForCausalLM
    if config.arch == "gemma3":
        from bitnetlm.models.gemma3 import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    if config.arch == "gpt2":
        from bitnetlm.models.gpt2 import GPT2LMHeadModel

        return GPT2LMHeadModel
    return CausalLM


def build_model(config: ModelConfig, mode: str = "infer") -> CausalLM:
    """A model for `config`: mode "infer" (packed ternary), "train" (latent fp32 + STE) or "fp" (nn.Linear)."""
    return model_class(config)(config, mode)


@contextlib.contextmanager
def _skip_init():
    # Random init of tensors that a loader overwrites anyway is wasted work; on the meta device it also routes
    # through torch's Python reference ops (and imports torch._dynamo), which costs seconds.
    saved = {name: getattr(nn.init, name) for name in _INIT_FNS}
    try:
        for name in _INIT_FNS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def build_empty_model(config: ModelConfig, mode: str = "infer") -> CausalLM:
    """`build_model` on the meta device without initialisation: for loaders that assign every tensor."""
    with _skip_init(), torch.device("meta"):
        return model_class(config)(config, mode)


def build_empty_encoder(config: EncoderConfig, mode: str = "infer") -> Encoder:
    """An encoder on the meta device without initialisation: for loaders that assign every tensor."""
    with _skip_init(), torch.device("meta"):
        return Encoder(config, mode)


__all__ = [
    "CausalLM",
    "Encoder",
    "EncoderConfig",
    "KVCache",
    "ModelConfig",
    "build_empty_encoder",
    "build_empty_model",
    "build_model",
    "model_class",
]
