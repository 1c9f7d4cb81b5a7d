"""Decoder-only transformer shared by BitNet b1.58 (2B4T), 1bitLLM and LLaMA-family models.

Block (BitNet, per FORMATS.md):
  h += o_proj(attn_sub_norm(attn(input_layernorm(h))))
  h += down_proj(ffn_sub_norm(act(gate_proj(x)) * up_proj(x)))   with x = post_attention_layernorm(h)
LLaMA has no sub-norms. GQA, RoPE in the HF rotate-half convention, no biases.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bitnetlm.models.cache import KVCache
from bitnetlm.models.config import ModelConfig
from bitnetlm.quant.bitlinear import BitLinear, multi_linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def _act(name: str):
    if name == "relu2":
        return lambda x: F.relu(x).square()
    if name == "silu":
        return F.silu
    if name in ("gelu", "gelu_pytorch_tanh"):
        return (lambda x: F.gelu(x, approximate="tanh")) if name.endswith("tanh") else F.gelu
    raise ValueError(f"unsupported hidden_act {name!r}; supported: relu2, silu, gelu, gelu_pytorch_tanh")


def make_linear(cfg: ModelConfig, mode: str, in_f: int, out_f: int, bias: bool = False) -> nn.Module:
    """The projection layer for `mode`: "infer" (packed BitLinear), "train" (latent BitLinear) or "fp" (nn.Linear)."""
    if mode == "fp" or cfg.quant == "none":
        return nn.Linear(in_f, out_f, bias=bias)
    return BitLinear(in_f, out_f, bias=bias, mode=mode)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies [D/2]; Gemma 3: [2, D/2], its global layers' then its local layers'."""
    inv = _inv_freq(cfg.head_dim, cfg.rope_theta)
    if cfg.arch == "gemma3":
        return torch.stack([_scaled(inv, cfg.rope_scaling), _inv_freq(cfg.head_dim, cfg.rope_local_theta)])
    return _scaled(inv, cfg.rope_scaling)


def _inv_freq(d: int, theta: float) -> torch.Tensor:
    # always computed on the CPU: under a meta-device context arange would go through slow reference ops
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float, device="cpu") / d))


def _scaled(inv: torch.Tensor, rope_scaling: dict | None) -> torch.Tensor:
    sc = rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "llama3":
        # Llama 3.1 frequency-dependent scaling (same formula as transformers' _compute_llama3_parameters)
        import math

        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = torch.where(is_mid, mid, scaled)
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, llama3")
    return inv


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class AttentionCore(nn.Module):
    """Attention over a KVCache: subclasses give `qkv` (projected, normed, rotated q/k/v) and `out`."""

    def setup(self, cfg: ModelConfig) -> None:
        self.n_heads, self.n_kv, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.scale: float | None = None  # None: 1/sqrt(head_dim)

    def forward(self, x, cos, sin, layer: int, cache: KVCache | None, cache_pos, mask):
        b, t, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)  # [B, H, T, D], [B, Hkv, T, D] x 2
        if cache is not None:
            k, v = cache.store(layer, k, v, cache_pos)  # the keys and values the mask's key axis names
            if k.device.type == "cpu" and not torch.compiler.is_compiling():
                # CPU: attend over the keys written so far only (later ones are masked out anyway), each row of a
                # decode step over its own (torch's CPU attention sums differently with the number of keys: a row
                # would otherwise compute something else beside longer rows)
                if t == 1 and b > 1:
                    ends = [cache.extent(layer, int(cache_pos[i, -1]), t) for i in range(b)]
                    o = torch.cat([self._attend_row(q, k, v, mask, i, n) for i, n in enumerate(ends)])
                    return self._out(o, b, t)
                n = cache.extent(layer, int(cache_pos.max()), t)
                k, v, mask = k[:, :, :n], v[:, :, :n], mask[..., :n]
            k, v = k.to(q.dtype), v.to(q.dtype)
        return self._out(self._attend(q, k, v, mask), b, t)

    def _attend_row(self, q, k, v, mask, i: int, n: int) -> torch.Tensor:
        """Row i's attention over its first n slots."""
        sl = slice(i, i + 1)
        return self._attend(q[sl], k[sl, :, :n].to(q.dtype), v[sl, :, :n].to(q.dtype), mask[sl, ..., :n])

    def _attend(self, q, k, v, mask) -> torch.Tensor:
        """Scaled dot-product attention of q [B, H, T, D] over k, v [B, Hkv, S, D] -> [B, H, T, D]."""
        b, t = q.shape[0], q.shape[2]
        if self.n_kv != self.n_heads and mask is not None:
            # GQA without copying K/V per head: the `rep` query heads of one KV head become rep*T query rows
            rep = self.n_heads // self.n_kv
            qg = q.reshape(b, self.n_kv, rep * t, self.head_dim)  # [B, Hkv, rep*T, D]
            mg = mask[:, :, None].expand(b, 1, rep, t, mask.shape[-1]).reshape(b, 1, rep * t, mask.shape[-1])
            return F.scaled_dot_product_attention(qg, k, v, attn_mask=mg, scale=self.scale).reshape(
                b, self.n_heads, t, self.head_dim
            )
        if self.n_kv != self.n_heads:
            rep = self.n_heads // self.n_kv
            k = k[:, :, None].expand(b, self.n_kv, rep, *k.shape[2:]).reshape(b, self.n_heads, *k.shape[2:])
            v = v[:, :, None].expand(b, self.n_kv, rep, *v.shape[2:]).reshape(b, self.n_heads, *v.shape[2:])
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, scale=self.scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)

    def _out(self, o: torch.Tensor, b: int, t: int) -> torch.Tensor:
        return self.out(o.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))  # [B, T, H*D]


class Attention(AttentionCore):
    """LLaMA / BitNet attention: q/k/v/o projections, RoPE, GQA, BitNet's sub-norm before o_proj."""

    def __init__(self, cfg: ModelConfig, mode: str):
        super().__init__()
        self.setup(cfg)
        h = cfg.hidden_size
        self.q_proj = make_linear(cfg, mode, h, self.n_heads * self.head_dim)
        self.k_proj = make_linear(cfg, mode, h, self.n_kv * self.head_dim)
        self.v_proj = make_linear(cfg, mode, h, self.n_kv * self.head_dim)
        self.o_proj = make_linear(cfg, mode, self.n_heads * self.head_dim, h)
        self.attn_sub_norm = RMSNorm(h, cfg.rms_norm_eps) if cfg.has_sub_norms else None

    def qkv(self, x, cos, sin):
        b, t, _ = x.shape
        q, k, v = multi_linear((self.q_proj, self.k_proj, self.v_proj), x)  # one kernel call where possible
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = self.qk_norm(q, k)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, D]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def qk_norm(self, q, k):
        """Per-head q/k normalisation before RoPE (none here; Qwen3 and Gemma3 have one)."""
        return q, k

    def out(self, o: torch.Tensor) -> torch.Tensor:
        if self.attn_sub_norm is not None:
            o = self.attn_sub_norm(o)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, mode: str):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = make_linear(cfg, mode, h, i)
        self.up_proj = make_linear(cfg, mode, h, i)
        self.down_proj = make_linear(cfg, mode, i, h)
        self.ffn_sub_norm = RMSNorm(i, cfg.rms_norm_eps) if cfg.has_sub_norms else None
        self.act = _act(cfg.hidden_act)

    def forward(self, x):
        g, u = multi_linear((self.gate_proj, self.up_proj), x)
        y = self.act(g) * u
        if self.ffn_sub_norm is not None:
            y = self.ffn_sub_norm(y)
        return self.down_proj(y)


class Block(nn.Module):
    attention = Attention
    norm = RMSNorm  # (dim, eps): this family's norm, the final one included

    def __init__(self, cfg: ModelConfig, mode: str, index: int = 0):
        super().__init__()
        self.input_layernorm = self.norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention(cfg, mode)
        self.post_attention_layernorm = self.norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, mode)

    def forward(self, h, cos, sin, layer, cache, cache_pos, mask):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, layer, cache, cache_pos, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class CausalLM(nn.Module):
    """model(input_ids [B, T], positions, cache, cache_pos, input_mask) -> logits [B, T, V] (see model API docs)."""

    block = Block

    def __init__(self, cfg: ModelConfig, mode: str = "infer"):
        super().__init__()
        if mode not in ("infer", "train", "fp"):
            raise ValueError(f"build_model mode must be 'infer', 'train' or 'fp', got {mode!r}")
        self.config = cfg
        self.mode = mode if cfg.quant == "ternary" else "fp"
        self.embed_tokens = nn.Embedding(cfg.embed_rows, cfg.hidden_size)
        self.layers = nn.ModuleList([self.block(cfg, self.mode, i) for i in range(cfg.num_hidden_layers)])
        self.norm = self.block.norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.head_rows, bias=False)
        )
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        if cfg.vocab_subset is not None:  # token id -> embedding row, and the head's rows -> token ids
            ids = torch.tensor(cfg.vocab_subset, dtype=torch.long, device="cpu")
            rows = torch.full((cfg.vocab_size,), len(ids), dtype=torch.long, device="cpu")
            rows[ids] = torch.arange(len(ids), device="cpu")
            self.register_buffer("token_rows", rows, persistent=False)
            self.register_buffer("head_ids", ids, persistent=False)

    # ---- parts ----------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.config.vocab_subset is not None:
            input_ids = self.token_rows[input_ids]
        return self.embed_tokens(input_ids)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's output [..., head rows (+1 for a tied reduced head)] as logits over the whole vocabulary:
        a reduced vocabulary's tokens at their ids, every other id -inf (never proposed, never sampled)."""
        if self.config.vocab_subset is None:
            return logits
        out = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., self.head_ids] = logits[..., : len(self.head_ids)]
        return out

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head (tied to the embedding unless the config says otherwise)."""
        h = self.norm(h)
        if self.lm_head is None:
            return self.full_logits(F.linear(h, self.embed_tokens.weight))
        return self.full_logits(self.lm_head(h))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype, inv_freq: torch.Tensor | None = None):
        inv_freq = self.inv_freq if inv_freq is None else inv_freq
        freqs = positions[..., None].float() * inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def new_cache(
        self, batch_size: int, max_seq_len: int | None = None, device=None, dtype=None, rings: bool = True
    ) -> KVCache:
        """A cache for this model (dtype None: the activations' dtype); its sliding-window layers keep rings
        unless `rings` is False."""
        cfg = self.config
        p = self.embed_tokens.weight
        # the heads its attention holds (a tensor-parallel shard holds only some of the model's)
        n_kv = self.layers[0].self_attn.n_kv if len(self.layers) else cfg.num_key_value_heads
        return KVCache(
            cfg.num_hidden_layers,
            batch_size,
            n_kv,
            max_seq_len or cfg.max_position_embeddings,
            cfg.head_dim,
            device=device or p.device,
            dtype=dtype or p.dtype,
            window=cfg.sliding_window,
            sliding=[cfg.is_sliding(i) for i in range(cfg.num_hidden_layers)],
            rings=rings,
        )

    def hidden_states(self, input_ids, positions=None, input_mask=None) -> torch.Tensor:
        """The last layer's hidden states after the final norm [B, T, H], without a cache or the LM head (what
        transformers' output_hidden_states gives last): the token vectors that embeddings pool."""
        return self.norm(self.hidden(input_ids, positions, input_mask=input_mask))

    # ---- forward --------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        cache_pos: torch.Tensor | None = None,
        input_mask: torch.Tensor | None = None,
        last_only: bool = False,
        return_hidden: bool = False,
    ):
        h = self.hidden(input_ids, positions, cache, cache_pos, input_mask)
        if last_only:
            h = h[:, -1:]
        out = self.logits(h)
        return (out, h) if return_hidden else out

    def hidden(self, input_ids, positions=None, cache=None, cache_pos=None, input_mask=None) -> torch.Tensor:
        """The last layer's output (before the final norm) [B, T, hidden]."""
        b, t = input_ids.shape
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        h = self.embed(input_ids)
        cos, sin = self.rope(positions, h.dtype)
        cache_pos, mask = attention_mask(cache, positions, cache_pos, input_mask)
        local = window_mask(mask, positions, cache, cache_pos, self.config.sliding_window, input_mask)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, i, cache, cache_pos, local if self.config.is_sliding(i) else mask)
        return h


def attention_mask(cache, positions, cache_pos, input_mask):
    """(cache_pos, mask [B, 1, T, S] or None for plain causal): marks the slots a cached forward writes."""
    if cache is not None:
        cache_pos = positions if cache_pos is None else cache_pos
        cache.mark(cache_pos, input_mask)
        return cache_pos, cache.attention_mask(cache_pos)
    if input_mask is None:
        return cache_pos, None
    t = input_mask.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=input_mask.device).tril()
    mask = causal[None] & input_mask[:, None, :]  # [B, T, T]
    eye = torch.eye(t, dtype=torch.bool, device=input_mask.device)
    return cache_pos, (mask | eye)[:, None]  # [B, 1, T, T]


def window_mask(mask, positions, cache, cache_pos, window: int | None, input_mask=None):
    """The sliding-window layers' mask: `mask` (None: causal) and key position > query position - window (None:
    no window). A cache with rings gives its ring layers' own (`KVCache.mark_ring`, which records this forward's
    writes: called once per forward); elsewhere a cache row holds position p at slot p, so a key's position is
    its slot."""
    if window is None:
        return mask
    if cache is not None and cache.ring is not None:
        return cache.mark_ring(cache_pos, input_mask)
    if cache is None:
        keys, queries = positions, positions
        if mask is None:
            t = positions.shape[1]
            mask = torch.ones(t, t, dtype=torch.bool, device=positions.device).tril()[None, None]
    else:
        keys = torch.arange(cache.max_seq_len, device=cache_pos.device)[None].expand(cache_pos.shape[0], -1)
        queries = cache_pos
    return mask & (keys[:, None, None, :] > queries[:, None, :, None] - window)
