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


def build_onnx(model):
    """An onnx.ModelProto for `model` (CausalLM, any mode)."""
    if model.config.vocab_subset is not None:
        raise ValueError("ONNX export: a model with a reduced vocabulary (vocab_subset) is not supported")
    from onnx import TensorProto

    cfg = model.config
    if cfg.family != "llama":
        raise ValueError(f"ONNX export takes LLaMA/BitNet-shaped models, not {cfg.arch}")
    g = _G()
    h_ = g.h
    n_h, n_kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rep = n_h // n_kv
    inputs = [
        h_.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
        h_.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]),
    ]
    outputs = [h_.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", cfg.vocab_size])]
    emb = model.embed_tokens.weight.detach().float()
    emb_name = g.const(emb.numpy(), "embed")
    x = g.op("Gather", [emb_name, "input_ids"], axis=0)  # [B, T, H]
    # RoPE tables from position_ids
    inv = model.inv_freq.detach().float().numpy()
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
    # causal mask over cache slots: query t (slot P+t) sees slots j <= P+t
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
    neg = g.op("Where", [allowed, g.const(_f32(0.0)), g.const(_f32(-np.inf))])  # additive mask [T, S]
    heads_shape = lambda n: g.op("Concat", [b_dim, t_dim, g.const(_i64([n, d]))], axis=0)  # noqa: E731
    scale = g.const(_f32(1.0 / np.sqrt(d)))
    for i, layer in progress.bar(list(enumerate(model.layers)), desc="building the ONNX graph", unit="layer"):
        for kind in ("key", "value"):
            inputs.append(
                h_.make_tensor_value_info(
                    f"past_key_values.{i}.{kind}", TensorProto.FLOAT, ["batch", n_kv, "past", d]
                )
            )
            outputs.append(
                h_.make_tensor_value_info(
                    f"present.{i}.{kind}", TensorProto.FLOAT, ["batch", n_kv, "total", d]
                )
            )
        at = layer.self_attn
        hn = _rmsnorm(g, x, layer.input_layernorm.weight, cfg.rms_norm_eps)
        q = g.op(
            "Transpose",
            [g.op("Reshape", [_linear(g, hn, at.q_proj, f"l{i}_q"), heads_shape(n_h)])],
            perm=[0, 2, 1, 3],
        )  # [B, H, T, D]
        k = g.op(
            "Transpose",
            [g.op("Reshape", [_linear(g, hn, at.k_proj, f"l{i}_k"), heads_shape(n_kv)])],
            perm=[0, 2, 1, 3],
        )
        v = g.op(
            "Transpose",
            [g.op("Reshape", [_linear(g, hn, at.v_proj, f"l{i}_v"), heads_shape(n_kv)])],
            perm=[0, 2, 1, 3],
        )
        q = g.op("Add", [g.op("Mul", [q, cos]), g.op("Mul", [_rotate_half(g, q, d // 2), sin])])
        k = g.op("Add", [g.op("Mul", [k, cos]), g.op("Mul", [_rotate_half(g, k, d // 2), sin])])
        kc = f"present.{i}.key"
        vc = f"present.{i}.value"
        g.nodes.append(h_.make_node("Concat", [f"past_key_values.{i}.key", k], [kc], axis=2))
        g.nodes.append(h_.make_node("Concat", [f"past_key_values.{i}.value", v], [vc], axis=2))
        kk, vv = kc, vc
        if rep > 1:  # GQA: repeat each KV head `rep` times -> [B, H, S, D]
            full = g.op("Concat", [b_dim, g.const(_i64([n_h, -1, d]))], axis=0)
            exp_shape = g.op(
                "Concat", [b_dim, g.const(_i64([n_kv, rep])), g.op("Shape", [kc], start=2)], axis=0
            )
            kk = g.op(
                "Reshape", [g.op("Expand", [g.op("Unsqueeze", [kc, g.const(_i64([2]))]), exp_shape]), full]
            )
            vv = g.op(
                "Reshape", [g.op("Expand", [g.op("Unsqueeze", [vc, g.const(_i64([2]))]), exp_shape]), full]
            )
        scores = g.op("Mul", [g.op("MatMul", [q, g.op("Transpose", [kk], perm=[0, 1, 3, 2])]), scale])
        p = g.op("Softmax", [g.op("Add", [scores, neg])], axis=-1)
        o = g.op("Transpose", [g.op("MatMul", [p, vv])], perm=[0, 2, 1, 3])  # [B, T, H, D]
        o = g.op("Reshape", [o, g.op("Concat", [b_dim, t_dim, g.const(_i64([n_h * d]))], axis=0)])
        if at.attn_sub_norm is not None:
            o = _rmsnorm(g, o, at.attn_sub_norm.weight, cfg.rms_norm_eps)
        x = g.op("Add", [x, _linear(g, o, at.o_proj, f"l{i}_o")])
        mlp = layer.mlp
        hn = _rmsnorm(g, x, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
        gate = _linear(g, hn, mlp.gate_proj, f"l{i}_gate")
        if cfg.hidden_act == "relu2":
            r = g.op("Relu", [gate])
            act = g.op("Mul", [r, r])
        elif cfg.hidden_act == "silu":
            act = g.op("Mul", [gate, g.op("Sigmoid", [gate])])
        else:
            raise ValueError(f"ONNX export: unsupported hidden_act {cfg.hidden_act!r} (relu2, silu)")
        m = g.op("Mul", [act, _linear(g, hn, mlp.up_proj, f"l{i}_up")])
        if mlp.ffn_sub_norm is not None:
            m = _rmsnorm(g, m, mlp.ffn_sub_norm.weight, cfg.rms_norm_eps)
        x = g.op("Add", [x, _linear(g, m, mlp.down_proj, f"l{i}_down")])
    x = _rmsnorm(g, x, model.norm.weight, cfg.rms_norm_eps)
    # logits = x @ W^T as Gemm(transB=1) on [B*T, H] rows: a tied head shares the embedding initializer
    head = (
        emb_name
        if model.lm_head is None
        else g.const(model.lm_head.weight.detach().float().numpy(), "lm_head")
    )
    rows = g.op("Reshape", [x, g.const(_i64([-1, cfg.hidden_size]))])
    flat = g.op("Gemm", [rows, head], transB=1)
    out_shape = g.op("Concat", [b_dim, t_dim, g.const(_i64([cfg.vocab_size]))], axis=0)
    g.nodes.append(h_.make_node("Reshape", [flat, out_shape], ["logits"]))
    graph = h_.make_graph(g.nodes, "bitnetlm", inputs, outputs, initializer=g.inits)
    mp = h_.make_model(graph, opset_imports=[h_.make_opsetid("", OPSET)], producer_name="bitnetlm")
    mp.ir_version = 11
    mp.metadata_props.add(key="bitnetlm_format_version", value="1")
    mp.metadata_props.add(key="bitnetlm_arch", value=cfg.arch)
    # the whole config (context length, token ids, ...): what `onnx_import` cannot read off the graph
    mp.metadata_props.add(key="bitnetlm_config", value=json.dumps(cfg.to_hf()))
    return mp


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
