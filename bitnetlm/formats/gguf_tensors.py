"""GGUF tensors <-> our modules' tensors: float and ternary projections read (q/k rows un-permuted from GGML's
RoPE order, ternary or exactly-ternary floats packed for BitLinear) and written (the smallest lossless float type,
ternary codes and scale). Shared by the decoder (`gguf.py`) and encoder (`gguf_bert.py`) readers and writers."""

from __future__ import annotations

import numpy as np
import torch

from bitnetlm.formats import gguf_codecs as codecs
from bitnetlm.formats.gguf_file import GGUFError, GGUFFile
from bitnetlm.quant.bitlinear import BitLinear
from bitnetlm.quant.packing import pack_hf
from bitnetlm.quant.ternary import ternarize

GGUF_FORMAT_VERSION = 1  # bitnetlm.format_version written to files we produce
GGML_QUANT_VERSION = 2  # general.quantization_version, as llama.cpp's converter writes it

FLOAT_TYPES = {"f32": codecs.TYPE_F32, "f16": codecs.TYPE_F16, "bf16": codecs.TYPE_BF16}


# ---- q/k row permutation of llama.cpp's llama converter ---------------------------------------------


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF (rotate-half) row order -> GGML interleaved order, as llama.cpp's convert_hf_to_gguf does."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- reading --------------------------------------------------------------------------------------


def float_tensor(f: GGUFFile, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if name not in f.tensors:
        raise GGUFError(f"{f.path}: tensor {name!r} is missing")
    ti = f.tensors[name]
    if tuple(ti.shape) != tuple(shape):
        raise GGUFError(f"{f.path}: tensor {name!r} has shape {ti.shape}, expected {tuple(shape)}")
    arr = np.asarray(f.array(name), dtype=np.float32)
    return torch.from_numpy(arr.copy()).to(dtype)


def scale_tensor(f: GGUFFile, g: str) -> float:
    sname = g.removesuffix(".weight") + ".scale"
    if sname not in f.tensors:
        return 1.0
    v = np.asarray(f.array(sname), dtype=np.float32).reshape(-1)
    if v.size != 1 or not np.isfinite(v[0]):
        raise GGUFError(f"{f.path}: tensor {sname!r} must hold one finite value, found {v.size} values")
    return float(v[0])


def exact_ternary(w: torch.Tensor):
    """(T, s) if the float matrix already holds ternary values {-s, 0, s} (converters store T*s as F16/F32)."""
    a = w.abs()
    s = a.amax()
    if s == 0 or not bool(((a == 0) | (a == s)).all()):
        return None, None
    return torch.sign(w).to(torch.int8), s.reshape(1).float()


def projection(f, g, name, module, shape, cfg, permute, dtype, strict) -> dict[str, torch.Tensor]:
    if g not in f.tensors:
        raise GGUFError(f"{f.path}: tensor {g!r} is missing")
    ti = f.tensors[g]
    if tuple(ti.shape) != shape:
        raise GGUFError(f"{f.path}: tensor {g!r} has shape {ti.shape}, expected {shape}")
    n_head = None
    if permute and ".attn_q." in g:
        n_head = cfg.num_attention_heads
    elif permute and ".attn_k." in g:
        n_head = cfg.num_key_value_heads
    # llama.cpp's BitNet files may carry the matrix scale as a separate [1] tensor `<name>.scale` (y *= scale)
    extra = scale_tensor(f, g)
    if ti.type_id in codecs.TYPE_NAMES:
        t_np, s = f.ternary(g, strict=strict)
        s *= extra
        t = torch.from_numpy(t_np.copy())
        if n_head:
            t = unpermute_qk(t, n_head)
        if isinstance(module, BitLinear) and not module.training_mode:
            return {
                name + ".packed": pack_hf(t),
                name + ".weight_scale": torch.tensor([s], dtype=torch.float32),
            }
        w = t.float() * s
    else:
        w = torch.from_numpy(np.asarray(f.array(g), dtype=np.float32).copy()) * extra
        if n_head:
            w = unpermute_qk(w, n_head)
        if isinstance(module, BitLinear) and not module.training_mode:
            tt, ss = exact_ternary(w)
            if tt is None:  # genuinely full-precision weights: absmean ternarization
                tt, ss = ternarize(w)
            return {name + ".packed": pack_hf(tt), name + ".weight_scale": ss.reshape(1)}
    return {name + ".weight": w.to(torch.float32 if isinstance(module, BitLinear) else dtype)}


# ---- writing --------------------------------------------------------------------------------------


def smallest_lossless(w: torch.Tensor) -> int:
    """BF16 or F16 if every value survives the round trip, else F32 (token_embd and lm_head)."""
    wf = w.detach().float()
    if w.dtype == torch.bfloat16 or torch.equal(wf.to(torch.bfloat16).float(), wf):
        return codecs.TYPE_BF16
    if w.dtype == torch.float16 or torch.equal(wf.to(torch.float16).float(), wf):
        return codecs.TYPE_F16
    return codecs.TYPE_F32


def float_bytes(w: torch.Tensor, type_id: int) -> np.ndarray:
    wf = w.detach().cpu().float().contiguous()
    if type_id == codecs.TYPE_F32:
        return wf.numpy()
    if type_id == codecs.TYPE_F16:
        return wf.to(torch.float16).numpy()
    return wf.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8).reshape(*wf.shape[:-1], -1)


def ternary_of(module) -> tuple[torch.Tensor, float]:
    if isinstance(module, BitLinear):
        if module.training_mode:
            t, s = ternarize(module.weight)
        else:
            t, s = module.ternary_weight(), module.weight_scale
        return t.cpu(), float(s.reshape(-1)[0])
    raise TypeError("not a ternary projection")


def float_entry(gname: str, w: torch.Tensor, type_id: int = codecs.TYPE_F32):
    """The GGUF tensor `gname` of float weights `w` stored as `type_id`."""
    from bitnetlm.formats.gguf_file import TensorToWrite

    return TensorToWrite(gname, float_bytes(w, type_id), type_id, tuple(w.shape))


def ternary_entry(gname: str, m, qkey: str, n_head: int | None = None):
    """The GGUF tensor `gname` of ternary projection `m` encoded as `qkey` (q/k rows permuted for n_head heads)."""
    from bitnetlm.formats.gguf_file import TensorToWrite

    t, s = ternary_of(m)
    if n_head:
        t = permute_qk(t, n_head)
    tid = codecs.TERNARY_TYPES[qkey]
    try:
        data = codecs.encode(t.numpy(), s, tid)
    except codecs.CodecError as e:
        hint = " (I2_S needs only a multiple of 128 values per matrix: --type i2_s)" if tid != 36 else ""
        raise ValueError(f"tensor {gname} {tuple(t.shape)}: {e}{hint}") from e
    return TensorToWrite(gname, data, tid, tuple(t.shape))
