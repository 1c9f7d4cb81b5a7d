"""`shard_(model, tp)`: a loaded inference model becomes this rank's tensor-parallel shard, in place.

Attention keeps heads [r*H/N, (r+1)*H/N) and KV heads likewise (so each query head keeps its KV head), the MLP
intermediate columns [r*I/N, (r+1)*I/N); embedding and head keep a vocabulary slice. Ternary scales are those
of the whole matrices (absmean over the unsharded weight), never recomputed per shard.
"""

from __future__ import annotations

import weakref

from torch import nn

from bitnetlm.models.transformer import RMSNorm
from bitnetlm.parallel.group import TPGroup
from bitnetlm.parallel.layers import GatheredNorm, RowParallel, VocabEmbedding, VocabHead, vocab_shard
from bitnetlm.quant.bitlinear import BitLinear

_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # sharded model -> its TPGroup


def group_of(model) -> TPGroup | None:
    """The group `model` was sharded over (None: a whole model)."""
    return _groups.get(model)


def check_shardable(cfg, size: int) -> None:
    """A one-line ValueError unless `cfg`'s heads and MLP split evenly over `size` ranks."""
    if cfg.family != "llama":  # the shard plan knows the LLaMA/BitNet layer only
        raise ValueError(f"--tp {size}: tensor parallelism runs LLaMA/BitNet-shaped models, not {cfg.arch}")
    h, kv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    if h % size or kv % size:
        raise ValueError(
            f"--tp {size}: the model's {h} attention heads and {kv} key-value heads must both divide by {size}"
        )
    if inter % size:
        raise ValueError(f"--tp {size}: the model's intermediate_size {inter} must divide by {size}")


def _rows(linear: nn.Module, lo: int, hi: int) -> nn.Module:
    """`linear` with only output rows [lo, hi) (a column-parallel shard: the whole input on every rank)."""
    if linear.bias is not None:
        raise ValueError("tensor parallelism: projections with a bias are not supported")
    if isinstance(linear, BitLinear):
        if linear.training_mode:
            raise ValueError("tensor parallelism runs inference models (load with mode='infer')")
        out = BitLinear.from_ternary(linear.ternary_weight()[lo:hi].contiguous(), linear.scale())
        if linear.kernel is not None:
            out.use_kernel(linear.kernel)
        return out
    out = nn.Linear(linear.in_features, hi - lo, bias=False, device=linear.weight.device)
    out.weight = nn.Parameter(linear.weight.detach()[lo:hi].clone(), requires_grad=False)
    return out


def _cols(linear: nn.Module, lo: int, hi: int, tp: TPGroup) -> RowParallel:
    if linear.bias is not None:
        raise ValueError("tensor parallelism: projections with a bias are not supported")
    if isinstance(linear, BitLinear) and linear.training_mode:
        raise ValueError("tensor parallelism runs inference models (load with mode='infer')")
    return RowParallel(linear, lo, hi, tp)


def _norm(norm: RMSNorm | None, tp: TPGroup) -> GatheredNorm | None:
    return None if norm is None else GatheredNorm(norm, tp)


def _shard_block(blk, tp: TPGroup) -> None:
    a, f, r, n = blk.self_attn, blk.mlp, tp.rank, tp.size
    hd, h, kv = a.head_dim, a.n_heads // n, a.n_kv // n
    q0, k0 = r * h * hd, r * kv * hd
    a.q_proj = _rows(a.q_proj, q0, q0 + h * hd)
    a.k_proj = _rows(a.k_proj, k0, k0 + kv * hd)
    a.v_proj = _rows(a.v_proj, k0, k0 + kv * hd)
    a.o_proj = _cols(a.o_proj, q0, q0 + h * hd, tp)
    a.attn_sub_norm = _norm(a.attn_sub_norm, tp)
    a.n_heads, a.n_kv = h, kv
    i = f.down_proj.in_features // n
    i0 = r * i
    f.gate_proj = _rows(f.gate_proj, i0, i0 + i)
    f.up_proj = _rows(f.up_proj, i0, i0 + i)
    f.down_proj = _cols(f.down_proj, i0, i0 + i, tp)
    f.ffn_sub_norm = _norm(f.ffn_sub_norm, tp)


def shard_(model, tp: TPGroup):
    """Make `model` (a loaded inference CausalLM, the same weights on every rank) rank `tp.rank`'s shard of
    `tp.size`, in place; returns it. Runners made for it afterwards run tensor-parallel (`runtime.tp`)."""
    if model in _groups:
        raise ValueError("the model is sharded already")
    check_shardable(model.config, tp.size)
    if type(model.embed_tokens) is not nn.Embedding:
        raise ValueError(
            "tensor parallelism needs the float embedding and LM head (--head-dtype is not supported with --tp)"
        )
    if model.lm_head is not None and (type(model.lm_head) is not nn.Linear or model.lm_head.bias is not None):
        raise ValueError(f"tensor parallelism: unsupported LM head {type(model.lm_head).__name__}")
    if tp.size > 1:
        for blk in model.layers:
            _shard_block(blk, tp)
        vocab = model.config.vocab_size
        emb = VocabEmbedding(model.embed_tokens.weight, tp)
        head = emb.weight if model.lm_head is None else vocab_shard(model.lm_head.weight, tp)
        model.embed_tokens, model.lm_head = emb, VocabHead(head, vocab, tp)
    _groups[model] = tp
    return model
