#!/usr/bin/env python3
"""Write a BitNet checkpoint of a real shape with random weights, in the real packed HF format (offline
autobitlinear: U8 projections with out_features/4 rows, one weight_scale each, BF16 embedding and norms).

Random weights: numbers measured on it are speed/memory numbers, not quality. Cached: rerunning is free.
Usage: python benchmarks/make_checkpoint.py [--shape 2b4t|large|tiny] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPES = {
    # microsoft/bitnet-b1.58-2B-4T (FORMATS.md)
    "2b4t": dict(
        hidden_size=2560,
        intermediate_size=6912,
        num_hidden_layers=30,
        num_attention_heads=20,
        num_key_value_heads=5,
        vocab_size=128256,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        hidden_act="relu2",
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    # 1bitLLM/bitnet_b1_58-large dimensions in the 2B4T architecture (ReLU^2, sub-norms)
    "large": dict(
        hidden_size=1536,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32002,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        hidden_act="relu2",
        bos_token_id=1,
        eos_token_id=2,
    ),
    "tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        hidden_act="relu2",
        bos_token_id=1,
        eos_token_id=2,
    ),
}


def write_checkpoint(out: str | os.PathLike, shape: str = "2b4t", seed: int = 0) -> Path:
    from bitnetlm.quant.packing import pack_hf

    out = Path(out)
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    c = dict(SHAPES[shape])
    h, i, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(seed)
    sd = {
        "model.embed_tokens.weight": (torch.randn(c["vocab_size"], h, generator=g) * 0.02).bfloat16(),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
    }
    projs = {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }
    for layer in range(L):
        p = f"model.layers.{layer}."
        for name, (n, k) in projs.items():
            t = torch.randint(-1, 2, (n, k), dtype=torch.int8, generator=g)
            sd[p + name + ".weight"] = pack_hf(t)
            sd[p + name + ".weight_scale"] = torch.tensor(
                [0.5 + torch.rand(1, generator=g).item()], dtype=torch.bfloat16
            )
        for name, d in (
            ("input_layernorm", h),
            ("post_attention_layernorm", h),
            ("self_attn.attn_sub_norm", h),
            ("mlp.ffn_sub_norm", i),
        ):
            sd[p + name + ".weight"] = torch.ones(d, dtype=torch.bfloat16)
    cfg = {
        "architectures": ["BitNetForCausalLM"],
        "model_type": "bitnet",
        **c,
        "head_dim": hd,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "bitnet",
            "linear_class": "autobitlinear",
            "quantization_mode": "offline",
        },
    }
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tmp.rename(out)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="2b4t")
    ap.add_argument("--out", default=None, help="output directory (default: .assets/bench-<shape>)")
    a = ap.parse_args()
    print(
        write_checkpoint(
            a.out or Path(__file__).resolve().parent.parent / ".assets" / f"bench-{a.shape}", a.shape
        )
    )
