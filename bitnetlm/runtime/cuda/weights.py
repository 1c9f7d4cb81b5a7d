"""The CUDA engine's weights: from a bitnetlm model (ternary or dense) or random in the real packed layout.

Each projection group of a layer becomes one tensor (q|k|v and gate|up fused by rows) with its per-row scales;
`CudaEngine.from_model` and `CudaEngine.random` hand the result to the engine's constructor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bitnetlm.models.config import ModelConfig


@dataclass
class Layer:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    attn_sub_norm: torch.Tensor | None
    ffn_sub_norm: torch.Tensor | None
    qkv: torch.Tensor  # ternary: packed uint8 [Nq+2Nkv, Kp]; dense: [Nq+2Nkv, hidden]
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    qkv_scale: torch.Tensor | None = None  # per output row (q, k, v scales differ)
    o_scale: torch.Tensor | None = None
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None

    @classmethod
    def of(cls, norms, qkv, o, gate_up, down) -> Layer:
        """norms: (input, post-attention, attention SubLN, FFN SubLN); each projection a (weights, scales) pair."""
        return cls(*norms, qkv[0], o[0], gate_up[0], down[0], qkv[1], o[1], gate_up[1], down[1])


@dataclass
class Weights:
    layers: list[Layer]
    embed: torch.Tensor
    final_norm: torch.Tensor
    head: torch.Tensor | None  # None: tied to the embedding
    inv_freq: torch.Tensor


def on_device(t: torch.Tensor, dev: torch.device) -> bool:
    """t is on dev ("cuda" meaning the current CUDA device, as .to("cuda") reads it)."""
    if dev.type == "cuda" and dev.index is None:
        return t.is_cuda and t.device.index == torch.cuda.current_device()
    return t.device == dev


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: w ~= q * s[:, None]."""
    s = w.float().abs().amax(dim=1).clamp(min=1e-8) / 127.0
    q = (w.float() / s[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, s


def _ternary_group(mods, dev: torch.device, share: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """BitLinears stacked by rows into the kernels' packed layout, with one scale per output row. share: point
    the modules at row slices of the stacked tensor when they already hold the layout on dev (no copy)."""
    from bitnetlm.kernels.triton.layout import pack_triton
    from bitnetlm.quant.bitlinear import BitLinear
    from bitnetlm.quant.packing import PackingFormat

    ss = []
    for m in mods:
        if not isinstance(m, BitLinear):
            raise TypeError(
                f"CudaEngine ternary weights need BitLinear projections, found {type(m).__name__}"
            )
        if m.bias is not None:
            raise ValueError("CudaEngine: biased BitLinear layers are not supported")
        ss.append(m.scale().float().reshape(1).expand(m.out_features))
    if all(not m.training_mode and m.layout == PackingFormat.TRITON_2BIT for m in mods):
        if share and all(on_device(m.packed, dev) for m in mods):
            packed = mods[0].packed if len(mods) == 1 else torch.cat([m.packed for m in mods])
            r = 0
            for m in mods:  # rows r..r+n-1 of the fused tensor: contiguous views, no copy
                n = m.packed.shape[0]
                m.packed = packed[r : r + n]
                r += n
        else:  # rows already in the kernels' layout
            packed = torch.cat([m.packed for m in mods]).to(dev)
    else:
        packed = pack_triton(torch.cat([m.ternary_weight() for m in mods]).to(dev))
    return packed, torch.cat(ss).to(dev).contiguous()


def _dense_group(mods, dev: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, None]:
    """Full-precision matrices stacked by rows (a BitLinear's ternary weights times its scale): the baseline."""
    from bitnetlm.quant.bitlinear import BitLinear

    ws = []
    for m in mods:
        if isinstance(m, BitLinear):
            ws.append(m.ternary_weight().float() * m.scale().float())
        else:
            ws.append(m.weight.float())
    return torch.cat(ws).to(dev, dtype).contiguous(), None


def from_model(model, weights: str, dtype: torch.dtype, dev: torch.device, share: bool = False) -> Weights:
    """The engine's weights of a bitnetlm CausalLM: weights "ternary" (BitLinear projections) or "dense"."""
    if model.config.family != "llama":
        raise TypeError(f"the CUDA-graph engine runs LLaMA/BitNet layers, not {model.config.arch}")
    if model.config.vocab_subset is not None:
        raise ValueError("a model with a reduced vocabulary (vocab_subset) runs on the CPU only")

    def build(mods):
        return _ternary_group(mods, dev, share) if weights == "ternary" else _dense_group(mods, dev, dtype)

    def norm(n):
        return None if n is None else n.weight.detach().to(dev, torch.float32).contiguous()

    layers = []
    for blk in model.layers:
        at, mlp = blk.self_attn, blk.mlp
        norms = (blk.input_layernorm, blk.post_attention_layernorm, at.attn_sub_norm, mlp.ffn_sub_norm)
        layers.append(
            Layer.of(
                tuple(norm(n) for n in norms),
                build([at.q_proj, at.k_proj, at.v_proj]),
                build([at.o_proj]),
                build([mlp.gate_proj, mlp.up_proj]),
                build([mlp.down_proj]),
            )
        )
    embed = model.embed_tokens.weight.detach().to(dev)
    head = None if model.lm_head is None else model.lm_head.weight.detach().to(dev)
    return Weights(layers, embed, norm(model.norm), head, model.inv_freq)


def random(cfg: ModelConfig, weights: str, dtype: torch.dtype, dev: torch.device, seed: int = 0) -> Weights:
    """Random weights of `cfg`'s exact shapes, in the real packed layout (benchmarks; no checkpoint needed)."""
    from bitnetlm.kernels.triton.layout import pack_triton
    from bitnetlm.models.transformer import rope_inv_freq

    g = torch.Generator(device=dev).manual_seed(seed)
    h, i = cfg.hidden_size, cfg.intermediate_size
    nq, nkv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim

    def mat(n, k, parts=1):
        if weights == "ternary":
            t = torch.randint(-1, 2, (n, k), device=dev, dtype=torch.int8, generator=g)
            s = 0.02 + 0.01 * torch.rand(parts, device=dev, generator=g)
            return pack_triton(t), s.repeat_interleave(n // parts).contiguous()
        return (0.02 * torch.randn(n, k, device=dev, generator=g)).to(dtype), None

    def nrm(n):
        return 1 + 0.1 * torch.randn(n, device=dev, generator=g)

    layers = []
    for _ in range(cfg.num_hidden_layers):
        projs = (
            mat(nq + 2 * nkv, h),
            mat(h, nq),
            mat(2 * i, h, parts=2),
            mat(h, i),
        )  # drawn before the norms
        sub = cfg.has_sub_norms
        layers.append(Layer.of((nrm(h), nrm(h), nrm(nq) if sub else None, nrm(i) if sub else None), *projs))
    embed = torch.randn(cfg.vocab_size, h, device=dev, generator=g).to(dtype)
    head = (
        None if cfg.tie_word_embeddings else torch.randn(cfg.vocab_size, h, device=dev, generator=g).to(dtype)
    )
    return Weights(layers, embed, nrm(h), head, rope_inv_freq(cfg))
