"""The CPU runner: the eager runner with every layer of a step in one C call (`kernels.cpu.decode.FusedStep`),
and the CPU-side model options: the compact embedding + LM head (bf16 / int8) and the threads.

A model runs fused when its projections are inference BitLinears on the "cpu" backend without biases, its
norms fp32 RMSNorms, its activation relu2 or silu; otherwise (and for a step the C code does not take) the
model's own layers run, through the same C projections. A float LM head runs in C either way (`logits`): a
row's logits then do not depend on the other rows of the batch.
"""

from __future__ import annotations

import torch
from torch import nn

from bitnetlm.kernels import configure_threads
from bitnetlm.kernels import cpu as cpu_kernels
from bitnetlm.kernels.cpu.decode import PROJ, FusedStep, LayerTensors, StepShape, accepts
from bitnetlm.kernels.cpu.decode import why_not as _kernel_why_not
from bitnetlm.kernels.cpu.head import HEAD_DTYPES, CompactEmbedding, CompactHead
from bitnetlm.kernels.cpu.probe import choose_layout
from bitnetlm.models.transformer import MLP, Attention, Block, RMSNorm
from bitnetlm.quant.bitlinear import BitLinear
from bitnetlm.runtime.config import RuntimeConfig
from bitnetlm.runtime.eager import EagerRunner


def _layer(blk, eps: float) -> LayerTensors | str:
    """One block's tensors for the fused step, or why it cannot run there."""
    if type(blk) is not Block or (type(blk.self_attn), type(blk.mlp)) != (Attention, MLP):
        return f"layer type {type(blk).__name__}"
    a, f = blk.self_attn, blk.mlp
    lins = [getattr(a, p) for p in PROJ[:4]] + [getattr(f, p) for p in PROJ[4:]]
    for lin in lins:
        if not isinstance(lin, BitLinear) or lin.training_mode or lin.bias is not None:
            return f"projection {type(lin).__name__} (needs inference BitLinear without bias)"
        if getattr(lin.kernel, "name", None) != "cpu" or lin.packed.device.type != "cpu":
            return f"projection backend {getattr(lin.kernel, 'name', None)!r}"
        if lin.kernel is not lins[0].kernel:
            return "projections of one layer in two weight layouts"
    norms = (blk.input_layernorm, blk.post_attention_layernorm, a.attn_sub_norm, f.ffn_sub_norm)
    for n in norms:
        if n is not None and (type(n) is not RMSNorm or n.eps != eps):
            return f"norm {type(n).__name__} (eps {getattr(n, 'eps', None)})"
    w = [None if n is None else n.weight.data for n in norms]
    packed, scales = tuple(m.packed for m in lins), tuple(m.weight_scale for m in lins)
    return LayerTensors(w[0], w[1], w[2], w[3], packed, scales, lins[0].kernel.code)


def why_not(model) -> str | None:
    """None if `model`'s layers can run in the fused C step, else the reason they cannot."""
    built = fused_step(model)
    return built if isinstance(built, str) else None


def fused_step(model) -> FusedStep | str:
    """The fused C step over `model`'s layers, or the reason there is none."""
    cfg = model.config
    if cfg.family != "llama":
        return f"the fused C step runs LLaMA/BitNet layers, not {cfg.arch}"
    if any(cfg.is_sliding(i) for i in range(cfg.num_hidden_layers)):
        return "the fused C step has no sliding-window layers"
    layers = []
    for blk in model.layers:
        got = _layer(blk, cfg.rms_norm_eps)
        if isinstance(got, str):
            return got
        layers.append(got)
    shape = StepShape(
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.rms_norm_eps,
        cfg.hidden_act,
    )
    reason = _kernel_why_not(shape, layers)
    return reason if reason is not None else FusedStep(shape, layers)


def fused_forward(
    model,
    step: FusedStep | None,
    ids,
    positions=None,
    cache=None,
    cache_pos=None,
    input_mask=None,
    last_only: bool = False,
    return_hidden: bool = False,
):
    """`model(ids, positions, cache, ...)` with its layers in one C call and its float LM head in C (the same
    arguments and results); the model's own layers run where the step does not qualify (step None, or a cache or
    shape the C code does not take), and the model's own forward without a cache or with autograd on."""
    b, t = ids.shape
    if cache is None or torch.is_grad_enabled():
        return model(ids, positions, cache, cache_pos, input_mask, last_only, return_hidden)
    if positions is None:
        positions = torch.arange(t, device=ids.device).expand(b, t)
    cache_pos = positions if cache_pos is None else cache_pos
    h = None
    if step is not None and accepts(
        step.shape, step.n_layers, cache.k, cache.v, cache.valid, b, t, cache_pos
    ):
        e = model.embed(ids)
        if e.dtype == torch.float32:
            cos, sin = model.rope(positions, e.dtype)
            cache.mark(cache_pos, input_mask)
            h = step(e, cos, sin, cache.k, cache.v, cache.valid, cache_pos)
    if h is None:  # the model's own layers (of any family)
        h = model.hidden(ids, positions, cache, cache_pos, input_mask)
    if last_only:
        h = h[:, -1:]
    out = logits(model, h)
    return (out, h) if return_hidden else out


def logits(model, h: torch.Tensor) -> torch.Tensor:
    """`model.logits(h)` (final norm + LM head), a float32 or bf16 head through the C kernels. torch's float GEMM
    picks its kernel, and with it each row's summation order, by the number of rows, so a row's logits would
    depend on what else is in the batch; the C kernel sums every row alike (a compact head is C already)."""
    w, head = model.lm_head_weight(), model.lm_head
    plain = head is None or (type(head) is nn.Linear and head.bias is None)
    plain = plain and getattr(model.config, "final_logit_softcapping", None) is None
    if not (plain and h.dtype == torch.float32 and w.dtype in (torch.float32, torch.bfloat16)):
        return model.logits(h)
    if w.device.type != "cpu" or not w.is_contiguous() or not cpu_kernels.available():
        return model.logits(h)
    from bitnetlm.kernels.cpu import ops  # registers the custom ops: on first use

    return model.full_logits(ops.head_float(model.norm(h), w))


class CpuRunner(EagerRunner):
    """EagerRunner whose steps run the fused C layers (see the module docstring)."""

    def __init__(self, model, config: RuntimeConfig, rows: int, max_seq_len: int):
        super().__init__(model, config, rows, max_seq_len)
        built = fused_step(model) if not model.training else "the model is in training mode"
        self.fused = None if isinstance(built, str) else built
        self.why_not = built if isinstance(built, str) else None

    def forward(self, ids, positions, cache, cache_pos=None, input_mask=None, every=False) -> torch.Tensor:
        out = fused_forward(
            self.model, self.fused, ids, positions, cache, cache_pos, input_mask, last_only=not every
        )
        return out if every else out[:, -1]


def set_head_dtype(model, dtype: str | None) -> None:
    """Give `model` a compact embedding + LM head ("bf16" or "int8", CPU decode); None changes nothing.

    Tied models keep one matrix for both uses and drop the float embedding; untied ones get a compact head and a
    compact embedding each. Inference only: a model converted this way is not meant to be trained or saved."""
    if dtype is None:
        return
    if dtype not in HEAD_DTYPES:
        raise ValueError(f"head_dtype: expected one of {', '.join(HEAD_DTYPES)}, found {dtype!r}")
    emb = CompactHead(model.embed_tokens.weight, dtype)
    head = emb if model.lm_head is None else CompactHead(model.lm_head.weight, dtype)
    model.embed_tokens = CompactEmbedding(emb)
    model.lm_head = head


def apply(model, config: RuntimeConfig) -> None:
    """The CPU options of `config` on a loaded model: its head storage, the kernel threads and the ternary
    weights' layout (after the threads: choosing "auto" times the kernels)."""
    set_head_dtype(model, config.head_dtype)
    configure_threads(model, config.threads)
    set_weights_layout(model, config.weights_layout)


def weights_layout(model) -> str | None:
    """The layout ("2bit" or "base3") of `model`'s ternary weights on the C kernels, None when none are."""
    for m in model.modules():
        if isinstance(m, BitLinear) and not m.training_mode and getattr(m.kernel, "name", None) == "cpu":
            return "base3" if m.kernel.base3 else "2bit"
    return None


def set_weights_layout(model, layout: str) -> str | None:
    """Repack `model`'s C-kernel ternary weights into `layout`: "2bit" (cpu-2bit-v2), "base3" (cpu-base3-v1, 1.6
    bits a weight) or "auto" (the faster one here for this model's matrices, timed: `kernels.cpu.probe`). Returns
    the layout now in use (None: no weights on the C kernels, nothing changed)."""
    if layout not in ("auto", *cpu_kernels.WEIGHTS_LAYOUTS):
        raise ValueError(f"weights_layout: expected auto, 2bit or base3, found {layout!r}")
    lins = [
        m
        for m in model.modules()
        if isinstance(m, BitLinear) and not m.training_mode and getattr(m.kernel, "name", None) == "cpu"
    ]
    if not lins:
        return None
    if layout == "auto":
        layout = choose_layout(lins)
    backend = cpu_kernels.WEIGHTS_LAYOUTS[layout]
    for m in lins:
        m.use_kernel(backend)
    return layout
