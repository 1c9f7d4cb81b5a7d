"""Model configuration: one dataclass for every architecture we run, with HF config.json conversion."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

ARCHS = ("bitnet", "1bitllm", "llama")
_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _positive_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _get(d: dict, key: str, default):
    """d[key], or `default` where the key is absent or null (transformers writes null for unset fields)."""
    v = d.get(key)
    return default if v is None else v


def _require(ok: bool, name: str, expected: str, found) -> None:
    if not ok:
        raise ValueError(f"field {name!r} must be {expected}, found {found!r:.80}")


@dataclass
class ModelConfig:
    """Architecture hyper-parameters.

    arch: "bitnet" (BitNet b1.58 2B4T: ReLU^2 gated MLP, sub-norms), "1bitllm" (1bitLLM BitnetForCausalLM: SiLU,
    sub-norms named inner_attn_ln / ffn_layernorm, latent float weights), "llama" (plain full-precision LLaMA family).
    quant: "ternary" (projections are BitLinear) or "none" (plain nn.Linear, full precision).
    """

    arch: str = "bitnet"
    vocab_size: int = 128256
    hidden_size: int = 2560
    intermediate_size: int = 6912
    num_hidden_layers: int = 30
    num_attention_heads: int = 20
    num_key_value_heads: int = 5
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    rope_theta: float = 500000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-5
    hidden_act: str = "relu2"
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 128000
    eos_token_id: int | list[int] | None = 128001
    pad_token_id: int | None = None
    quant: str = "ternary"
    # how weight_scale is stored in the checkpoint this came from: "multiply" (autobitlinear) or "divide" (bitlinear)
    linear_class: str = "bitlinear"  # transformers BitNetQuantConfig default
    quantization_mode: str = "offline"  # offline = packed ternary on disk; online = float master weights
    # a reduced vocabulary (draft models): the token ids the LM head scores; every other id gets logit -inf and
    # shares one embedding row (row len(vocab_subset)). None: the whole vocabulary.
    vocab_subset: list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"ModelConfig.arch: expected one of {ARCHS}, found {self.arch!r}")
        for name in _SIZES:
            _require(_positive_int(getattr(self, name)), name, "a positive integer", getattr(self, name))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        _require(
            _positive_int(self.num_key_value_heads),
            "num_key_value_heads",
            "a positive integer",
            self.num_key_value_heads,
        )
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        _require(
            _positive_int(self.head_dim) and self.head_dim % 2 == 0,
            "head_dim",
            "a positive even integer (RoPE rotates pairs)",
            self.head_dim,
        )
        for name in ("rope_theta", "rms_norm_eps"):
            v = getattr(self, name)
            _require(_positive_number(v), name, "a positive finite number", v)
            setattr(self, name, float(v))
        _require(
            self.rope_scaling is None or isinstance(self.rope_scaling, dict),
            "rope_scaling",
            "an object or null",
            self.rope_scaling,
        )
        _require(isinstance(self.hidden_act, str), "hidden_act", "a string", self.hidden_act)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.quant not in ("ternary", "none"):
            raise ValueError(f"ModelConfig.quant: expected 'ternary' or 'none', found {self.quant!r}")
        if self.vocab_subset is not None:
            self._check_subset()

    def _check_subset(self) -> None:
        v = self.vocab_subset
        ok = isinstance(v, (list, tuple)) and len(v) > 0
        ok = ok and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.vocab_size for i in v
        )
        _require(ok, "vocab_subset", f"a non-empty list of ids in [0, {self.vocab_size})", v)
        _require(len(set(v)) == len(v), "vocab_subset", "ids without repeats", v)
        self.vocab_subset = [int(i) for i in v]

    @property
    def head_rows(self) -> int:
        """The LM head's rows: the reduced vocabulary's size, or vocab_size."""
        return self.vocab_size if self.vocab_subset is None else len(self.vocab_subset)

    @property
    def embed_rows(self) -> int:
        """The embedding's rows: one per head token plus one for every other id, or vocab_size."""
        return self.vocab_size if self.vocab_subset is None else len(self.vocab_subset) + 1

    @property
    def has_sub_norms(self) -> bool:
        return self.arch in ("bitnet", "1bitllm")

    @property
    def eos_token_ids(self) -> list[int]:
        e = self.eos_token_id
        if e is None:
            return []
        return list(e) if isinstance(e, (list, tuple)) else [int(e)]

    def num_parameters(self) -> int:
        """Parameter count as transformers reports it (tied head counted once)."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        if self.has_sub_norms:
            per_layer += h + i
        return (
            self.embed_rows * h + L * per_layer + h + (0 if self.tie_word_embeddings else self.head_rows * h)
        )

    # ---- HF config.json -------------------------------------------------------------------
    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a transformers config.json dict (BitNet, 1bitLLM and LLaMA families).

        Every field is checked here, before any model is built: a bad value is a one-line ValueError naming
        `source` and the field."""
        try:
            return cls._from_hf(cfg)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def _from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        if not isinstance(cfg, dict):
            raise ValueError(f"expected a JSON object, found {type(cfg).__name__}")
        for key, kind in (("architectures", list), ("quantization_config", dict), ("rope_parameters", dict)):
            _require(
                cfg.get(key) is None or isinstance(cfg[key], kind), key, f"a {kind.__name__}", cfg.get(key)
            )
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        qc = cfg.get("quantization_config") or {}
        if model_type == "bitnet" or "BitNetForCausalLM" in archs:
            arch = "bitnet"
            quant = "ternary" if qc.get("quant_method") == "bitnet" else "none"
        elif "BitnetForCausalLM" in archs or ("weight_bits" in cfg and model_type == "llama"):
            arch, quant = "1bitllm", "ternary"
            qc = {"linear_class": "autobitlinear", "quantization_mode": "online"}
        elif model_type in ("llama", "smollm", "mistral") or any(
            a in archs for a in ("LlamaForCausalLM", "MistralForCausalLM")
        ):
            arch, quant = "llama", "none"
            if qc.get("quant_method") == "bitnet":
                quant = "ternary"
        else:
            raise ValueError(
                f"unknown architecture (model_type={model_type!r}, architectures={archs}); "
                "supported: BitNetForCausalLM, BitnetForCausalLM (1bitLLM), LlamaForCausalLM"
            )
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            _require(_positive_int(cfg.get(key)), key, "a positive integer", cfg.get(key))
        rope = cfg.get("rope_parameters") or {}
        rope_theta = _get(cfg, "rope_theta", _get(rope, "rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        tie = cfg.get("tie_word_embeddings")
        tie = arch == "bitnet" if tie is None else tie
        _require(isinstance(tie, bool), "tie_word_embeddings", "true or false", tie)
        default_act = {"bitnet": "relu2", "1bitllm": "silu", "llama": "silu"}[arch]
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads"),
            head_dim=cfg.get("head_dim"),
            max_position_embeddings=_get(cfg, "max_position_embeddings", 2048),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=_get(cfg, "rms_norm_eps", 1e-6),
            hidden_act=_get(cfg, "hidden_act", default_act),
            tie_word_embeddings=tie,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            quant=quant,
            linear_class=qc.get("linear_class", "bitlinear"),
            quantization_mode=qc.get("quantization_mode", "offline"),
            vocab_subset=cfg.get("vocab_subset"),
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that transformers' BitNetForCausalLM / LlamaForCausalLM loads."""
        if (
            self.arch == "llama"
        ):  # a ternarized llama stays a llama (transformers' bitnet quantizer is generic)
            model_type, archs = "llama", ["LlamaForCausalLM"]
        else:
            model_type, archs = "bitnet", ["BitNetForCausalLM"]
        d: dict[str, Any] = {
            "architectures": archs,
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": self.hidden_act,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "attention_bias": False,
            "torch_dtype": "bfloat16",
        }
        if self.rope_scaling:
            d["rope_scaling"] = self.rope_scaling
        if self.vocab_subset is not None:
            d["vocab_subset"] = list(self.vocab_subset)
        if self.quant == "ternary":
            d["quantization_config"] = {
                "quant_method": "bitnet",
                "linear_class": "autobitlinear",
                "quantization_mode": "offline",
            }
        return d

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)
