"""ONNX export of a BitNet / LLaMA model with KV-cache inputs and outputs (runs in onnxruntime on CPU).

The graph is written op by op with `onnx.helper` (torch's exporter cannot express INT2 weights). Ternary
projections: INT2 initializer T^T [K, N] -> DequantizeLinear (opset 25) -> MatMul with the per-token int8
activations spelled out (Abs, ReduceMax, Max, Div, Mul, Round, Clip), then * (s / a): the same float32 math as
`quant.ternary.bitlinear_reference`, whose integer part is exact in float32 (K*127 < 2**24).

Inputs:  input_ids int64 [B, T], position_ids int64 [B, T],
         past_key_values.{i}.key / .value float32 [B, H_kv, P, D] (P = 0 on the first call).
Outputs: logits float32 [B, T, V], present.{i}.key / .value float32 [B, H_kv, P+T, D].
Token t of the call sits at cache slot P+t and attends to slots <= P+t (no padding inside a batch).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bitnetlm import progress
from bitnetlm.formats import atomic

OPSET = 25


class _G:
    """Tiny graph builder: unique names, initializers, nodes."""

    def __init__(self):
        from onnx import helper

        self.h = helper
        self.nodes, self.inits, self.n = [], [], 0

    def name(self, base: str) -> str:
        self.n += 1
        return f"{base}_{self.n}"

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs):
        outs = [self.name(op_type) for _ in range(n_out)]
        self.nodes.append(self.h.make_node(op_type, inputs, outs, **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, arr: np.ndarray, base: str = "c") -> str:
        from onnx import numpy_helper

        nm = self.name(base)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), nm))
        return nm

    def int2(self, t: torch.Tensor, base: str) -> str:
        """INT2 initializer of an int8 ternary matrix (4 values per byte, lowest bits first, row-major)."""
        from onnx import TensorProto

        flat = (t.reshape(-1).to(torch.int16) & 3).to(torch.uint8).numpy()
        pad = (-flat.size) % 4
        flat = np.concatenate([flat, np.zeros(pad, np.uint8)]).reshape(-1, 4)
        packed = flat[:, 0] | (flat[:, 1] << 2) | (flat[:, 2] << 4) | (flat[:, 3] << 6)
        nm = self.name(base)
        tp = TensorProto()
        tp.name, tp.data_type = nm, TensorProto.INT2
        tp.dims.extend(list(t.shape))
        tp.raw_data = packed.astype(np.uint8).tobytes()
        self.inits.append(tp)
        return nm


def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def _i64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int64)


def _rmsnorm(g: _G, x: str, w: torch.Tensor, eps: float) -> str:
    ms = g.op("ReduceMean", [g.op("Mul", [x, x]), g.const(_i64([-1]))], keepdims=1)
    inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [ms, g.const(_f32(eps))])])])
    return g.op("Mul", [g.const(w.detach().float().numpy(), "norm_w"), g.op("Mul", [x, inv])])


def _linear(g: _G, x: str, module, base: str) -> str:
    from bitnetlm.quant.bitlinear import BitLinear

    if not isinstance(module, BitLinear):  # full-precision projection
        return g.op("MatMul", [x, g.const(module.weight.detach().float().numpy().T, base)])
    if module.training_mode:
        from bitnetlm.quant.ternary import ternarize

        t, s = ternarize(module.weight)
    else:
        t, s = module.ternary_weight(), module.weight_scale
    s = float(s.reshape(-1)[0])
    wt = g.op(
        "DequantizeLinear",
        [g.int2(t.T.contiguous(), base + "_t"), g.const(_f32(1.0)), g.const(np.zeros((), np.int8))],
    )
    # DequantizeLinear's zero point must have the input's type: rewrite it as an INT2 scalar below
    zp_name = g.nodes[-1].input[2]
    _retype_int2_scalar(g, zp_name)
    if not module.quantize_input:
        return g.op("Mul", [g.op("MatMul", [x, wt]), g.const(_f32(s))])
    amax = g.op(
        "Max", [g.op("ReduceMax", [g.op("Abs", [x]), g.const(_i64([-1]))], keepdims=1), g.const(_f32(1e-5))]
    )
    a = g.op("Div", [g.const(_f32(127.0)), amax])
    xq = g.op("Clip", [g.op("Round", [g.op("Mul", [x, a])]), g.const(_f32(-128.0)), g.const(_f32(127.0))])
    y = g.op("MatMul", [xq, wt])
    return g.op("Mul", [y, g.op("Div", [g.const(_f32(s)), a])])


def _retype_int2_scalar(g: _G, name: str) -> None:
    from onnx import TensorProto

    for i, t in enumerate(g.inits):
        if t.name == name:
            tp = TensorProto()
            tp.name, tp.data_type, tp.raw_data = name, TensorProto.INT2, b"\x00"
            g.inits[i] = tp
            return


def _rotate_half(g: _G, x: str, half: int) -> str:
    x1, x2 = g.op("Split", [x, g.const(_i64([half, half]))], n_out=2, axis=-1)
    return g.op("Concat", [g.op("Neg", [x2]), x1], axis=-1)


def _io_values(h, cfg, n_layers: int) -> tuple[list, list]:
    """The graph's inputs and outputs: ids, positions and past k/v in; logits and present k/v out."""
    from onnx import TensorProto

    n_kv, d = cfg.num_key_value_heads, cfg.head_dim
    inputs = [
        h.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
        h.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]),
    ]
    outputs = [h.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", cfg.vocab_size])]
    for i in range(n_layers):
        for kind in ("key", "value"):
            inputs.append(
                h.make_tensor_value_info(
                    f"past_key_values.{i}.{kind}", TensorProto.FLOAT, ["batch", n_kv, "past", d]
                )
            )
            outputs.append(
                h.make_tensor_value_info(
                    f"present.{i}.{kind}", TensorProto.FLOAT, ["batch", n_kv, "total", d]
                )
            )
    return inputs, outputs


def _rope_tables(g: _G, inv_freq: torch.Tensor) -> tuple[str, str]:
    """cos and sin [B, 1, T, D] of the RoPE angles at position_ids."""
    from onnx import TensorProto

    inv = inv_freq.detach().float().numpy()
    freqs = g.op(
        "Mul",
        [
            g.op("Unsqueeze", [g.op("Cast", ["position_ids"], to=TensorProto.FLOAT), g.const(_i64([-1]))]),
            g.const(inv, "inv_freq"),
        ],
    )  # [B, T, D/2]
    embp = g.op("Concat", [freqs, freqs], axis=-1)  # [B, T, D]
    cos = g.op("Unsqueeze", [g.op("Cos", [embp]), g.const(_i64([1]))])  # [B, 1, T, D]
    sin = g.op("Unsqueeze", [g.op("Sin", [embp]), g.const(_i64([1]))])
    return cos, sin


def _causal_mask(g: _G) -> tuple[str, str, str]:
    """(batch dim, step dim, additive mask [T, S]): query t (cache slot P+t) sees slots j <= P+t."""
    shape_ids = g.op("Shape", ["input_ids"])
    b_dim = g.op("Slice", [shape_ids, g.const(_i64([0])), g.const(_i64([1]))])
    t_dim = g.op("Slice", [shape_ids, g.const(_i64([1])), g.const(_i64([2]))])
    p_dim = g.op("Slice", [g.op("Shape", ["past_key_values.0.key"]), g.const(_i64([2])), g.const(_i64([3]))])
    t_sc = g.op("Squeeze", [t_dim, g.const(_i64([0]))])
    p_sc = g.op("Squeeze", [p_dim, g.const(_i64([0]))])
    s_sc = g.op("Add", [t_sc, p_sc])
    kpos = g.op("Range", [g.const(np.array(0, np.int64)), s_sc, g.const(np.array(1, np.int64))])  # [S]
    qpos = g.op(
        "Add", [g.op("Range", [g.const(np.array(0, np.int64)), t_sc, g.const(np.array(1, np.int64))]), p_sc]
    )
    allowed = g.op(
        "LessOrEqual",
        [g.op("Unsqueeze", [kpos, g.const(_i64([0]))]), g.op("Unsqueeze", [qpos, g.const(_i64([1]))])],
    )  # [T, S]
    neg = g.op("Where", [allowed, g.const(_f32(0.0)), g.const(_f32(-np.inf))])
    return b_dim, t_dim, neg


@dataclass(frozen=True)
class _Shared:
    """Graph values every layer reads: the RoPE tables, the causal mask, the batch and step dims, 1/sqrt(d)."""

    cos: str
    sin: str
    mask: str
    b_dim: str
    t_dim: str
    scale: str


def _to_heads(g: _G, y: str, sh: _Shared, n: int, d: int) -> str:
    """[B, T, n*d] -> [B, n, T, d]."""
    shape = g.op("Concat", [sh.b_dim, sh.t_dim, g.const(_i64([n, d]))], axis=0)
    return g.op("Transpose", [g.op("Reshape", [y, shape])], perm=[0, 2, 1, 3])


def _apply_rope(g: _G, x: str, sh: _Shared, half: int) -> str:
    """x * cos + rotate_half(x) * sin."""
    return g.op("Add", [g.op("Mul", [x, sh.cos]), g.op("Mul", [_rotate_half(g, x, half), sh.sin])])


def _repeat_kv(g: _G, kc: str, vc: str, sh: _Shared, n_h: int, n_kv: int, d: int) -> tuple[str, str]:
    """GQA: each KV head repeated n_h / n_kv times -> [B, H, S, D] (the cache itself unchanged)."""
    rep = n_h // n_kv
    if rep <= 1:
        return kc, vc
    full = g.op("Concat", [sh.b_dim, g.const(_i64([n_h, -1, d]))], axis=0)
    exp_shape = g.op("Concat", [sh.b_dim, g.const(_i64([n_kv, rep])), g.op("Shape", [kc], start=2)], axis=0)
    kk = g.op("Reshape", [g.op("Expand", [g.op("Unsqueeze", [kc, g.const(_i64([2]))]), exp_shape]), full])
    vv = g.op("Reshape", [g.op("Expand", [g.op("Unsqueeze", [vc, g.const(_i64([2]))]), exp_shape]), full])
    return kk, vv


def _attention_block(g: _G, x: str, layer, i: int, cfg, sh: _Shared) -> str:
    """x + o_proj(attention(norm(x))) of layer i, its k/v appended to the cache as present.{i}.*."""
    n_h, n_kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    at = layer.self_attn
    hn = _rmsnorm(g, x, layer.input_layernorm.weight, cfg.rms_norm_eps)
    q = _to_heads(g, _linear(g, hn, at.q_proj, f"l{i}_q"), sh, n_h, d)  # [B, H, T, D]
    k = _to_heads(g, _linear(g, hn, at.k_proj, f"l{i}_k"), sh, n_kv, d)
    v = _to_heads(g, _linear(g, hn, at.v_proj, f"l{i}_v"), sh, n_kv, d)
    q, k = _apply_rope(g, q, sh, d // 2), _apply_rope(g, k, sh, d // 2)
    kc, vc = f"present.{i}.key", f"present.{i}.value"
    g.nodes.append(g.h.make_node("Concat", [f"past_key_values.{i}.key", k], [kc], axis=2))
    g.nodes.append(g.h.make_node("Concat", [f"past_key_values.{i}.value", v], [vc], axis=2))
    kk, vv = _repeat_kv(g, kc, vc, sh, n_h, n_kv, d)
    scores = g.op("Mul", [g.op("MatMul", [q, g.op("Transpose", [kk], perm=[0, 1, 3, 2])]), sh.scale])
    p = g.op("Softmax", [g.op("Add", [scores, sh.mask])], axis=-1)
    o = g.op("Transpose", [g.op("MatMul", [p, vv])], perm=[0, 2, 1, 3])  # [B, T, H, D]
    o = g.op("Reshape", [o, g.op("Concat", [sh.b_dim, sh.t_dim, g.const(_i64([n_h * d]))], axis=0)])
    if at.attn_sub_norm is not None:
        o = _rmsnorm(g, o, at.attn_sub_norm.weight, cfg.rms_norm_eps)
    return g.op("Add", [x, _linear(g, o, at.o_proj, f"l{i}_o")])


def _activation(g: _G, gate: str, hidden_act: str) -> str:
    """The MLP's gate activation: relu2 (BitNet) or silu."""
    if hidden_act == "relu2":
        r = g.op("Relu", [gate])
        return g.op("Mul", [r, r])
    if hidden_act == "silu":
        return g.op("Mul", [gate, g.op("Sigmoid", [gate])])
    raise ValueError(f"ONNX export: unsupported hidden_act {hidden_act!r} (relu2, silu)")


def _mlp_block(g: _G, x: str, layer, i: int, cfg) -> str:
    """x + down(act(gate(norm(x))) * up(norm(x))) of layer i."""
    mlp = layer.mlp
    hn = _rmsnorm(g, x, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
    act = _activation(g, _linear(g, hn, mlp.gate_proj, f"l{i}_gate"), cfg.hidden_act)
    m = g.op("Mul", [act, _linear(g, hn, mlp.up_proj, f"l{i}_up")])
    if mlp.ffn_sub_norm is not None:
        m = _rmsnorm(g, m, mlp.ffn_sub_norm.weight, cfg.rms_norm_eps)
    return g.op("Add", [x, _linear(g, m, mlp.down_proj, f"l{i}_down")])


def _logits(g: _G, x: str, model, emb_name: str, sh: _Shared) -> None:
    """logits [B, T, V] = x @ W^T as Gemm(transB=1) on [B*T, H] rows; a tied head shares the embedding."""
    cfg = model.config
    head = (
        emb_name
        if model.lm_head is None
        else g.const(model.lm_head.weight.detach().float().numpy(), "lm_head")
    )
    rows = g.op("Reshape", [x, g.const(_i64([-1, cfg.hidden_size]))])
    flat = g.op("Gemm", [rows, head], transB=1)
    out_shape = g.op("Concat", [sh.b_dim, sh.t_dim, g.const(_i64([cfg.vocab_size]))], axis=0)
    g.nodes.append(g.h.make_node("Reshape", [flat, out_shape], ["logits"]))


def _model_proto(g: _G, cfg, n_layers: int):
    """The ModelProto of the built graph, with the config as metadata."""
    h_ = g.h
    inputs, outputs = _io_values(h_, cfg, n_layers)
    graph = h_.make_graph(g.nodes, "bitnetlm", inputs, outputs, initializer=g.inits)
    mp = h_.make_model(graph, opset_imports=[h_.make_opsetid("", OPSET)], producer_name="bitnetlm")
    mp.ir_version = 11
    mp.metadata_props.add(key="bitnetlm_format_version", value="1")
    mp.metadata_props.add(key="bitnetlm_arch", value=cfg.arch)
    # the whole config (context length, token ids, ...): what `onnx_import` cannot read off the graph
    mp.metadata_props.add(key="bitnetlm_config", value=json.dumps(cfg.to_hf()))
    return mp


def build_onnx(model):
    """An onnx.ModelProto for `model` (CausalLM, any mode)."""
    cfg = model.config
    if cfg.vocab_subset is not None:
        raise ValueError("ONNX export: a model with a reduced vocabulary (vocab_subset) is not supported")
    g = _G()  # (imports onnx)
    if cfg.family != "llama":
        raise ValueError(f"ONNX export takes LLaMA/BitNet-shaped models, not {cfg.arch}")
    emb_name = g.const(model.embed_tokens.weight.detach().float().numpy(), "embed")
    x = g.op("Gather", [emb_name, "input_ids"], axis=0)  # [B, T, H]
    cos, sin = _rope_tables(g, model.inv_freq)
    b_dim, t_dim, mask = _causal_mask(g)
    sh = _Shared(cos, sin, mask, b_dim, t_dim, g.const(_f32(1.0 / np.sqrt(cfg.head_dim))))
    for i, layer in progress.bar(list(enumerate(model.layers)), desc="building the ONNX graph", unit="layer"):
        x = _attention_block(g, x, layer, i, cfg, sh)
        x = _mlp_block(g, x, layer, i, cfg)
    x = _rmsnorm(g, x, model.norm.weight, cfg.rms_norm_eps)
    _logits(g, x, model, emb_name, sh)
    return _model_proto(g, cfg, len(model.layers))


def export_onnx(model, out: str | os.PathLike) -> Path:
    """Write the ONNX model atomically. Models over 2 GB put their weights in `<out>.data` next to it."""
    import onnx

    out = Path(out)
    mp = build_onnx(model)
    big = sum(len(t.raw_data) for t in mp.graph.initializer) > 1_800_000_000
    with atomic.temp_file(out) as tmp:
        if big:
            onnx.save_model(
                mp, tmp, save_as_external_data=True, all_tensors_to_one_file=True, location=out.name + ".data"
            )
        else:
            onnx.save_model(mp, tmp)
        atomic.commit(tmp, out)
    return out


def onnx_session(path: str | os.PathLike):
    import onnxruntime as ort

    so = ort.SessionOptions()
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def inspect_onnx(path: str | os.PathLike) -> dict:
    """`bitnet inspect` report of an ONNX file: opset, inputs/outputs, initializer table, bits per weight."""
    import onnx
    from onnx import TensorProto

    mp = onnx.load(str(path), load_external_data=False)
    bits = {
        TensorProto.INT2: 2,
        TensorProto.UINT2: 2,
        TensorProto.INT4: 4,
        TensorProto.UINT4: 4,
        TensorProto.INT8: 8,
        TensorProto.UINT8: 8,
        TensorProto.FLOAT16: 16,
        TensorProto.BFLOAT16: 16,
        TensorProto.FLOAT: 32,
        TensorProto.INT64: 64,
        TensorProto.INT32: 32,
        TensorProto.DOUBLE: 64,
    }
    tensors, total_n, total_bits, tern_n = [], 0, 0, 0
    for t in mp.graph.initializer:
        n = int(np.prod(t.dims)) if len(t.dims) else 1
        b = bits.get(t.data_type, 32)
        total_n += n
        total_bits += n * b
        if t.data_type in (TensorProto.INT2, TensorProto.UINT2) and len(t.dims):  # not the zero-point scalars
            tern_n += n
        tensors.append(
            {
                "name": t.name,
                "dtype": TensorProto.DataType.Name(t.data_type),
                "shape": list(t.dims),
                "bits_per_weight": b,
            }
        )

    def io(vs):  # noqa: E306
        return [f"{v.name}: {[d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]}" for v in vs]

    meta = {p.key: p.value for p in mp.metadata_props}
    return {
        "path": str(path),
        "format": f"onnx (ir {mp.ir_version}, opsets {[(o.domain or 'ai.onnx', o.version) for o in mp.opset_import]})",
        "architecture": meta.get("bitnetlm_arch"),
        "quantization": "ternary (INT2 DequantizeLinear + MatMul)" if tern_n else "none",
        "parameters": total_n,
        "ternary_parameters": tern_n,
        "bits_per_ternary_weight": 2.0 if tern_n else None,
        "bits_per_weight_overall": total_bits / max(total_n, 1),
        "file_bytes": Path(path).stat().st_size,
        "config": {
            "metadata": meta,
            "inputs": io(mp.graph.input),
            "outputs": io(mp.graph.output),
            "nodes": len(mp.graph.node),
        },
        "tensors": tensors,
    }
