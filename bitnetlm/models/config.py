"""Model configuration: one dataclass for every architecture we run, with HF config.json conversion."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

ARCHS = ("bitnet", "1bitllm", "llama", "qwen3", "gemma3", "gpt2")
LLAMA_SHAPED = ("bitnet", "1bitllm", "llama")  # one decoder layer shape (models/transformer.py)
_GPT2_ACTS = {"gelu_new": "gelu_pytorch_tanh", "gelu_pytorch_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}
_LAYER_TYPES = ("full_attention", "sliding_attention")
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
    sub-norms named inner_attn_ln / ffn_layernorm, latent float weights), "llama" (plain full-precision LLaMA family),
    "qwen3" (LLaMA layers with per-head q/k RMSNorm), "gemma3" (Gemma 3 text: sandwich (1 + w) norms, GELU-tanh,
    local sliding-window and global layers), "gpt2" (learned positions, LayerNorm, biases, GELU MLP).
    For gpt2, rms_norm_eps holds the LayerNorm epsilon.
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
    # Gemma 3: attention scale query_pre_attn_scalar^-0.5, local layers' window and RoPE base, soft-capping
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
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
        self._check_gemma()
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
        _require(self.family == "llama", "vocab_subset", "a LLaMA/BitNet model", self.arch)
        self.vocab_subset = [int(i) for i in v]

    @property
    def head_rows(self) -> int:
        """The LM head's rows: the reduced vocabulary's size, or vocab_size."""
        return self.vocab_size if self.vocab_subset is None else len(self.vocab_subset)

    @property
    def embed_rows(self) -> int:
        """The embedding's rows: one per head token plus one for every other id, or vocab_size."""
        return self.vocab_size if self.vocab_subset is None else len(self.vocab_subset) + 1

    def _check_gemma(self) -> None:
        for name in (
            "query_pre_attn_scalar",
            "rope_local_theta",
            "attn_logit_softcapping",
            "final_logit_softcapping",
        ):
            v = getattr(self, name)
            _require(v is None or _positive_number(v), name, "a positive finite number or null", v)
        w = self.sliding_window
        _require(w is None or _positive_int(w), "sliding_window", "a positive integer or null", w)
        lt = self.layer_types
        if lt is not None:
            ok = (
                isinstance(lt, list)
                and len(lt) == self.num_hidden_layers
                and all(t in _LAYER_TYPES for t in lt)
            )
            _require(ok, "layer_types", f"{self.num_hidden_layers} of {_LAYER_TYPES}", lt)
            _require(
                w is not None or "sliding_attention" not in lt, "sliding_window", "set for sliding layers", w
            )

    @property
    def family(self) -> str:
        """ "llama" for the LLaMA/BitNet layer shape that the fused CPU step and the CUDA engine run, else arch."""
        return "llama" if self.arch in LLAMA_SHAPED else self.arch

    @property
    def shift_unsupported(self) -> str | None:
        """Why the context shift cannot re-rotate this model's cached keys by one RoPE angle, or None."""
        return {"gemma3": "two RoPE bases", "gpt2": "learned positions"}.get(self.arch)

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

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
        if self.arch == "gpt2":  # fused qkv, up/down, biases, two LayerNorms; learned positions
            per_layer = 4 * h * h + 2 * h * i + 9 * h + i
            emb = (self.vocab_size + self.max_position_embeddings) * h
            return emb + L * per_layer + 2 * h + (0 if self.tie_word_embeddings else self.vocab_size * h)
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        if self.has_sub_norms:
            per_layer += h + i
        if self.arch in ("qwen3", "gemma3"):
            per_layer += 2 * self.head_dim + (2 * h if self.arch == "gemma3" else 0)
        head = 0 if self.tie_word_embeddings else self.head_rows * h
        return self.embed_rows * h + L * per_layer + h + head

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
        arch, quant, qc, cfg = _arch_of(cfg)
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            _require(_positive_int(cfg.get(key)), key, "a positive integer", cfg.get(key))
        rope = cfg.get("rope_parameters") or {}
        if arch == "gemma3":
            rope = rope.get("full_attention") or rope
            _require(isinstance(rope, dict), "rope_parameters", "an object", rope)
        base = 1_000_000.0 if arch == "gemma3" else 10000.0
        rope_theta = _get(cfg, "rope_theta", _get(rope, "rope_theta", base))
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        tie = cfg.get("tie_word_embeddings")
        tie = arch in ("bitnet", "gemma3", "gpt2") if tie is None else tie
        _require(isinstance(tie, bool), "tie_word_embeddings", "true or false", tie)
        default_act = {"bitnet": "relu2", "gemma3": "gelu_pytorch_tanh", "gpt2": "gelu_pytorch_tanh"}.get(
            arch, "silu"
        )
        if arch == "gemma3":
            default_act = _get(cfg, "hidden_activation", default_act)
        if cfg.get("attention_bias") and arch != "gpt2":
            raise ValueError(f"field 'attention_bias' must be false for {arch} (not supported)")
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
            **(_gemma3_fields(cfg) if arch == "gemma3" else _qwen3_fields(cfg) if arch == "qwen3" else {}),
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that transformers' model class for this architecture loads (a ternarized LLaMA,
        Qwen3 or Gemma3 keeps its class: transformers' bitnet quantizer is generic)."""
        model_type, archs = {
            "llama": ("llama", ["LlamaForCausalLM"]),
            "qwen3": ("qwen3", ["Qwen3ForCausalLM"]),
            "gemma3": ("gemma3_text", ["Gemma3ForCausalLM"]),
            "gpt2": ("gpt2", ["GPT2LMHeadModel"]),
        }.get(self.arch, ("bitnet", ["BitNetForCausalLM"]))
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
        if self.arch == "gemma3":
            d.update(_gemma3_hf(self))
        elif self.arch == "gpt2":
            d = _gpt2_hf(self, d)
        elif self.arch == "qwen3" and self.sliding_window is not None:
            d.update(
                use_sliding_window=True, sliding_window=self.sliding_window, layer_types=self.layer_types
            )
        if self.quant == "ternary":
            d["quantization_config"] = {
                "quant_method": "bitnet",
                "linear_class": "autobitlinear",
                "quantization_mode": "offline",
            }
        return d

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)


_FAMILIES = {"qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "gpt2": "GPT2LMHeadModel"}


def _gpt2_as_common(cfg: dict) -> dict:
    """GPT-2's config.json keys under the common names (n_embd -> hidden_size, ...)."""
    act = cfg.get("activation_function", "gelu_new")
    _require(act in _GPT2_ACTS, "activation_function", f"one of {sorted(_GPT2_ACTS)}", act)
    for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        _require(not cfg.get(key), key, "false (not supported)", cfg.get(key))
    _require(
        cfg.get("scale_attn_weights", True) is True,
        "scale_attn_weights",
        "true",
        cfg.get("scale_attn_weights"),
    )
    hidden, inner = cfg.get("n_embd"), cfg.get("n_inner")
    return {
        **cfg,
        "hidden_size": hidden,
        "num_hidden_layers": cfg.get("n_layer"),
        "num_attention_heads": cfg.get("n_head"),
        "num_key_value_heads": cfg.get("n_head"),
        "intermediate_size": inner if inner is not None else (4 * hidden if _positive_int(hidden) else None),
        "max_position_embeddings": cfg.get("n_positions"),
        "rms_norm_eps": _get(cfg, "layer_norm_epsilon", 1e-5),
        "hidden_act": _GPT2_ACTS[act],
        "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
    }


def _gemma3_fields(cfg: dict) -> dict:
    rope = cfg.get("rope_parameters") or {}
    local = rope.get("sliding_attention") if isinstance(rope.get("sliding_attention"), dict) else {}
    layers = cfg.get("layer_types")
    if layers is None:
        pattern = _get(cfg, "sliding_window_pattern", 6)
        _require(_positive_int(pattern), "sliding_window_pattern", "a positive integer", pattern)
        n = cfg["num_hidden_layers"]
        layers = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    return dict(
        query_pre_attn_scalar=_get(cfg, "query_pre_attn_scalar", 256),
        sliding_window=_get(cfg, "sliding_window", 4096),
        layer_types=layers,
        rope_local_theta=_get(local, "rope_theta", _get(cfg, "rope_local_base_freq", 10000.0)),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
    )


def _arch_of(cfg: dict[str, Any]) -> tuple[str, str, dict, dict[str, Any]]:
    """(our arch, quant, quantization_config, cfg with GPT-2's names mapped to the common ones) of a config.json."""
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
    elif model_type in _FAMILIES or any(a in archs for a in _FAMILIES.values()):
        arch = next(k for k, v in _FAMILIES.items() if model_type == k or v in archs)
        arch = {"gemma3_text": "gemma3"}.get(arch, arch)
        quant = "ternary" if qc.get("quant_method") == "bitnet" else "none"
        if arch == "gpt2":
            cfg = _gpt2_as_common(cfg)
    else:
        raise ValueError(
            f"unknown architecture (model_type={model_type!r}, architectures={archs}); supported: "
            "BitNetForCausalLM, BitnetForCausalLM (1bitLLM), LlamaForCausalLM, Qwen3ForCausalLM, "
            "Gemma3ForCausalLM, GPT2LMHeadModel"
        )
    return arch, quant, qc, cfg


def _qwen3_fields(cfg: dict) -> dict:
    """Qwen3's optional window, as transformers reads it: with use_sliding_window, the layers from
    max_window_layers on (or those layer_types names) attend to the last sliding_window positions."""
    if not cfg.get("use_sliding_window"):
        return {}
    n = cfg["num_hidden_layers"]
    first = _get(cfg, "max_window_layers", 28)
    _require(isinstance(first, int) and first >= 0, "max_window_layers", "a non-negative integer", first)
    layers = cfg.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(n)
    ]
    return dict(sliding_window=cfg.get("sliding_window"), layer_types=layers)


def _gemma3_hf(c: ModelConfig) -> dict[str, Any]:
    return {
        "hidden_activation": c.hidden_act,
        "query_pre_attn_scalar": c.query_pre_attn_scalar,
        "sliding_window": c.sliding_window,
        "layer_types": c.layer_types,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": c.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_local_theta},
        },
        "attn_logit_softcapping": c.attn_logit_softcapping,
        "final_logit_softcapping": c.final_logit_softcapping,
    }


def _gpt2_hf(c: ModelConfig, d: dict[str, Any]) -> dict[str, Any]:
    act = {"gelu_pytorch_tanh": "gelu_new"}.get(c.hidden_act, c.hidden_act)
    keep = ("architectures", "model_type", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
    return {
        **{k: d[k] for k in keep},
        "n_embd": c.hidden_size,
        "n_layer": c.num_hidden_layers,
        "n_head": c.num_attention_heads,
        "n_inner": c.intermediate_size,
        "n_positions": c.max_position_embeddings,
        "layer_norm_epsilon": c.rms_norm_eps,
        "activation_function": act,
        "tie_word_embeddings": c.tie_word_embeddings,
        "torch_dtype": d["torch_dtype"],
    }
