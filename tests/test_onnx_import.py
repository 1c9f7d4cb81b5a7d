"""ONNX import: our exporter's files and graphs of the same shape with INT4 DequantizeLinear or MatMulNBits
weights load back into a model whose logits equal the original's and onnxruntime's on the same file."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from test_onnx_export import _empty_past, _model

import bitnetlm
from bitnetlm.convert import convert
from bitnetlm.formats.onnx_export import export_onnx
from bitnetlm.formats.onnx_import import load_onnx_model
from bitnetlm.loading import load_tokenizer

IDS = torch.randint(3, 300, (2, 6), generator=torch.Generator().manual_seed(5))


def ours(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, cache=model.new_cache(2, 16))


def ort_logits(path, cfg) -> torch.Tensor:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    # onnxruntime fuses blocked DequantizeLinear + MatMul into MatMulNBits with int8 activations (accuracy level
    # 4) by default; the oracle computes the graph as written, in float32
    so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    b, t = IDS.shape
    feeds = {"input_ids": IDS.numpy(), "position_ids": np.tile(np.arange(t), (b, 1)), **_empty_past(cfg, b)}
    return torch.from_numpy(sess.run(["logits"], feeds)[0])


@pytest.mark.parametrize("arch", ["bitnet", "1bitllm", "llama"])
def test_export_import_logits_equal(tmp_path, arch):
    model = _model(arch)
    path = export_onnx(model, tmp_path / "m.onnx")
    back = load_onnx_model(path)
    assert back.config.to_hf() == model.config.to_hf()
    ref, got = ours(model), ours(back)
    assert torch.equal(got, ref)
    torch.testing.assert_close(ort_logits(path, model.config), got, atol=1e-4, rtol=1e-4)


def test_load_and_convert_to_hf(tmp_path):
    model = _model("bitnet")
    path = export_onnx(model, tmp_path / "m.onnx")
    m, tok = bitnetlm.load(path, backend="reference")
    assert tok is None and torch.equal(ours(m), ours(model))
    out = convert(path, tmp_path / "hf", to="hf")
    hf, _ = bitnetlm.load(out, backend="reference")
    assert hf.config.to_hf() == model.config.to_hf() and torch.equal(ours(hf), ours(model))
    tiny = Path(bitnetlm.__file__).parent / "zoo" / "bundled" / "bitnet-tiny"
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a tokenizer beside the graph goes with it
        shutil.copy(tiny / name, tmp_path / name)
    _, tok = bitnetlm.load(path, backend="reference")
    assert tok is not None and tok.encode("Paris") == load_tokenizer(tiny).encode("Paris")
    out = convert(path, tmp_path / "hf2", to="hf")
    assert (out / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()


def _matmul_weights(mp):
    """(MatMul node, its weight [K, N] float32, the node feeding it or None) for every MatMul over a constant
    weight: a float initializer or DequantizeLinear of an INT2 one (scale 1, zero point 0: the ternary values)."""
    inits = {t.name: t for t in mp.graph.initializer}
    prod = {o: n for n in mp.graph.node for o in n.output}
    out = []
    for n in mp.graph.node:
        if n.op_type != "MatMul":
            continue
        w = inits.get(n.input[1])
        if w is not None:
            out.append((n, numpy_helper.to_array(w).astype(np.float32), None))
        elif n.input[1] in prod and prod[n.input[1]].op_type == "DequantizeLinear":
            dq = prod[n.input[1]]
            out.append((n, numpy_helper.to_array(inits[dq.input[0]]).astype(np.float32), dq))
    return out


def _quantize4(w: np.ndarray, block: int):
    """4-bit blocks along K of w [K, N]: (q uint8 [K, N], scale [K/block, N], zero point). Asymmetric for float
    weights; ternary ones exactly, at zero points that vary by block."""
    k, n = w.shape
    wb = w.reshape(k // block, block, n)
    amax = np.abs(wb).max(1)
    if set(np.unique(np.abs(w))) <= {0.0, float(np.abs(w).max())}:  # ternary: T * 1 + zp, exact
        scale = np.where(amax > 0, amax, 1.0).astype(np.float32)
        zp = (7 + np.arange(k // block)[:, None] % 3 + np.zeros((1, n), int)).astype(np.uint8)
    else:
        lo, hi = np.minimum(wb.min(1), 0), np.maximum(wb.max(1), 0)
        scale = np.where(hi > lo, (hi - lo) / 15, 1.0).astype(np.float32)
        zp = np.clip(np.round(-lo / scale), 0, 15).astype(np.uint8)
    q = np.clip(np.round(wb / scale[:, None]) + zp[:, None], 0, 15).astype(np.uint8)
    return q.reshape(k, n), scale, zp


def requantize(mp, kind: str, block: int = 16):
    """The graph with every constant-weight MatMul rewritten: "dq": UINT4 DequantizeLinear blocked along K with
    zero points, then MatMul; "nbits": com.microsoft MatMulNBits (4 bits). Ternary values stay exact."""
    g = mp.graph
    for i, (node, w, dq) in enumerate(_matmul_weights(mp)):
        k, n = w.shape
        q, scale, zp = _quantize4(w, block)
        if kind == "dq":
            names = [f"w{i}_q", f"w{i}_s", f"w{i}_z"]
            g.initializer.extend(
                [
                    helper.make_tensor(names[0], TensorProto.UINT4, [k, n], q.reshape(-1).tolist()),
                    numpy_helper.from_array(scale, names[1]),
                    helper.make_tensor(names[2], TensorProto.UINT4, list(zp.shape), zp.reshape(-1).tolist()),
                ]
            )
            new = [helper.make_node("DequantizeLinear", names, [f"w{i}"], axis=0, block_size=block)]
            new.append(helper.make_node("MatMul", [node.input[0], f"w{i}"], list(node.output)))
        else:
            qt = q.T.reshape(n, k // block, block // 2, 2)  # [N, blocks, bytes, 2 nibbles], low nibble first
            packed = (qt[..., 0] | (qt[..., 1] << 4)).astype(np.uint8)
            zt = np.concatenate([zp.T, np.zeros((n, (k // block) % 2), np.uint8)], 1).reshape(n, -1, 2)
            zpk = (zt[..., 0] | (zt[..., 1] << 4)).astype(np.uint8)
            names = [f"w{i}_q", f"w{i}_s", f"w{i}_z"]
            g.initializer.extend(
                [
                    numpy_helper.from_array(packed, names[0]),
                    numpy_helper.from_array(np.ascontiguousarray(scale.T).reshape(-1), names[1]),
                    numpy_helper.from_array(zpk, names[2]),
                ]
            )
            new = [
                helper.make_node(
                    "MatMulNBits", [node.input[0], *names], list(node.output), domain="com.microsoft",
                    K=k, N=n, bits=4, block_size=block,
                )
            ]  # fmt: skip
        at = list(g.node).index(node)
        del g.node[at]
        for j, nn in enumerate(new):
            g.node.insert(at + j, nn)
        if dq is not None:
            g.node.remove(dq)
    used = {x for n in g.node for x in n.input}
    keep = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)
    if kind == "nbits":
        mp.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    del mp.metadata_props[:]  # a graph from elsewhere: no config of ours
    return mp


@pytest.mark.parametrize("kind", ["dq", "nbits"])
@pytest.mark.parametrize("arch", ["bitnet", "llama"])
def test_int4_graphs_of_others_match_onnxruntime(tmp_path, arch, kind):
    """Ternary weights stored as 4-bit blocks import as the same ternary model; full-precision ones as their 4-bit
    values, whatever onnxruntime computes with them."""
    model = _model(arch)
    mp = requantize(onnx.load(str(export_onnx(model, tmp_path / "m.onnx"))), kind)
    path = tmp_path / f"{kind}.onnx"
    onnx.save_model(mp, str(path))
    back = load_onnx_model(path)
    got = ours(back)
    assert back.config.quant == model.config.quant and back.config.num_hidden_layers == 2
    if model.config.quant == "ternary":
        assert torch.equal(got, ours(model))
    torch.testing.assert_close(ort_logits(path, model.config), got, atol=1e-4, rtol=1e-4)


def test_bad_files_one_line_errors(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match=r"bad\.onnx: not a readable ONNX model"):
        load_onnx_model(bad)
    model = _model("bitnet")
    mp = onnx.load(str(export_onnx(model, tmp_path / "m.onnx")))
    t = next(t for t in mp.graph.initializer if t.data_type == TensorProto.INT2 and len(t.dims))
    vals = numpy_helper.to_array(t).astype(np.int8).reshape(-1)
    vals[0] = -2  # a value outside {-1, 0, 1}
    t.CopyFrom(helper.make_tensor(t.name, TensorProto.INT2, list(t.dims), vals.tolist()))
    onnx.save_model(mp, str(bad))
    with pytest.raises(ValueError, match=rf"bad\.onnx: weight '{t.name}' .* not ternary"):
        load_onnx_model(bad)
    mp.graph.input[0].name = "ids"
    onnx.save_model(mp, str(bad))
    with pytest.raises(ValueError, match="bad.onnx: the graph has no input 'input_ids'"):
        load_onnx_model(bad)


def test_bad_matmul_nbits_names_node_and_weight(tmp_path):
    mp = requantize(onnx.load(str(export_onnx(_model("llama"), tmp_path / "m.onnx"))), "nbits")
    node = next(n for n in mp.graph.node if n.op_type == "MatMulNBits")
    next(a for a in node.attribute if a.name == "K").i += 16  # K no longer fits the stored bytes
    node.name = "l0_q"
    bad = tmp_path / "bad.onnx"
    onnx.save_model(mp, str(bad))
    with pytest.raises(
        ValueError, match=rf"bad\.onnx: node 'l0_q' \(MatMulNBits\): weight '{node.input[1]}' holds"
    ):
        load_onnx_model(bad)
