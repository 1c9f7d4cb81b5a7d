"""BitLinear: the ternary linear layer, in a training mode and an inference mode.

training mode: latent float weights; forward fake-quantizes weights (absmean ternary) and activations
  (per-token int8) with the straight-through estimator. `quant_lambda` in [0, 1] blends
  w + lambda*(quant(w) - w) for a gradual quantization warm-up (1 = fully ternary).
inference mode: packed 2-bit weights + one float scale s (multiply convention: W ~= T*s), computed by its
  `kernel` (a backend object that `bitnetlm.kernels.prepare` gives it, packed in that backend's layout), or
  without one by the reference math over the checkpoint's HF 2-bit layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bitnetlm.quant.packing import PackingFormat, pack, unpack, unpack_hf
from bitnetlm.quant.ternary import (
    bitlinear_reference,
    fake_quant_activations,
    fake_quant_weight,
    ste,
    ternarize,
)

_OWN_LAYOUTS = (PackingFormat.HF_2BIT, PackingFormat.BASE3, PackingFormat.INT8)


class BitLinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        mode: str = "train",
        device=None,
        dtype=None,
    ):
        super().__init__()
        if mode not in ("train", "infer"):
            raise ValueError(f"BitLinear mode must be 'train' or 'infer', got {mode!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.training_mode = mode == "train"
        self.quant_lambda = 1.0
        self.quantize_input = True  # per-token int8 activations (A8); False = weights-only fake quant
        if self.training_mode:
            self.weight = nn.Parameter(
                torch.empty(out_features, in_features, device=device, dtype=dtype or torch.float32)
            )
            nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        else:
            self.weight = None
            rows = (out_features + 3) // 4
            self.register_buffer("packed", torch.zeros(rows, in_features, dtype=torch.uint8, device=device))
            self.register_buffer("weight_scale", torch.ones(1, dtype=torch.float32, device=device))
            self.layout = PackingFormat.HF_2BIT
            self.kernel = None  # the backend computing this layer (kernels.prepare); None: the reference math
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype or torch.float32))
        else:
            self.register_parameter("bias", None)

    # ---- construction helpers -------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: str = "train") -> BitLinear:
        """A BitLinear with `linear`'s weights (latent copy in training mode, ternarized in inference mode)."""
        m = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            mode="train",
            device=linear.weight.device,
            dtype=torch.float32,
        )
        with torch.no_grad():
            m.weight.copy_(linear.weight.float())
            if linear.bias is not None:
                m.bias.copy_(linear.bias.float())
        return m.to_inference() if mode == "infer" else m

    @classmethod
    def from_ternary(
        cls, t: torch.Tensor, scale: torch.Tensor | float, bias: torch.Tensor | None = None
    ) -> BitLinear:
        """An inference-mode BitLinear from int8 ternary T [N, K] and scale s (W ~= T*s)."""
        n, k = t.shape
        m = cls(k, n, bias=bias is not None, mode="infer", device=t.device)
        m.load_ternary(t, scale)
        if bias is not None:
            with torch.no_grad():
                m.bias.copy_(bias)
        return m

    def load_ternary(self, t: torch.Tensor, scale: torch.Tensor | float) -> None:
        """Set inference weights from canonical int8 ternary T and scale s, in the current layout."""
        if tuple(t.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"BitLinear.load_ternary: expected shape {(self.out_features, self.in_features)}, found {tuple(t.shape)}"
            )
        t = t.to(torch.int8)
        self.packed = pack(t, self.layout) if self.layout in _OWN_LAYOUTS else self.kernel.pack(t)
        self.weight_scale = torch.as_tensor(scale, dtype=torch.float32, device=t.device).reshape(1).clone()

    def to_inference(self) -> BitLinear:
        """Inference-mode copy of a training-mode layer (absmean ternarization of the latent weights)."""
        if not self.training_mode:
            return self
        t, s = ternarize(self.weight)
        m = BitLinear.from_ternary(t, s, None if self.bias is None else self.bias.detach().float())
        m.quantize_input = self.quantize_input
        return m

    # ---- inference-mode helpers -----------------------------------------------------------
    def ternary_weight(self) -> torch.Tensor:
        """Canonical int8 ternary T [N, K] (training mode: of the current latent weights)."""
        if self.training_mode:
            return ternarize(self.weight)[0]
        shape = (self.out_features, self.in_features)
        if PackingFormat(self.layout) in _OWN_LAYOUTS:
            return unpack(self.packed, self.layout, shape)
        return self.kernel.unpack(self.packed, shape)

    def scale(self) -> torch.Tensor:
        if self.training_mode:
            return ternarize(self.weight)[1].reshape(1)
        return self.weight_scale

    def use_kernel(self, kernel) -> None:
        """Compute this layer with `kernel` (a backend object: `layout`, `pack`, `unpack`, `linear`, optionally
        `repack`), repacking the weights into its layout if needed. `bitnetlm.kernels.prepare` chooses it."""
        if PackingFormat(kernel.layout) is not PackingFormat(self.layout):
            shape = (self.out_features, self.in_features)
            repack = getattr(kernel, "repack", None)  # a direct layout-to-layout path, when it has one
            p = repack(self.packed, self.layout, shape) if repack is not None else None
            if p is None:
                p = kernel.pack(self.ternary_weight())
            self.layout = PackingFormat(kernel.layout)
            self.packed = p
        self.kernel = kernel

    # ---- forward -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training_mode:
            w = self.weight
            wq = ste(w, fake_quant_weight(w), self.quant_lambda)
            if self.quantize_input:
                x = ste(x, fake_quant_activations(x), self.quant_lambda)
            return F.linear(x, wq.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        kernel = self.kernel
        if kernel is None:
            y = bitlinear_reference(x, unpack_hf(self.packed, self.out_features), self.weight_scale)
        elif kernel.is_available(self.packed.device):
            y = kernel.linear(x, self.packed, self.weight_scale, self.out_features)
        else:
            raise RuntimeError(
                f"BitLinear: packed for the {kernel.name!r} kernels, which cannot run on {self.packed.device}; "
                "call bitnetlm.kernels.prepare(model, device) after moving the model"
            )
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # State dicts always hold the canonical HF layout, whatever the backend computes with.
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not self.training_mode and PackingFormat(self.layout) is not PackingFormat.HF_2BIT:
            destination[prefix + "packed"] = pack(self.ternary_weight(), PackingFormat.HF_2BIT)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        loads = not self.training_mode and prefix + "packed" in state_dict
        if loads:
            self.layout = PackingFormat.HF_2BIT
            self.packed = torch.empty_like(state_dict[prefix + "packed"])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if loads and self.kernel is not None:  # back into the kernel's layout
            self.use_kernel(self.kernel)

    def extra_repr(self) -> str:
        mode = "train" if self.training_mode else f"infer, layout={PackingFormat(self.layout).value}"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {mode}"


def to_inference_(model: nn.Module) -> nn.Module:
    """In place: replace every training-mode BitLinear of `model` by its packed inference-mode twin."""
    for name, child in list(model.named_children()):
        if isinstance(child, BitLinear) and child.training_mode:
            setattr(model, name, child.to_inference())
        else:
            to_inference_(child)
    if hasattr(model, "mode") and getattr(model, "mode", None) == "train":
        model.mode = "infer"
    return model


def multi_linear(layers, x: torch.Tensor) -> list[torch.Tensor]:
    """[layer(x) for layer in layers], as one kernel call where possible.

    Inference BitLinears that share a backend offering `linear_multi` (the CPU kernels) are computed together:
    one activation quantization and one thread dispatch for q/k/v or gate/up. Results are identical.
    """
    be = getattr(layers[0], "kernel", None)
    if (
        be is not None
        and hasattr(be, "linear_multi")
        and all(
            isinstance(m, BitLinear) and not m.training_mode and m.bias is None and m.kernel is be
            for m in layers
        )
        and be.is_available(x.device)
    ):
        return be.linear_multi(
            x, [m.packed for m in layers], [m.weight_scale for m in layers], [m.out_features for m in layers]
        )
    return [m(x) for m in layers]
