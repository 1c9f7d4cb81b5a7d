"""BERT-family encoders (BERT, MiniLM): absolute positions, token types, post-LN blocks, GELU, biases.

Block (transformers' BertLayer):
  h = LN(h + attn_output(attention(h)))        bidirectional, padded keys masked out
  h = LN(h + ffn_down(act(ffn_up(h))))
Projections are ternary BitLinear layers (with their float biases) or plain nn.Linear; embeddings and
LayerNorms stay in floating point. Pooling into sentence vectors lives in `bitnetlm.embedding`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bitnetlm.quant.bitlinear import BitLinear

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "lasttoken")
_ACTS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "type_vocab_size",
)


@dataclass
class EncoderConfig:
    """A BERT-family encoder and how its token vectors become one sentence vector.

    quant: "ternary" (projections are BitLinear) or "none". pooling: the sentence-transformers pooling modes
    (concatenated in this order), normalize: L2-normalise the pooled vector (a `Normalize` module)."""

    vocab_size: int = 30522
    hidden_size: int = 384
    intermediate_size: int = 1536
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int | None = 0
    quant: str = "none"
    linear_class: str = "bitlinear"
    quantization_mode: str = "offline"
    pooling: tuple[str, ...] = ("mean",)
    normalize: bool = False
    max_seq_length: int | None = None

    arch = "bert"

    def __post_init__(self):
        for name in _SIZES:
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
                raise ValueError(f"field {name!r} must be a positive integer, found {v!r:.80}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"field 'hidden_size' ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )
        eps = self.layer_norm_eps
        if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0 < eps < 1):
            raise ValueError(f"field 'layer_norm_eps' must be a small positive number, found {eps!r:.80}")
        self.layer_norm_eps = float(eps)
        if self.hidden_act not in _ACTS:
            raise ValueError(
                f"field 'hidden_act' must be one of {sorted(_ACTS)}, found {self.hidden_act!r:.80}"
            )
        if self.quant not in ("ternary", "none"):
            raise ValueError(f"EncoderConfig.quant: expected 'ternary' or 'none', found {self.quant!r}")
        self.pooling = tuple(self.pooling)
        bad = [m for m in self.pooling if m not in POOLING_MODES]
        if bad or not self.pooling:
            raise ValueError(f"pooling mode {bad or '(none)'}: expected some of {', '.join(POOLING_MODES)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def embedding_dim(self) -> int:
        return self.hidden_size * len(self.pooling)

    @property
    def max_tokens(self) -> int:
        """Longest input (special tokens included): sentence-transformers' max_seq_length, else the positions."""
        n = self.max_seq_length or self.max_position_embeddings
        return min(n, self.max_position_embeddings)

    def num_parameters(self) -> int:
        """Parameter count of the encoder as transformers' BertModel reports it, less the pooler."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        per_layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 4 * h
        emb = (self.vocab_size + self.max_position_embeddings + self.type_vocab_size) * h + 2 * h
        return emb + L * per_layer

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> EncoderConfig:
        """From a transformers BertConfig dict (model_type "bert"); a bad field is one line naming `source`."""
        try:
            qc = cfg.get("quantization_config") or {}
            if not isinstance(qc, dict):
                raise ValueError(f"field 'quantization_config' must be an object, found {qc!r:.80}")
            pet = cfg.get("position_embedding_type", "absolute")
            if pet not in (None, "absolute"):
                raise ValueError(f"field 'position_embedding_type' must be 'absolute', found {pet!r:.80}")
            return cls(
                **{k: cfg.get(k) for k in _SIZES},
                layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
                hidden_act=cfg.get("hidden_act", "gelu"),
                pad_token_id=cfg.get("pad_token_id"),
                quant="ternary" if qc.get("quant_method") == "bitnet" else "none",
                linear_class=qc.get("linear_class", "bitlinear"),
                quantization_mode=qc.get("quantization_mode", "offline"),
            )
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that transformers' BertModel loads (offline packed ternary when quantized)."""
        d: dict[str, Any] = {
            "architectures": ["BertModel"],
            "model_type": "bert",
            **{k: getattr(self, k) for k in _SIZES},
            "layer_norm_eps": self.layer_norm_eps,
            "hidden_act": self.hidden_act,
            "pad_token_id": self.pad_token_id,
            "position_embedding_type": "absolute",
            "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0,
        }
        if self.quant == "ternary":
            d["quantization_config"] = {
                "quant_method": "bitnet",
                "linear_class": "autobitlinear",
                "quantization_mode": "offline",
                "modules_to_not_convert": ["pooler"],
            }
        return d

    def replace(self, **kw) -> EncoderConfig:
        return dataclasses.replace(self, **kw)


def _linear(cfg: EncoderConfig, mode: str, in_f: int, out_f: int) -> nn.Module:
    if mode == "fp":
        return nn.Linear(in_f, out_f, bias=True)
    return BitLinear(in_f, out_f, bias=True, mode=mode)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig, mode: str):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.query = _linear(cfg, mode, h, h)
        self.key = _linear(cfg, mode, h, h)
        self.value = _linear(cfg, mode, h, h)
        self.attn_output = _linear(cfg, mode, h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.ffn_up = _linear(cfg, mode, h, i)
        self.ffn_down = _linear(cfg, mode, i, h)
        self.ffn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.act = _ACTS[cfg.hidden_act]

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = (
            m(h).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
            for m in (self.query, self.key, self.value)
        )
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, T, D]
        o = o.transpose(1, 2).reshape(b, t, -1)
        h = self.attn_norm(h + self.attn_output(o))
        return self.ffn_norm(h + self.ffn_down(self.act(self.ffn_up(h))))


class Encoder(nn.Module):
    """model(input_ids [B, T], attention_mask [B, T] (1 = token, 0 = padding), token_type_ids) -> [B, T, H]."""

    def __init__(self, cfg: EncoderConfig, mode: str = "infer"):
        super().__init__()
        if mode not in ("infer", "train", "fp"):
            raise ValueError(f"Encoder mode must be 'infer', 'train' or 'fp', got {mode!r}")
        self.config = cfg
        self.mode = mode if cfg.quant == "ternary" else "fp"
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList([EncoderLayer(cfg, self.mode) for _ in range(cfg.num_hidden_layers)])

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        t = input_ids.shape[1]
        if t > self.config.max_position_embeddings:
            raise ValueError(
                f"input of {t} tokens is longer than the model's {self.config.max_position_embeddings} positions"
            )
        pos = torch.arange(t, device=input_ids.device)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.embed_norm(x + self.position_embeddings(pos)[None])

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.embed(input_ids, token_type_ids)
        mask = None
        if attention_mask is not None:
            mask = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, T]: every query sees the real tokens
        for layer in self.layers:
            h = layer(h, mask)
        return h


def build_encoder(config: EncoderConfig, mode: str = "infer") -> Encoder:
    """An encoder for `config`: mode "infer" (packed ternary), "train" (latent fp32 + STE) or "fp" (nn.Linear)."""
    return Encoder(config, mode)


def pool(hidden: torch.Tensor, mask: torch.Tensor, modes: tuple[str, ...]) -> torch.Tensor:
    """Sentence vectors [B, len(modes) * H] from token vectors [B, T, H] and the attention mask [B, T], as
    sentence-transformers' Pooling computes each mode (the modes concatenated in the order given)."""
    b, t, _ = hidden.shape
    rows = torch.arange(b, device=hidden.device)
    m = mask.to(hidden.dtype).unsqueeze(-1)
    out = []
    for mode in modes:
        if mode == "cls":  # the first real token (left padding skipped)
            out.append(hidden[rows, mask.int().argmax(dim=1)])
        elif mode == "max":
            out.append(hidden.masked_fill(m == 0, float("-inf")).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            n = m.sum(dim=1).clamp(min=1e-9)
            out.append((hidden * m).sum(dim=1) / (n if mode == "mean" else n.sqrt()))
        elif mode == "lasttoken":  # the last real token (right padding skipped)
            found, back = mask.flip(1).max(dim=1)
            back = torch.where(found == 0, t - 1, back)
            out.append(hidden[rows, t - 1 - back])
        else:
            raise ValueError(f"pooling mode {mode!r}: expected one of {', '.join(POOLING_MODES)}")
    return torch.cat(out, dim=-1)
