#!/usr/bin/env python3
"""Ship the SmolLM2 teacher to the GPU machine compactly: its GGUF blocks, split by layers, dequantized there.

The GPU training machine has no `gguf` package and takes at most 64 MiB of files a run, while the Q4_1 GGUF is 98 MB.
We keep the quantized bytes exactly (Q8_0 embedding, Q4_1 projections, F32 norms) as uint8 tensors in safetensors
"parts" (split at a layer boundary so each run takes one part), and dequantize them with numpy on arrival. The result
is checked against transformers' own GGUF loader (the oracle) in tests/test_zoo_teacher.py.

    python scripts/zoo_teacher_parts.py split GGUF CONFIG_JSON OUT_DIR --split-layer 6
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

GGML_F32, GGML_F16, GGML_Q4_1, GGML_Q8_0 = 0, 1, 3, 8

_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
}


def hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> our CausalLM state-dict name (HF LLaMA names without the `model.` prefix)."""
    base = gguf_name.removesuffix(".weight")
    if base == "token_embd":
        return "embed_tokens.weight"
    if base == "output_norm":
        return "norm.weight"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _NAMES:
        return f"layers.{parts[1]}.{_NAMES[parts[2]]}"
    raise KeyError(f"unexpected GGUF tensor {gguf_name!r}")


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """float32 array of `shape` from a tensor's GGUF bytes (F32, F16, Q8_0 and Q4_1 blocks of 32 values)."""
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    n = int(np.prod(shape))
    if ggml_type == GGML_F32:
        out = raw.view(np.float32)
    elif ggml_type == GGML_F16:
        out = raw.view(np.float16).astype(np.float32)
    elif ggml_type == GGML_Q8_0:
        blocks = raw.reshape(-1, 34)  # fp16 d, 32 x int8
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [nb, 1]
        q = blocks[:, 2:].view(np.int8).astype(np.float32)  # [nb, 32]
        out = (d * q).reshape(-1)
    elif ggml_type == GGML_Q4_1:
        blocks = raw.reshape(-1, 20)  # fp16 d, fp16 m, 16 bytes of nibbles
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [nb, 1]
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        qs = blocks[:, 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)  # low nibbles are values 0..15
        out = (d * q + m).reshape(-1)
    else:
        raise ValueError(f"GGUF type {ggml_type} not supported (F32, F16, Q8_0, Q4_1)")
    if out.size != n:
        raise ValueError(f"GGUF tensor: expected {n} values for shape {shape}, found {out.size}")
    return out.reshape(shape)


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of q/k rows (as transformers' GGUF loader does)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)  # [H, D/2, 2, ...]


def split(gguf_path: str, config_json: str, out_dir: str, split_layer: int) -> list[str]:
    """Write part0 (embedding + layers < split_layer + final norm) and part1 (the rest) as safetensors."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    with open(config_json) as f:
        cfg = json.load(f)
    r = GGUFReader(gguf_path)
    parts: list[dict] = [{}, {}]
    meta: list[dict] = [{}, {}]
    for t in r.tensors:
        name = hf_name(t.name)
        layer = int(name.split(".")[1]) if name.startswith("layers.") else -1
        i = 1 if layer >= split_layer else 0
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists ne0 (the fastest dim) first
        parts[i][name] = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1)
        meta[i][name] = [int(t.tensor_type), list(shape)]
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for i in range(2):
        p = os.path.join(out_dir, f"teacher_part{i}.safetensors")
        md = {
            "tensors": json.dumps(meta[i]),
            "config": json.dumps(cfg),
            "source": os.path.basename(gguf_path),
        }
        save_file(parts[i], p + ".tmp", metadata=md)
        os.replace(p + ".tmp", p)
        paths.append(p)
    return paths


def load_parts(paths: list[str]) -> tuple[dict, dict]:
    """(config.json dict, float32 torch state dict in our CausalLM names) from the parts."""
    import torch
    from safetensors import safe_open

    sd, cfg = {}, None
    for p in paths:
        with safe_open(p, "np") as f:
            md = f.metadata()
            cfg = json.loads(md["config"])
            for name, (typ, shape) in json.loads(md["tensors"]).items():
                w = dequantize(f.get_tensor(name), typ, tuple(shape))
                if name.endswith("q_proj.weight"):
                    w = reverse_permute(w, cfg["num_attention_heads"])
                elif name.endswith("k_proj.weight"):
                    w = reverse_permute(w, cfg["num_key_value_heads"])
                sd[name] = torch.from_numpy(np.ascontiguousarray(w))
    return cfg, sd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="write the two parts")
    s.add_argument("gguf")
    s.add_argument("config_json")
    s.add_argument("out_dir")
    s.add_argument("--split-layer", type=int, default=6)
    a = ap.parse_args(argv)
    for p in split(a.gguf, a.config_json, a.out_dir, a.split_layer):
        print(f"{os.path.getsize(p):>10}  {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
