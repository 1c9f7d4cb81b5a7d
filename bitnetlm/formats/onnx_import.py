"""ONNX import: a decoder graph of the shape `onnx_export` writes, read back into a model (no onnxruntime needed).

The graph is read by data flow, not by names, so graphs of the same shape from other writers load too: in node
order it finds the embedding (a Gather of `input_ids`), the RoPE frequencies (a constant multiplied into the cast
`position_ids`), the norms (a constant vector times the normalized activations, or an RMSNormalization /
SimplifiedLayerNormalization node) and the projections: MatMul over a float initializer, over DequantizeLinear of
an INT2 / INT4 / INT8 initializer (per tensor, per axis or blocked), or com.microsoft MatMulNBits (2-8 bits, block
scales, optional packed zero points), each times an optional scalar output scale. A projection whose input is the
per-token int8 activation quantization (Clip(Round(x * 127 / absmax))) is a ternary BitLinear: its weight must be
ternary times one scale. Per layer: norm, q, k, v, [sub-norm], o, norm, gate, up, [sub-norm], down; then the final
norm and the head (the embedding's initializer itself when tied). Our exporter also stores the model's config in
the metadata (`bitnetlm_config`); without it the config is read off the shapes (context length: 2048).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bitnetlm.formats.names import PROJECTIONS
from bitnetlm.models import ModelConfig, build_empty_model
from bitnetlm.models.transformer import rope_inv_freq
from bitnetlm.quant.bitlinear import BitLinear
from bitnetlm.quant.packing import PackingFormat, pack_hf

DEFAULT_CONTEXT = 2048  # max_position_embeddings of a graph that does not say


@dataclass
class Proj:
    """A projection: its weight W [in, out] (y = x @ W, output scale folded in), whether its input is the int8
    activation quantization, and the initializer it came from (for errors)."""

    w: np.ndarray
    quantized: bool
    source: str


def _where(node, i: int) -> str:
    return f"node {node.name!r} ({node.op_type})" if node.name else f"{node.op_type} node #{i}"


class OnnxGraph:
    """The graph's initializers and Constant outputs, producers and consumers, and what depends on the inputs."""

    def __init__(self, mp, path: Path):
        from onnx import numpy_helper

        self.path, self.g = path, mp.graph
        self.meta = {p.key: p.value for p in mp.metadata_props}
        self.raw = {t.name: t for t in self.g.initializer}
        self.consts: dict[str, np.ndarray] = {}
        self._np = numpy_helper
        self.nodes = list(self.g.node)
        self.producer = {o: (i, n) for i, n in enumerate(self.nodes) for o in n.output}
        self.consumers: dict[str, list] = {}
        for n in self.nodes:
            for x in n.input:
                self.consumers.setdefault(x, []).append(n)
        names = {v.name for v in self.g.input}
        for need in ("input_ids", "position_ids"):
            if need not in names:
                raise ValueError(f"{path}: the graph has no input {need!r} (inputs: {sorted(names)[:6]})")
        self.from_ids, self.from_pos = self._depends("input_ids"), self._depends("position_ids")

    def _depends(self, root: str) -> set[str]:
        out = {root}
        for n in self.nodes:
            if any(x in out for x in n.input):
                out.update(n.output)
        return out

    def const(self, name: str) -> np.ndarray | None:
        """The value of an initializer or a Constant node's output (integers as int64, floats as float32)."""
        if name in self.consts:
            return self.consts[name]
        t = self.raw.get(name)
        if t is None and name in self.producer and self.producer[name][1].op_type == "Constant":
            attr = {a.name: a for a in self.producer[name][1].attribute}
            t = attr["value"].t if "value" in attr else None
        if t is None:
            return None
        try:
            a = self._np.to_array(t)
        except Exception as e:  # noqa: BLE001 - a malformed tensor names itself
            raise ValueError(f"{self.path}: initializer {name!r} cannot be read: {e}") from None
        a = a.astype(np.float32) if a.dtype.kind == "f" or a.dtype.name.startswith("float") else a
        a = a.astype(np.int64) if a.dtype.kind in "iu" or a.dtype.name.startswith(("int", "uint")) else a
        self.consts[name] = a
        return a

    def node_of(self, name: str):
        return self.producer.get(name, (None, None))[1]


def _attrs(node) -> dict:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _dequantize(gr: OnnxGraph, node, i: int) -> tuple[np.ndarray, str] | None:
    """A DequantizeLinear of an integer initializer -> (float32 values, its name); None if x is not constant."""
    x = gr.const(node.input[0])
    if x is None:
        return None
    scale = gr.const(node.input[1]) if len(node.input) > 1 else None
    if scale is None:
        raise ValueError(f"{gr.path}: {_where(node, i)}: the scale is not a constant")
    zp = gr.const(node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros((), np.int64)
    at = _attrs(node)
    axis, block = at.get("axis", 1) % max(x.ndim, 1), at.get("block_size", 0)

    def spread(v: np.ndarray) -> np.ndarray:  # a per-axis or blocked parameter to x's shape
        if v.ndim == 0 or v.size == 1:
            return v.reshape(())
        if block:
            return np.repeat(v, block, axis=axis).take(range(x.shape[axis]), axis=axis)
        shape = [1] * x.ndim
        shape[axis] = -1
        return v.reshape(shape)

    w = (x.astype(np.float64) - spread(zp).astype(np.float64)) * spread(scale).astype(np.float64)
    return w.astype(np.float32), node.input[0]


def _unpack_bits(b: np.ndarray, bits: int) -> np.ndarray:
    """uint8 bytes -> their `bits`-bit fields, lowest first, along the last axis."""
    mask, per = (1 << bits) - 1, 8 // bits
    parts = [(b >> (bits * j)) & mask for j in range(per)]
    return np.stack(parts, axis=-1).reshape(*b.shape[:-1], b.shape[-1] * per)


def _matmul_nbits(gr: OnnxGraph, node, i: int) -> tuple[np.ndarray, str]:
    """com.microsoft MatMulNBits -> (W [K, N] float32, B's name)."""
    at = _attrs(node)
    k, n, bits, block = at.get("K"), at.get("N"), at.get("bits", 4), at.get("block_size")
    where = f"{gr.path}: {_where(node, i)}"
    if None in (k, n, block) or bits not in (2, 4, 8) or len(node.input) > 4 and node.input[4]:
        raise ValueError(
            f"{where}: expected attributes K, N, block_size and bits 2/4/8, no g_idx; found {at}"
        )
    qb, sc = gr.const(node.input[1]), gr.const(node.input[2])
    if qb is None or sc is None:
        raise ValueError(f"{where}: the weight {node.input[1]!r} and its scales must be constants")
    blocks = -(-k // block)
    if qb.size != n * blocks * block * bits // 8 or sc.size != n * blocks:
        raise ValueError(
            f"{where}: weight {node.input[1]!r} holds {qb.size} bytes and {sc.size} scales; "
            f"K={k}, N={n}, bits={bits}, block_size={block} need {n * blocks * block * bits // 8} and {n * blocks}"
        )
    q = _unpack_bits(qb.astype(np.uint8).reshape(n, blocks, -1), bits).astype(
        np.float64
    )  # [N, blocks, block]
    zp = np.full((n, blocks), 1 << (bits - 1), np.float64)
    if len(node.input) > 3 and node.input[3]:
        z = gr.const(node.input[3])
        if z is None or z.dtype.kind == "f":
            raise ValueError(f"{where}: zero points {node.input[3]!r}: expected packed uint8 constants")
        zp = _unpack_bits(z.astype(np.uint8).reshape(n, -1), bits)[:, :blocks].astype(np.float64)
    w = (q - zp[..., None]) * sc.astype(np.float64).reshape(n, blocks, 1)
    return w.reshape(n, -1)[:, :k].T.astype(np.float32), node.input[1]


def _weight(gr: OnnxGraph, name: str) -> tuple[np.ndarray, str] | None:
    """The constant matrix behind MatMul input `name` ([K, N]): a float initializer, a DequantizeLinear of an
    integer one, or either transposed; None if it is computed."""
    c = gr.const(name)
    if c is not None:
        return (c.astype(np.float32), name) if c.ndim == 2 else None
    node = gr.node_of(name)
    if node is None:
        return None
    i = gr.producer[name][0]
    if node.op_type == "DequantizeLinear":
        return _dequantize(gr, node, i)
    if node.op_type == "Transpose" and list(_attrs(node).get("perm", [1, 0])) == [1, 0]:
        got = _weight(gr, node.input[0])
        return None if got is None else (got[0].T, got[1])
    return None


def _quantized_input(gr: OnnxGraph, name: str) -> bool:
    """Whether `name` is the int8 activation quantization: Clip(Round(...))."""
    node = gr.node_of(name)
    return (
        node is not None
        and node.op_type == "Clip"
        and getattr(gr.node_of(node.input[0]), "op_type", "") == "Round"
    )


def _output_scale(gr: OnnxGraph, out: str) -> float:
    """The scalar a projection's output is multiplied by: Mul(y, s) or, after int8 activations, Mul(y, Div(s, a))."""
    users = gr.consumers.get(out, [])
    if len(users) != 1 or users[0].op_type != "Mul":
        return 1.0
    other = next(x for x in users[0].input if x != out)
    c = gr.const(other)
    if c is not None:
        return float(c.reshape(-1)[0]) if c.size == 1 else 1.0
    div = gr.node_of(other)
    if div is not None and div.op_type == "Div":
        c = gr.const(div.input[0])
        if c is not None and c.size == 1:
            return float(c.reshape(-1)[0])
    return 1.0


def _projection(gr: OnnxGraph, node, i: int) -> Proj | None:
    if node.op_type == "MatMulNBits":
        w, src = _matmul_nbits(gr, node, i)
    elif node.op_type in ("MatMul", "Gemm"):
        got = _weight(gr, node.input[1])
        if got is None:
            return None
        w, src = got
        if node.op_type == "Gemm":
            at = _attrs(node)
            if at.get("transA", 0) or len(node.input) > 2 and node.input[2]:
                raise ValueError(f"{gr.path}: {_where(node, i)}: a head Gemm with transA or a bias")
            w = w.T if at.get("transB", 0) else w
            w = w * at.get("alpha", 1.0)
    else:
        return None
    return Proj(w * _output_scale(gr, node.output[0]), _quantized_input(gr, node.input[0]), src)


def _norm(gr: OnnxGraph, node, i: int) -> tuple[np.ndarray, float] | None:
    """A norm's (weight, eps): an RMSNormalization-like node, or Mul(w, x * 1/sqrt(mean(x^2) + eps))."""
    if node.op_type in ("RMSNormalization", "SimplifiedLayerNormalization"):
        return gr.const(node.input[1]), float(_attrs(node).get("epsilon", 1e-5))
    if node.op_type != "Mul":
        return None
    for a, b in (node.input, node.input[::-1]):
        w = gr.const(a)
        if w is not None and w.ndim == 1 and w.size > 1 and b in gr.from_ids:
            return w, _eps(gr, b, node, i)
    return None


def _eps(gr: OnnxGraph, x: str, node, i: int) -> float:
    """eps of the normalization whose output is `x`: Mul(x, Reciprocal(Sqrt(Add(mean, eps))))."""
    inner = gr.node_of(x)
    for y in inner.input if inner is not None else ():
        chain = gr.node_of(y)
        while chain is not None and chain.op_type in ("Reciprocal", "Sqrt"):
            chain = gr.node_of(chain.input[0])
        if chain is not None and chain.op_type == "Add":
            for z in chain.input:
                c = gr.const(z)
                if c is not None and c.size == 1:
                    return float(c.reshape(-1)[0])
    raise ValueError(f"{gr.path}: {_where(node, i)}: a norm weight whose normalization's eps cannot be found")


@dataclass
class Parsed:
    """What the graph holds, in node order."""

    embed: np.ndarray
    embed_name: str
    inv_freq: np.ndarray
    norms: list[tuple[np.ndarray, float]]
    projs: list[Proj]
    acts: set[str]


def parse(gr: OnnxGraph) -> Parsed:
    embed = name = inv = None
    norms, projs, acts = [], [], set()
    for i, node in enumerate(gr.nodes):
        op = node.op_type
        if op == "Gather" and embed is None and node.input[1] in gr.from_ids:
            embed, name = gr.const(node.input[0]), node.input[0]
            if embed is None or embed.ndim != 2:
                raise ValueError(f"{gr.path}: {_where(node, i)}: the embedding is not a constant matrix")
            continue
        if op in ("Relu", "Sigmoid"):
            acts.add(op)
        p = _projection(gr, node, i)
        if p is not None:
            projs.append(p)
            continue
        if op == "Mul" and inv is None:
            for a, b in (node.input, node.input[::-1]):
                c = gr.const(a)
                if c is not None and c.ndim == 1 and b in gr.from_pos and b not in gr.from_ids:
                    inv = c
            if inv is not None:
                continue
        got = _norm(gr, node, i)
        if got is not None:
            norms.append(got)
    if embed is None:
        raise ValueError(f"{gr.path}: no embedding found (a Gather of a constant matrix by input_ids)")
    if inv is None:
        raise ValueError(f"{gr.path}: no RoPE frequencies found (a constant multiplied into position_ids)")
    return Parsed(embed, name, inv, norms, projs, acts)


def _config(gr: OnnxGraph, p: Parsed) -> ModelConfig:
    """The model's config: our exporter's metadata, checked against the graph, or read off the shapes."""
    where = gr.path
    n_layers, extra = divmod(len(p.projs) - 1, 7)
    if n_layers < 1 or extra:
        raise ValueError(f"{where}: found {len(p.projs)} projections; a decoder has 7 per layer and a head")
    if len(p.norms) not in (2 * n_layers + 1, 4 * n_layers + 1):
        raise ValueError(
            f"{where}: found {len(p.norms)} norm weights for {n_layers} layers (2 or 4 a layer + 1)"
        )
    sub = len(p.norms) == 4 * n_layers + 1
    quantized = {q.quantized for q in p.projs[:-1]}
    if len(quantized) > 1:
        odd = next(q for q in p.projs[:-1] if q.quantized != p.projs[0].quantized)
        raise ValueError(f"{where}: projection {odd.source!r} differs from the others in int8 activations")
    d = 2 * p.inv_freq.size
    vocab, hidden = p.embed.shape
    q, k, gate = p.projs[0].w, p.projs[1].w, p.projs[4].w
    act = {frozenset({"Relu"}): "relu2", frozenset({"Sigmoid"}): "silu"}.get(frozenset(p.acts))
    if act is None:
        raise ValueError(f"{where}: MLP activation not recognised (ops {sorted(p.acts)}; relu2 or silu)")
    theta = float(p.inv_freq[1]) ** (-d / 2) if p.inv_freq.size > 1 else 10000.0
    theta = float(f"{theta:.5g}")  # (float32 frequencies: theta to 5 significant digits)
    derived = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=gate.shape[1],
        num_hidden_layers=n_layers,
        num_attention_heads=q.shape[1] // d,
        num_key_value_heads=k.shape[1] // d,
        head_dim=d,
        rms_norm_eps=p.norms[0][1],
        hidden_act=act,
        tie_word_embeddings=p.projs[-1].source == p.embed_name,
        quant="ternary" if quantized == {True} else "none",
    )
    meta = gr.meta.get("bitnetlm_config")
    if meta is not None:
        cfg = ModelConfig.from_hf(json.loads(meta), source=f"{where} (metadata bitnetlm_config)")
        for key, v in derived.items():
            if key != "rms_norm_eps" and getattr(cfg, key) != v:
                raise ValueError(f"{where}: metadata says {key}={getattr(cfg, key)!r}, the graph has {v!r}")
        return cfg
    arch = gr.meta.get("bitnetlm_arch") or ("bitnet" if sub else "llama")
    return ModelConfig(arch=arch, rope_theta=theta, max_position_embeddings=DEFAULT_CONTEXT, **derived)


def _ternary(w: np.ndarray, source: str, where: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(T int8, s) of a matrix holding {-s, 0, s} only."""
    a = np.abs(w)
    s = float(a.max()) if a.size else 0.0
    if s == 0 or not bool(((a == 0) | (a == s)).all()):
        raise ValueError(
            f"{where}: weight {source!r} feeds int8-quantized activations but is not ternary ({{-s, 0, s}})"
        )
    return torch.from_numpy(np.sign(w).astype(np.int8)), torch.tensor([s], dtype=torch.float32)


def _state_dict(model, cfg: ModelConfig, p: Parsed, dtype, where: Path) -> dict[str, torch.Tensor]:
    def fl(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(dtype)

    sd = {"embed_tokens.weight": fl(p.embed), "norm.weight": fl(p.norms[-1][0])}
    per = 4 if cfg.has_sub_norms else 2
    norm_names = (
        "input_layernorm",
        "self_attn.attn_sub_norm",
        "post_attention_layernorm",
        "mlp.ffn_sub_norm",
    )
    if per == 2:
        norm_names = ("input_layernorm", "post_attention_layernorm")
    for layer in range(cfg.num_hidden_layers):
        for j, n in enumerate(norm_names):
            sd[f"layers.{layer}.{n}.weight"] = fl(p.norms[per * layer + j][0])
        for j, n in enumerate(PROJECTIONS):
            proj, name = p.projs[7 * layer + j], f"layers.{layer}.{n}"
            module = model.get_submodule(name)
            wt = np.ascontiguousarray(proj.w.T)  # [out, in]
            if tuple(wt.shape) != (module.out_features, module.in_features):
                raise ValueError(
                    f"{where}: weight {proj.source!r} has shape {wt.shape[::-1]} for {name}, "
                    f"expected {(module.in_features, module.out_features)}"
                )
            if isinstance(module, BitLinear):
                t, s = _ternary(wt, proj.source, where)
                if not module.training_mode:
                    sd[name + ".packed"], sd[name + ".weight_scale"] = pack_hf(t), s
                    continue
                wt = t.float().numpy() * float(s)
            sd[name + ".weight"] = torch.from_numpy(wt).float() if isinstance(module, BitLinear) else fl(wt)
    if model.lm_head is not None:
        sd["lm_head.weight"] = fl(p.projs[-1].w.T)
    return sd


def read_onnx(path: str | os.PathLike):
    """(the ModelProto, the OnnxGraph over it) of `path`; one-line errors for what is not an ONNX model."""
    from bitnetlm import deps

    onnx = deps.require("onnx", "reading ONNX files")

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        mp = onnx.load(str(path))
    except Exception as e:  # noqa: BLE001 - protobuf's errors name neither the file nor the problem well
        raise ValueError(f"{path}: not a readable ONNX model ({type(e).__name__}: {e})") from None
    return mp, OnnxGraph(mp, path)


def config_from_onnx(path: str | os.PathLike) -> ModelConfig:
    _, gr = read_onnx(path)
    return _config(gr, parse(gr))


def load_onnx_model(path: str | os.PathLike, mode: str = "infer", dtype: torch.dtype = torch.float32):
    """A model (CPU) from an ONNX decoder graph (see the module docstring)."""
    _, gr = read_onnx(path)
    p = parse(gr)
    cfg = _config(gr, p)
    model = build_empty_model(cfg, mode)
    model.load_state_dict(_state_dict(model, cfg, p, dtype, gr.path), strict=True, assign=True)
    inv = rope_inv_freq(cfg)
    if not np.allclose(inv.numpy(), p.inv_freq, rtol=1e-5, atol=0):
        raise ValueError(
            f"{gr.path}: the RoPE frequencies are not those of theta={cfg.rope_theta} (scaled RoPE?)"
        )
    model.inv_freq = torch.from_numpy(p.inv_freq.astype(np.float32))  # (the graph's own, to the bit)
    for m in model.modules():
        if isinstance(m, BitLinear) and not m.training_mode:
            m.layout = PackingFormat.HF_2BIT
    model.source_metadata = {"format": "onnx", "path": str(gr.path)}
    return model.eval() if mode != "train" else model
