"""Fused CPU layer step: every layer of a decode (or prefill) step over a KV cache in one C call (csrc/decode.c).

With the C backend the ternary projections of a 2B4T decode step are already C, but the ~40 torch ops per layer
around them (norms, RoPE, KV-cache writes, masks, attention, activation, residuals) cost ~1200 eager op
dispatches per token. A `FusedStep` runs them all in C over a plain description of each layer's tensors
(`LayerTensors`); `bitnetlm.runtime.cpu` builds one from a model and calls it in place of the model's layers.

Steps of t > 1 tokens per row (prefill, chunked prefill) send the B*T tokens through each projection as one
GEMM, write every token's k, v to the cache, then attend causally over the cache rows (keys at slots <= the
query's that `valid` marks, and the query's own slot). A paged cache (`PagedKV`: a pool of blocks and each row's
block table) is read block by block in slot order, so its results equal a static cache's bit for bit. KV cache
fp32 or bf16; projections packed for the "cpu" backend; relu2 or silu; head_dim even and <= 512. Results equal the
torch layers up to float summation order (RMSNorm means, attention sums).

Attention accuracy: with random 2B4T-shaped weights (attention scores in the thousands, 1024 cached positions)
one layer's output with the fused step agreed with the torch layer using a float64 attention to 2e-7 of its
scale, while the torch layer with its CPU scaled_dot_product_attention was 1e-2 away; so fused and unfused
logits of such models differ visibly. On the oracle checkpoints they agree to ~1e-6 of the logit scale
(tests/test_kernels_cpu_decode.py).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch

from bitnetlm.kernels.cpu import _lib

ACTS = {"relu2": 0, "silu": 1}
KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # BN_DEC_* order
MAX_HEAD_DIM = 512  # BN_DECODE_MAX_HEAD_DIM
PHASES = ("norms", "qkv", "rope", "attention", "o", "gate_up", "act", "down")  # bn_decode_phase_timers' order

_i64, _f32, _i32, _vp = ctypes.c_int64, ctypes.c_float, ctypes.c_int32, ctypes.c_void_p
# The C library runs one call at a time on its process-wide thread pool: fused steps from several threads
# (each runner has its own) take turns.
_LOCK = threading.Lock()


class _Config(ctypes.Structure):  # bn_decode_config
    _fields_ = [
        ("hidden", _i64),
        ("inter", _i64),
        ("n_heads", _i64),
        ("n_kv", _i64),
        ("head_dim", _i64),
        ("max_seq", _i64),
        ("eps", _f32),
        ("act", _i32),
        ("kv_dtype", _i32),
    ]


class _Layer(ctypes.Structure):  # bn_decode_layer
    _fields_ = [
        ("in_norm", _vp),
        ("post_norm", _vp),
        ("attn_sub_norm", _vp),
        ("ffn_sub_norm", _vp),
        ("w", _vp * len(PROJ)),
        ("scale", _vp * len(PROJ)),
        ("layout", _i32),
    ]


@dataclass(frozen=True)
class StepShape:
    """The dimensions every layer shares."""

    hidden: int
    inter: int
    n_heads: int
    n_kv: int
    head_dim: int
    eps: float
    act: str


@dataclass
class LayerTensors:
    """One layer's tensors: fp32 norm weights (sub-norms None when absent), the seven projections' packed
    weights (all in the "cpu" backend layout `layout`, a _lib.LAYOUT_* code) and float32 scales, in PROJ order."""

    in_norm: torch.Tensor
    post_norm: torch.Tensor
    attn_sub_norm: torch.Tensor | None
    ffn_sub_norm: torch.Tensor | None
    weights: tuple[torch.Tensor, ...]
    scales: tuple[torch.Tensor, ...]
    layout: int = _lib.LAYOUT_2BIT


def _library():
    """The C library with bn_decode_forward_f32's signature declared, or None if the build lacks it."""
    lib = _lib.load()
    if lib is None or not hasattr(lib, "bn_decode_forward_paged_f32"):
        return None
    fn = lib.bn_decode_forward_f32
    if fn.argtypes is None:
        fn.restype = ctypes.c_int
        fn.argtypes = [_vp, _vp, _i64, _vp, _vp, _vp, _vp, _vp, _vp, _i64, _i64, _vp, _vp]
        lib.bn_decode_work_floats.restype = _i64
        lib.bn_decode_work_floats.argtypes = [_vp, _i64]
        paged = lib.bn_decode_forward_paged_f32
        paged.restype = ctypes.c_int
        paged.argtypes = [_vp, _vp, _i64, _vp, _vp, _vp, _i64, _i64, _vp, _vp, _vp, _vp, _i64, _i64, _vp, _vp]
    return lib


def why_not(shape: StepShape, layers: list[LayerTensors]) -> str | None:
    """None if these layers can run in the fused step, else the reason they cannot."""
    if _library() is None:
        return "the C library is missing or was built without csrc/decode.c"
    if not layers:
        return "no layers"
    if shape.act not in ACTS:
        return f"activation {shape.act!r} (fused: {sorted(ACTS)})"
    if shape.head_dim % 2 or shape.head_dim > MAX_HEAD_DIM:
        return f"head_dim {shape.head_dim}"
    dims = (shape.hidden, shape.hidden, shape.n_heads * shape.head_dim, shape.inter)
    for L in layers:
        norms = (L.in_norm, L.post_norm, L.attn_sub_norm, L.ffn_sub_norm)
        for w, dim in zip(norms, dims):
            if w is None:
                continue
            if w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous():
                return f"norm weight {w.dtype} on {w.device}"
            if w.numel() != dim:
                return f"norm of {w.numel()} for {dim} features"
        for s in L.scales:
            if s.dtype != torch.float32 or s.numel() != 1:
                return "weight_scale is not one float32"
        if any(w.device.type != "cpu" for w in L.weights):
            return "weights not on the CPU"
    return None


def accepts(shape: StepShape, n_layers: int, k, v, valid, b: int, t: int, slots: torch.Tensor) -> bool:
    """Whether a step of b rows of t tokens over caches k, v [layer][B, n_kv, S, D] and `valid` can run fused."""
    k0 = k[0]
    if len(k) != n_layers or k0.dtype not in KV_DTYPES or k0.device.type != "cpu":
        return False
    if tuple(k0.shape) != (b, shape.n_kv, k0.shape[2], shape.head_dim):
        return False
    if valid.dtype != torch.bool or valid.shape != (b, k0.shape[2]) or not valid.is_contiguous():
        return False
    if t > 1 and not bool((slots[:, 1:] > slots[:, :-1]).all()):
        return False  # a slot written twice in one step: torch's scatter_ keeps either token
    return all(x.is_contiguous() and x.dtype == k0.dtype and x.shape == k0.shape for x in k + v)


class FusedStep:
    """Every layer of a decode / prefill step in one C call; see the module docstring."""

    def __init__(self, shape: StepShape, layers: list[LayerTensors]):
        self.lib = _library()
        self.shape, self.n_layers = shape, len(layers)
        self.calls = 0  # steps run (tests check that the path is taken)
        c = self.cfg = _Config()
        c.hidden, c.inter = shape.hidden, shape.inter
        c.n_heads, c.n_kv, c.head_dim = shape.n_heads, shape.n_kv, shape.head_dim
        c.eps, c.act = shape.eps, ACTS[shape.act]
        self.layers = (_Layer * self.n_layers)()
        self._tensors = layers  # keeps every tensor the C structs point at alive
        for st, L in zip(self.layers, layers):
            norms = (L.in_norm, L.post_norm, L.attn_sub_norm, L.ffn_sub_norm)
            for field, w in zip(("in_norm", "post_norm", "attn_sub_norm", "ffn_sub_norm"), norms):
                if w is not None:
                    setattr(st, field, w.data_ptr())
            for j, (w, s) in enumerate(zip(L.weights, L.scales)):
                st.w[j], st.scale[j] = w.data_ptr(), s.data_ptr()
            st.layout = L.layout
        self.work = torch.empty(0, dtype=torch.float32)

    def __call__(self, h, cos, sin, k, v, valid, slots, pages: PagedKV | None = None) -> torch.Tensor:
        """h [B, T, hidden] -> h after every layer; cos, sin [B, T, head_dim]; k, v: per-layer caches [B, n_kv,
        S, D], or with `pages` per-layer block pools [blocks, n_kv, block_size, D]; valid [B, S] (this step's
        slots already marked); slots [B, T] where each token's k, v go."""
        with _LOCK:  # self.cfg and self.work are per-call state
            return self._step(h, cos, sin, k, v, valid, slots, pages)

    def _step(self, h, cos, sin, k, v, valid, slots, pages) -> torch.Tensor:
        b, t, hidden = h.shape
        c = self.cfg
        c.max_seq = valid.shape[1]
        c.kv_dtype = KV_DTYPES[k[0].dtype]
        need = int(self.lib.bn_decode_work_floats(ctypes.addressof(c), b * t))
        if self.work.numel() < need:
            self.work = torch.empty(need, dtype=torch.float32)
        out = h.reshape(b * t, hidden).clone()
        slot = slots.reshape(b * t).to(torch.int64).contiguous()
        cos, sin = cos.reshape(b * t, -1).contiguous(), sin.reshape(b * t, -1).contiguous()
        kp = (_vp * self.n_layers)(*[x.data_ptr() for x in k])
        vp = (_vp * self.n_layers)(*[x.data_ptr() for x in v])
        head = (ctypes.addressof(c), ctypes.addressof(self.layers), self.n_layers, ctypes.addressof(kp))
        tail = (valid.data_ptr(), slot.data_ptr(), cos.data_ptr(), sin.data_ptr(), b, t)
        tail += (out.data_ptr(), self.work.data_ptr())
        if pages is None:
            rc = self.lib.bn_decode_forward_f32(*head, ctypes.addressof(vp), *tail)
        else:
            table = pages.table.contiguous()
            if table.dtype != torch.int32 or table.shape != (b, c.max_seq // pages.block_size):
                raise ValueError(f"block table {tuple(table.shape)} {table.dtype} for {b} rows")
            n_blocks = k[0].shape[0]
            args = (ctypes.addressof(vp), table.data_ptr(), pages.block_size, n_blocks)
            rc = self.lib.bn_decode_forward_paged_f32(*head, *args, *tail)
        if rc != 0:
            raise RuntimeError(f"the fused C step failed with code {rc}")
        self.calls += 1
        return out.view(b, t, hidden)


@dataclass
class PagedKV:
    """A step's view of a paged KV cache: `table` [B, S // block_size] int32, the pool blocks holding each row's
    slots in order."""

    table: torch.Tensor
    block_size: int


def phase_timers(on: bool) -> dict[str, float]:
    """Turn the fused step's phase timers on or off and return the seconds each phase took since the last call:
    the calling thread's wall time over every layer and step (the projections include their input's
    quantization; "norms" the residual adds; "act" the MLP middle and its norm). For profiling; one
    process-wide set of timers."""
    lib = _library()
    if lib is None or not hasattr(lib, "bn_decode_phase_timers"):
        raise RuntimeError(f"phase_timers: the C extension is not available ({_lib.load_error()})")
    fn = lib.bn_decode_phase_timers
    fn.restype, fn.argtypes = None, [ctypes.c_int, _vp, ctypes.c_int]
    out = (ctypes.c_int64 * len(PHASES))()
    fn(int(on), out, len(PHASES))
    return {p: out[i] / 1e9 for i, p in enumerate(PHASES)}
