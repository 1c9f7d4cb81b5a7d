"""Fused CPU decode step: every layer of a decode (or prefill) step with a KV cache in one C call (csrc/decode.c).

With the C backend the ternary projections of a 2B4T decode step are already C, but the ~40 torch ops per
layer around them (norms, RoPE, KV-cache writes, masks, attention, activation, residuals) cost ~1200 eager op
dispatches per token. `attach(model)` gives a CausalLM a `FusedDecode` as `model.cpu_decode`; CausalLM.forward
calls it for steps with a KV cache when `eligible(...)` says the step can run there, and runs its torch layers
otherwise (no cache, training, autograd, torch.compile / tracing, non-fp32 activations, other caches, a slot
written twice in one step). Steps of t > 1 tokens per row (prefill, chunked prefill) send the B*T tokens through
each projection as one GEMM, write every token's k, v to the cache, then attend causally over the cache (the
mask CausalLM.forward builds, input_mask padding included: it has already set cache.valid for this step).

Models it takes: inference BitLinears on the "cpu" backend without biases in every projection, relu2 or silu,
fp32 RMSNorms (BitNet sub-norms optional), head_dim even and <= 512. KV cache fp32 or bf16.
Results equal the torch layers up to float summation order (RMSNorm means, attention sums).

Turned off by BITNETLM_FUSED_DECODE=0 (read when attaching) or `detach(model)`.
Forward hooks on the layers are not run by the fused step. Steps of one model from several threads at once are
serialized by a lock (one scratch buffer; the C library runs one call at a time on its thread pool anyway).

Attention accuracy: with random 2B4T-shaped weights (attention scores in the thousands, 1024 cached positions)
one layer's output with the fused step agreed with the torch layer using a float64 attention to 2e-7 of its
scale, while the torch layer with its CPU scaled_dot_product_attention was 1e-2 away; so fused and unfused
logits of such models differ visibly. On the oracle checkpoints they agree to ~1e-6 of the logit scale
(tests/test_kernels_cpu_decode.py).
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from bitnetlm.kernels.cpu import _lib

ENV = "BITNETLM_FUSED_DECODE"
ACTS = {"relu2": 0, "silu": 1}
KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_HEAD_DIM = 512  # BN_DECODE_MAX_HEAD_DIM

_i64, _f32, _i32, _vp = ctypes.c_int64, ctypes.c_float, ctypes.c_int32, ctypes.c_void_p


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
    ]


def _step_fn():
    """bn_decode_forward_f32 and bn_decode_work_floats with their signatures, or None if the build lacks them."""
    lib = _lib.load()
    if lib is None or not hasattr(lib, "bn_decode_forward_f32"):
        return None
    fn = lib.bn_decode_forward_f32
    if fn.argtypes is None:
        fn.restype = ctypes.c_int
        fn.argtypes = [_vp, _vp, _i64, _vp, _vp, _vp, _vp, _vp, _vp, _i64, _i64, _vp, _vp]
        lib.bn_decode_work_floats.restype = _i64
        lib.bn_decode_work_floats.argtypes = [_vp, _i64]
    return lib


PHASES = ("norms", "qkv", "rope", "attention", "o", "gate_up", "act", "down")  # bn_decode_phase_timers' order


def phase_timers(on: bool) -> dict[str, float]:
    """Turn the fused step's phase timers on or off and return the seconds each phase took since the last call:
    the calling thread's wall time over every layer and step (the projections include their input's
    quantization; "norms" the residual adds; "act" the MLP middle and its norm). For profiling; one
    process-wide set of timers."""
    lib = _step_fn()
    if lib is None or not hasattr(lib, "bn_decode_phase_timers"):
        raise RuntimeError(f"phase_timers: the C extension is not available ({_lib.load_error()})")
    fn = lib.bn_decode_phase_timers
    fn.restype, fn.argtypes = None, [ctypes.c_int, _vp, ctypes.c_int]
    out = (ctypes.c_int64 * len(PHASES))()
    fn(int(on), out, len(PHASES))
    return {p: out[i] / 1e9 for i, p in enumerate(PHASES)}


def _parts(block):
    a, f = block.self_attn, block.mlp
    return a, f, [getattr(a, p) for p in PROJ[:4]] + [getattr(f, p) for p in PROJ[4:]]


def why_not(model) -> str | None:
    """None if `model`'s layers can run in the fused step, else the reason they cannot."""
    from bitnetlm.models.transformer import MLP, Attention, Block, RMSNorm
    from bitnetlm.quant.bitlinear import BitLinear

    if _step_fn() is None:
        return "the C library is missing or was built without csrc/decode.c"
    cfg = model.config
    if len(model.layers) == 0:
        return "no layers"
    if cfg.hidden_act not in ACTS:
        return f"activation {cfg.hidden_act!r} (fused: {sorted(ACTS)})"
    if cfg.head_dim % 2 or cfg.head_dim > MAX_HEAD_DIM:
        return f"head_dim {cfg.head_dim}"
    for blk in model.layers:
        if (type(blk), type(blk.self_attn), type(blk.mlp)) != (Block, Attention, MLP):
            return f"layer type {type(blk).__name__}"
        a, f, lins = _parts(blk)
        for lin in lins:
            if not isinstance(lin, BitLinear) or lin.training_mode or lin.bias is not None:
                return f"projection {type(lin).__name__} (needs inference BitLinear without bias)"
            if getattr(lin._backend, "name", None) != "cpu" or lin.packed.device.type != "cpu":
                return f"projection backend {getattr(lin._backend, 'name', None)!r}"
            if lin.weight_scale.dtype != torch.float32 or lin.weight_scale.numel() != 1:
                return "weight_scale is not one float32"
        wants = [(blk.input_layernorm, cfg.hidden_size), (blk.post_attention_layernorm, cfg.hidden_size)]
        wants += [(n, d) for n, d in ((a.attn_sub_norm, a.n_heads * a.head_dim), (f.ffn_sub_norm, None)) if n]
        for norm, dim in wants:
            w = norm.weight
            if type(norm) is not RMSNorm or norm.eps != cfg.rms_norm_eps:
                return f"norm {type(norm).__name__} (eps {getattr(norm, 'eps', None)})"
            if w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous():
                return f"norm weight {w.dtype} on {w.device}"
            if dim is not None and w.numel() != dim:
                return f"norm of {w.numel()} for {dim} features"
    return None


class FusedDecode:
    """All layers of `model` for a decode / prefill step in one C call; see the module docstring."""

    def __init__(self, model):
        cfg = model.config
        self.lib = _step_fn()
        self.n_layers = len(model.layers)
        self.calls = 0  # fused steps run (tests check the path is taken)
        c = self.cfg = _Config()
        c.hidden, c.inter = cfg.hidden_size, cfg.intermediate_size
        c.n_heads, c.n_kv, c.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        c.eps, c.act = cfg.rms_norm_eps, ACTS[cfg.hidden_act]
        self.layers = (_Layer * self.n_layers)()
        # (module's parameter/buffer dict, name, tensor): a replaced tensor makes the C pointers stale. The
        # dicts are read directly: nn.Module.__getattr__ made this check cost ~1 ms per step.
        self.watch = []
        for st, blk in zip(self.layers, model.layers):
            a, f, lins = _parts(blk)
            norms = (blk.input_layernorm, blk.post_attention_layernorm, a.attn_sub_norm, f.ffn_sub_norm)
            for field, norm in zip(("in_norm", "post_norm", "attn_sub_norm", "ffn_sub_norm"), norms):
                if norm is not None:
                    setattr(st, field, norm.weight.data_ptr())
                    self.watch.append((norm._parameters, "weight", norm.weight))
            for j, lin in enumerate(lins):
                st.w[j], st.scale[j] = lin.packed.data_ptr(), lin.weight_scale.data_ptr()
                self.watch += [
                    (lin._buffers, "packed", lin.packed),
                    (lin._buffers, "weight_scale", lin.weight_scale),
                ]
        self.model_ref = model.layers  # identity check: a model whose layers were swapped drops the fusion
        self.work = torch.empty(0, dtype=torch.float32)
        self.lock = getattr(self, "lock", None) or threading.Lock()  # kept when stale() re-initializes

    def __deepcopy__(self, memo):
        return None  # a copy of the model has its own tensors: it falls back to the torch layers

    def __reduce__(self):
        return (type(None), ())

    def stale(self) -> bool:
        return any(d.get(n) is not t for d, n, t in self.watch)

    def eligible(self, model, h, cos, cache, cache_pos) -> bool:
        """True when this step (t >= 1 tokens per row) can run fused (else the caller runs its torch layers)."""
        if cache is None or model.training or torch.is_grad_enabled():
            return False
        if torch.compiler.is_compiling() or torch.jit.is_tracing():
            return False
        if model.layers is not self.model_ref or h.dtype != torch.float32 or h.device.type != "cpu":
            return False
        if len(cache.k) != self.n_layers:
            return False
        k, valid, c, (b, t) = cache.k[0], cache.valid, self.cfg, h.shape[:2]
        if (
            k.dtype not in KV_DTYPES
            or k.device.type != "cpu"
            or tuple(k.shape) != (b, c.n_kv, k.shape[2], c.head_dim)
        ):
            return False
        if valid.dtype != torch.bool or valid.shape != (b, k.shape[2]) or not valid.is_contiguous():
            return False
        if cos.dtype != torch.float32 or cache_pos.shape != (b, t) or h.dim() != 3:
            return False
        if t > 1 and not bool((cache_pos[:, 1:] > cache_pos[:, :-1]).all()):
            return False  # a slot written twice in one step: the torch path's scatter_ keeps either token
        if not all(
            kv.is_contiguous() and kv.dtype == k.dtype and kv.shape == k.shape for kv in cache.k + cache.v
        ):
            return False
        if self.stale():
            # repacked or reloaded weights: point at the new tensors if the model still qualifies
            if why_not(model) is not None:
                return False
            calls = self.calls
            self.__init__(model)
            self.calls = calls
        return True

    def __call__(self, h, cos, sin, cache, cache_pos) -> torch.Tensor:
        """h [B, T, hidden] after the layers; cos, sin [B, T, head_dim]; cache_pos [B, T] slots to write."""
        with self.lock:  # self.cfg and self.work are per-call state
            return self._step(h, cos, sin, cache, cache_pos)

    def _step(self, h, cos, sin, cache, cache_pos) -> torch.Tensor:
        b, t, hidden = h.shape
        c = self.cfg
        c.max_seq = cache.k[0].shape[2]
        c.kv_dtype = KV_DTYPES[cache.k[0].dtype]
        need = int(self.lib.bn_decode_work_floats(ctypes.addressof(c), b * t))
        if self.work.numel() < need:
            self.work = torch.empty(need, dtype=torch.float32)
        out = h.reshape(b * t, hidden).clone()
        slot = cache_pos.reshape(b * t).to(torch.int64).contiguous()
        cos, sin = cos.reshape(b * t, -1).contiguous(), sin.reshape(b * t, -1).contiguous()
        kp = (_vp * self.n_layers)(*[kv.data_ptr() for kv in cache.k])
        vp = (_vp * self.n_layers)(*[kv.data_ptr() for kv in cache.v])
        rc = self.lib.bn_decode_forward_f32(
            ctypes.addressof(c),
            ctypes.addressof(self.layers),
            self.n_layers,
            ctypes.addressof(kp),
            ctypes.addressof(vp),
            cache.valid.data_ptr(),
            slot.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            b,
            t,
            out.data_ptr(),
            self.work.data_ptr(),
        )
        if rc != 0:
            raise RuntimeError(f"bn_decode_forward_f32 failed with code {rc}")
        self.calls += 1
        return out.view(b, t, hidden)


def attach(model) -> FusedDecode | None:
    """Give `model` a fused decode step when it can run one (and BITNETLM_FUSED_DECODE is not 0).

    Returns it, or None (model.cpu_decode is then None: the torch layers run every step)."""
    fused = None
    if os.environ.get(ENV, "") != "0" and hasattr(model, "cpu_decode") and why_not(model) is None:
        fused = FusedDecode(model)
    if hasattr(model, "cpu_decode"):
        model.cpu_decode = fused
    return fused


def detach(model) -> None:
    """Back to the torch layers for every step."""
    model.cpu_decode = None
