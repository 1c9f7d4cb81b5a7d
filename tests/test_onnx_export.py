"""ONNX export (INT2 DequantizeLinear + MatMul, KV cache) run by onnxruntime on CPU vs our model."""

import numpy as np
import onnx
import pytest
import torch
from oracle import random_model

from bitnetlm.formats.onnx_export import export_onnx, onnx_session
from bitnetlm.quant import to_inference_


def _model(arch):
    tie = (
        {"tie_word_embeddings": True} if arch == "llama" else {}
    )  # exercises the shared embedding/head export
    m = random_model(arch, 3, 64, 128, **tie)
    return (to_inference_(m) if m.config.quant == "ternary" else m).eval()


def _empty_past(cfg, b):
    return {
        f"past_key_values.{i}.{k}": np.zeros((b, cfg.num_key_value_heads, 0, cfg.head_dim), np.float32)
        for i in range(cfg.num_hidden_layers)
        for k in ("key", "value")
    }


@pytest.mark.parametrize("arch", ["bitnet", "1bitllm", "llama"])
def test_onnx_matches_ours_with_kv_cache(tmp_path, arch):
    model = _model(arch)
    cfg = model.config
    path = export_onnx(model, tmp_path / "m.onnx")
    mp = onnx.load(str(path))
    onnx.checker.check_model(mp)
    if cfg.quant == "ternary":
        assert any(t.data_type == onnx.TensorProto.INT2 for t in mp.graph.initializer)
        assert any(n.op_type == "DequantizeLinear" for n in mp.graph.node)
    sess = onnx_session(path)
    b, t = 2, 6
    ids = torch.randint(3, 300, (b, t), generator=torch.Generator().manual_seed(5))
    feeds = {"input_ids": ids.numpy(), "position_ids": np.tile(np.arange(t), (b, 1)), **_empty_past(cfg, b)}
    names = [o.name for o in sess.get_outputs()]
    res = dict(zip(names, sess.run(None, feeds)))
    cache = model.new_cache(b, 32)
    with torch.no_grad():
        ref = model(ids, cache=cache)
    worst = float(np.abs(res["logits"] - ref.numpy()).max())
    # greedy decode 6 tokens through both, each with its own KV cache
    ours_tok = ref[:, -1].argmax(-1)
    onnx_tok = torch.from_numpy(res["logits"][:, -1].argmax(-1))
    got_ours, got_onnx = [], []
    for step in range(6):
        assert torch.equal(ours_tok, onnx_tok), f"greedy tokens differ at step {step}"
        got_ours.append(ours_tok.tolist())
        got_onnx.append(onnx_tok.tolist())
        pos = t + step
        feeds = {"input_ids": onnx_tok[:, None].numpy(), "position_ids": np.full((b, 1), pos, np.int64)}
        feeds.update(
            {n.replace("present", "past_key_values"): v for n, v in res.items() if n.startswith("present")}
        )
        res = dict(zip(names, sess.run(None, feeds)))
        assert res["present.0.key"].shape[2] == pos + 1
        with torch.no_grad():
            ref = model(ours_tok[:, None], positions=torch.full((b, 1), pos), cache=cache)
        worst = max(worst, float(np.abs(res["logits"] - ref.numpy()).max()))
        ours_tok, onnx_tok = ref[:, -1].argmax(-1), torch.from_numpy(res["logits"][:, -1].argmax(-1))
    print(f"\n{arch}: max |logit diff| onnxruntime vs ours over prefill + 6 decode steps = {worst:.3g}")
    assert worst <= 1e-3
    assert got_ours == got_onnx


def test_onnx_export_is_atomic(tmp_path, monkeypatch):
    model = _model("bitnet")
    out = tmp_path / "m.onnx"
    out.write_bytes(b"keep me")
    import bitnetlm.formats.onnx_export as ox

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(onnx, "save_model", boom)
    with pytest.raises(RuntimeError):
        ox.export_onnx(model, out)
    assert out.read_bytes() == b"keep me" and [p.name for p in tmp_path.iterdir()] == ["m.onnx"]
