"""Quantization-aware training for any nn.Module: `quantize_` swaps nn.Linear for training BitLinear,
`convert_` turns training BitLinears into packed inference layers.

    model = MyModel()
    bitnetlm.quantize_(model)              # every nn.Linear except the LM head -> BitLinear(mode="train")
    ...ordinary loop: loss.backward(); optimizer.step()...
    bitnetlm.convert_(model)               # -> packed 2-bit inference BitLinear, same outputs

Both work in place (like torchao's `quantize_`) and also return the model.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from bitnetlm.quant.bitlinear import BitLinear

# Module names treated as the LM head (kept in floating point by default, as BitNet b1.58 does).
LM_HEAD_NAMES = ("lm_head", "embed_out", "output", "head", "classifier", "score")


@dataclass
class QuantizeConfig:
    """Which linears `quantize_` swaps and how the new BitLinears start.

    include / exclude: glob patterns (fnmatch) or regexes (prefix "re:") over module names as
      `model.named_modules()` spells them; a layer is swapped if it matches some include pattern
      (None = all) and no exclude pattern.
    types: module classes that are candidates (default: nn.Linear and subclasses).
    keep_lm_head: leave the output projection in floating point (matched by name, or by being the
      module returned by `model.get_output_embeddings()` for transformers models).
    quantize_input: per-token int8 activation fake quantization (W1.58A8); False = weights only.
    quant_lambda: starting blend for the quantization warm-up (1 = fully ternary from step 0).
    """

    include: list[str] | None = None
    exclude: list[str] = field(default_factory=list)
    types: tuple[type, ...] = (nn.Linear,)
    keep_lm_head: bool = True
    quantize_input: bool = True
    quant_lambda: float = 1.0


def _matches(name: str, patterns) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.search(p[3:], name):
                return True
        elif fnmatch.fnmatchcase(name, p) or name == p or name.endswith("." + p):
            return True
    return False


def _lm_head_modules(model: nn.Module) -> set[int]:
    ids = set()
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            head = get()
        except Exception:  # some models raise NotImplementedError
            head = None
        if head is not None:
            ids.add(id(head))
    for name, mod in model.named_modules():
        if name.split(".")[-1] in LM_HEAD_NAMES:
            ids.add(id(mod))
    return ids


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def quantize_(model: nn.Module, config: QuantizeConfig | None = None, **overrides) -> nn.Module:
    """Swap the matching nn.Linear layers of `model` for training-mode BitLinear, in place.

    Latent weights start as an fp32 copy of the original weights (so a pretrained model is the
    starting point); biases are kept. Keyword overrides are QuantizeConfig fields.
    Returns `model`. Raises ValueError if nothing matched (a silent no-op would train in full precision).
    """
    cfg = config or QuantizeConfig()
    if overrides:
        cfg = QuantizeConfig(**{**cfg.__dict__, **overrides})
    heads = _lm_head_modules(model) if cfg.keep_lm_head else set()
    targets = []
    for name, mod in model.named_modules():
        if isinstance(mod, BitLinear) or not isinstance(mod, cfg.types) or not name:
            continue
        if id(mod) in heads:
            continue
        if isinstance(mod, nn.modules.linear.NonDynamicallyQuantizableLinear):
            continue  # nn.MultiheadAttention's out_proj: MHA reads .weight directly, never calls forward
        if cfg.include is not None and not _matches(name, cfg.include):
            continue
        if _matches(name, cfg.exclude):
            continue
        targets.append((name, mod))
    if not targets:
        raise ValueError(
            f"quantize_: no layer of {type(model).__name__} matched (types={[t.__name__ for t in cfg.types]}, "
            f"include={cfg.include}, exclude={cfg.exclude}, keep_lm_head={cfg.keep_lm_head})"
        )
    for name, mod in targets:
        new = BitLinear.from_linear(mod, mode="train")
        new.quant_lambda = cfg.quant_lambda
        new.quantize_input = cfg.quantize_input
        new.train(mod.training)
        _set_submodule(model, name, new)
    _mark_ternary(model, "train")
    return model


def convert_(model: nn.Module) -> nn.Module:
    """Turn every training-mode BitLinear of `model` into a packed inference BitLinear, in place.

    The inference layer computes the same function as the training forward with quant_lambda = 1
    (absmean ternary weights, per-token int8 activations); warm-up blends are not representable.
    """
    n = 0
    for name, mod in list(model.named_modules()):
        if isinstance(mod, BitLinear) and mod.training_mode:
            new = mod.to_inference()
            new.train(mod.training)
            if name:
                _set_submodule(model, name, new)
            else:  # the model itself is a single BitLinear
                return new
            n += 1
    _mark_ternary(model, "infer")
    return model


def _mark_ternary(model: nn.Module, mode: str) -> None:
    # Our CausalLM records its mode and whether its projections are ternary; keep that truthful so that
    # bitnetlm.save writes the ternary layout.
    from bitnetlm.models.transformer import CausalLM

    if isinstance(model, CausalLM):
        model.mode = mode
        if model.config.quant != "ternary":
            model.config = model.config.replace(quant="ternary")


def bitlinears(model: nn.Module, training_only: bool = True) -> list[BitLinear]:
    return [m for m in model.modules() if isinstance(m, BitLinear) and (m.training_mode or not training_only)]


def set_quant_lambda(model: nn.Module, lam: float) -> None:
    """Set the quantization warm-up blend of every training BitLinear (0 = full precision, 1 = ternary)."""
    lam = float(min(max(lam, 0.0), 1.0))
    for m in bitlinears(model):
        m.quant_lambda = lam


def quant_lambda_at(step: int, warmup_steps: int, start: int = 0) -> float:
    """Linear quantization warm-up: 0 before `start`, rising to 1 at `start + warmup_steps`."""
    if warmup_steps <= 0:
        return 1.0
    return float(min(max((step - start) / warmup_steps, 0.0), 1.0))


def ternary_fraction(model: nn.Module) -> float:
    """Fraction of linear weights (excluding embeddings/head) that are ternary BitLinears."""
    tern = full = 0
    for m in model.modules():
        if isinstance(m, BitLinear):
            tern += m.in_features * m.out_features
        elif isinstance(m, nn.Linear):
            full += m.weight.numel()
    return tern / max(tern + full, 1)


@torch.no_grad()
def naive_ternarize_(model: nn.Module, config: QuantizeConfig | None = None) -> nn.Module:
    """Post-training absmean ternarization without any training (the baseline QAT must beat)."""
    return convert_(quantize_(model, config))
