"""The ternary math: absmean weights, per-token int8 activations, STE, packing, BitLinear."""

from bitnetlm.quant.bitlinear import BitLinear, to_inference_
from bitnetlm.quant.packing import PackingFormat, pack, pack_base3, pack_hf, unpack, unpack_base3, unpack_hf
from bitnetlm.quant.ternary import (
    bitlinear_reference,
    fake_quant_activations,
    fake_quant_weight,
    int_matmul,
    quantize_activations,
    ste,
    ternarize,
    weight_scale,
)

__all__ = [
    "BitLinear",
    "to_inference_",
    "PackingFormat",
    "bitlinear_reference",
    "fake_quant_activations",
    "fake_quant_weight",
    "int_matmul",
    "pack",
    "pack_base3",
    "pack_hf",
    "quantize_activations",
    "ste",
    "ternarize",
    "unpack",
    "unpack_base3",
    "unpack_hf",
    "weight_scale",
]
