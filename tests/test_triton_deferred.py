"""Deferred split-K projections (kernels/triton/deferred.py): finished by the next quantization launch, they give
the finished projection's rows and that launch's codes bit for bit, and leave their sums buffer zeroed.

Without a GPU the kernels run under Triton's interpreter on small ragged shapes; the `gpu` tests use the 2B4T
shapes and the engine's captured decode step.
"""

from __future__ import annotations

import pytest
import torch
from triton_interp import DEV, triton_modules

L, T, D, layout = triton_modules("launch", "tune", "deferred", "layout")


def _setup(m, n, k, gated, seed, dev, dtype):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * n if gated else n
    p = layout.pack_triton(torch.randint(-1, 2, (rows, k), generator=g, dtype=torch.int8)).to(dev)
    x = (torch.randn(m, k, generator=g) * (1 + 3 * torch.rand(m, 1, generator=g))).to(dev, dtype)
    norm = (0.5 + torch.rand(k, generator=g)).to(dev)
    norm2 = (0.5 + torch.rand(n, generator=g)).to(dev)
    res = torch.randn(m, n, generator=g).to(dev, dtype)
    return p, x, norm, norm2, res, g


def _quant(x, norm, kq):
    """launch_quant of x (rows or a SplitKSums) into fresh buffers: codes [M, kq], a, rowsum."""
    m = x.shape[0]
    q = torch.zeros((m, 4 * layout.packed_row_bytes(kq)), dtype=torch.int8, device=DEV)
    a = torch.zeros((m,), dtype=torch.float32, device=DEV)
    rs = torch.zeros((m,), dtype=torch.int32, device=DEV)
    L.launch_quant(x, norm, q, a, rs, 1e-5)
    return q, a, rs


def _force(cfg, path, n, k, m, flags):
    key = (path, n, k, T._next_pow2(m), *flags)
    T._choice[key] = cfg
    return key


def _sums_zero():
    return all(int(s.abs().sum()) == 0 for s in D._sums.values())


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("m", [3, 8])
def test_deferred_equals_finished(m, gated):
    """Every split-K tile shape of a small projection (unswapped, swapped, gate|up paired), deferred, with per-row
    and scalar weight scales, relu2 and silu, a residual: the next quantization launch stores exactly the rows the
    finished projection stores, and their codes. The other consumers (a launch without a norm, `finish()`, a row
    GEMV over codes or over the rows) take the first tile's."""
    n, k = 40, 300
    p, x, norm, norm2, res, g = _setup(m, n, k, gated, seed=m + 7 * gated, dev=DEV, dtype=torch.float32)
    rows = 2 * n if gated else n
    p2 = layout.pack_triton(torch.randint(-1, 2, (24, n), generator=g, dtype=torch.int8)).to(DEV)
    s2 = (0.01 + torch.rand(24, generator=g)).to(DEV)
    cands = T._splitk_candidates(m, n, p.shape[1], gated)
    assert cands and all(c["SPLIT"] > 1 for c in cands)  # the shape must split, or nothing is deferred
    for i, cfg in enumerate(cands):
        path = "splitk_pair" if cfg.get("PAIR") else ("splitk_t" if cfg["SWAP"] else "splitk")
        for per_row, act in ((True, "relu2"), (False, "silu")):
            s = (0.01 + torch.rand(rows if per_row else 1, generator=g)).to(DEV)
            r = None if gated else res
            kw = dict(norm_weight=norm, residual=r, gated=gated, act=act, path=path)
            key = _force(cfg, path, n, k, m, (gated, True, r is not None, per_row))
            try:
                y = L.ternary_linear(x, p, s, n, **kw)
                d = L.ternary_linear(x, p, s, n, **kw, defer=True)
                assert isinstance(d, D.SplitKSums) and d.shape == y.shape
                ref, got = _quant(y, norm2, n), _quant(d, norm2, n)
                assert torch.equal(d.out, y), (cfg, per_row, act)
                assert all(torch.equal(u, v) for u, v in zip(got, ref)) and _sums_zero(), cfg
                if i or not per_row:
                    continue
                d = L.ternary_linear(x, p, s, n, **kw, defer=True)
                ref, got = _quant(y, None, n), _quant(d, None, n)
                assert torch.equal(d.out, y) and all(torch.equal(u, v) for u, v in zip(got, ref))
                assert torch.equal(L.ternary_linear(x, p, s, n, **kw, defer=True).finish(), y)
                assert _sums_zero()
                for path2 in ("rowq", "row"):  # over the finishing launch's codes; over the finished rows
                    want = L.ternary_linear(y, p2, s2, 24, norm_weight=norm2, path=path2)
                    d = L.ternary_linear(x, p, s, n, **kw, defer=True)
                    assert torch.equal(L.ternary_linear(d, p2, s2, 24, norm_weight=norm2, path=path2), want)
                    assert torch.equal(d.out, y) and _sums_zero()
            finally:
                T._choice.pop(key)


def test_defer_without_splits_returns_rows():
    """A path with no split-K reduction to defer (the row GEMV; split-K of one split) returns finished rows."""
    m, n, k = 2, 40, 64
    p, x, norm, _, _, g = _setup(m, n, k, False, seed=3, dev=DEV, dtype=torch.float32)
    s = (0.01 + torch.rand(1, generator=g)).to(DEV)
    y = L.ternary_linear(x, p, s, n, norm_weight=norm, path="rowq")
    got = L.ternary_linear(x, p, s, n, norm_weight=norm, path="rowq", defer=True)
    assert isinstance(got, torch.Tensor) and torch.equal(got, y)
    cfg = dict(T._splitk_candidates(m, n, p.shape[1], False)[0], SPLIT=1, CPS=p.shape[1] // 32)
    key = _force(cfg, "splitk", n, k, m, (False, True, False, False))
    try:
        got = L.ternary_linear(x, p, s, n, norm_weight=norm, path="splitk", defer=True)
        assert isinstance(got, torch.Tensor)
        assert torch.equal(got, L.ternary_linear(x, p, s, n, norm_weight=norm, path="splitk"))
    finally:
        T._choice.pop(key)


def test_engine_deferred_step_equals_finished():
    """The engine's decode step with its split-K projections deferred gives the same logits and KV cache bit for
    bit (batch 4: after the unfused q|k|v; 8: after the fused one). A model just wide
    enough (K of 256 and 384) that the interpreter's split-K tiles split. Not deferred: a plan that defers at no
    batch (`DecodePlan.defer_max_b` 0)."""
    import dataclasses

    from oracle import tiny_config_kwargs

    import bitnetlm.runtime.cuda.engine as E
    from bitnetlm.models import ModelConfig, build_model
    from bitnetlm.quant import to_inference_

    kw = dict(tiny_config_kwargs("packed-autobitlinear"), hidden_size=256, intermediate_size=384, head_dim=64)
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch="bitnet", rope_theta=10000.0, **kw), "train")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        model.embed_tokens.weight.normal_()
        for name, prm in model.named_parameters():
            if "norm" in name:
                prm.copy_(0.5 + torch.rand(prm.shape, generator=g))
    model = to_inference_(model).eval()
    D._sums.clear()
    ecfg = E.EngineConfig(max_batch=8, max_seq_len=16, dtype=torch.float32)
    eng = E.CudaEngine.from_model(model, ecfg, device=DEV)
    for b in (4, 8):
        tok = torch.randint(0, 512, (b, 5), generator=torch.Generator().manual_seed(b)).to(DEV)
        nxt = torch.randint(0, 512, (b, 1), generator=torch.Generator().manual_seed(9)).to(DEV)
        pos = torch.full((b,), 5, dtype=torch.int32, device=DEV)
        with torch.no_grad():
            eng.forward(tok, torch.zeros(b, dtype=torch.int32, device=DEV))
            eng.plan = dataclasses.replace(eng.plan, defer_max_b=0)
            ref = eng.forward(nxt, pos)
            kref = [k.clone() for k in eng.k_cache]
            eng.plan = dataclasses.replace(eng.plan, defer_max_b=64)
            got = eng.forward(nxt, pos)
        assert torch.equal(got, ref), b
        assert all(torch.equal(k, r) for k, r in zip(eng.k_cache, kref))
    assert D._sums and _sums_zero()  # something was deferred, and every consumer zeroed its sums


@pytest.mark.gpu
@pytest.mark.parametrize("m", [4, 8, 16, 64])
@pytest.mark.parametrize("proj", ["o", "gate_up", "down"])
def test_gpu_deferred_2b4t_exact(m, proj):
    """The 2B4T projections at decode batch sizes, every split-K candidate of more than one split, deferred and
    finished by the next quantization launch: the finished rows and codes bit for bit."""
    n, k, gated = {"o": (2560, 2560, False), "gate_up": (6912, 2560, True), "down": (2560, 6912, False)}[proj]
    p, x, norm, norm2, res, g = _setup(m, n, k, gated, seed=m, dev="cuda", dtype=torch.bfloat16)
    s = (0.01 + torch.rand(2 * n if gated else n, generator=g)).cuda()
    r = None if gated else res
    kw = dict(norm_weight=norm, residual=r, gated=gated)
    tried = 0
    for cfg in T._splitk_candidates(m, n, p.shape[1], gated):
        if cfg["SPLIT"] == 1:
            continue
        path = "splitk_pair" if cfg.get("PAIR") else ("splitk_t" if cfg["SWAP"] else "splitk")
        key = _force(cfg, path, n, k, m, (gated, True, r is not None, True))
        try:
            y = L.ternary_linear(x, p, s, n, **kw, path=path)
            d = L.ternary_linear(x, p, s, n, **kw, path=path, defer=True)
            ref, got = _quant(y, norm2, n), _quant(d, norm2, n)
            assert torch.equal(d.out, y) and all(torch.equal(u, v) for u, v in zip(got, ref)), cfg
            assert _sums_zero()
            tried += 1
        finally:
            T._choice.pop(key)
    assert tried


@pytest.mark.gpu
@pytest.mark.parametrize("b", [2, 4, 8, 16, 64])
def test_gpu_engine_deferred_step_exact(b):
    """The 2B4T-shaped engine's captured greedy decode step (int8 head, float8 cache) with and without the
    deferred split-K projections: the same tokens and KV cache bit for bit over 8 steps."""
    import dataclasses

    import bitnetlm.runtime.cuda.engine as E
    from bitnetlm.models import ModelConfig

    eng = E.CudaEngine.random(
        ModelConfig(), E.EngineConfig(max_batch=b, max_seq_len=600, head="int8", kv_dtype=torch.float8_e4m3fn)
    )
    outs = []
    plan = eng.plan
    for on in (False, True):
        eng.plan = dataclasses.replace(plan, defer_max_b=64 if on else 0)
        eng._graphs.clear()
        st = eng.decode_state(b, max_keys=1024)
        for c in eng.k_cache + eng.v_cache:
            c.view(torch.uint8).zero_()
        st.pos.fill_(500)
        st.step.fill_(1)
        st.tok.copy_(torch.arange(b, device="cuda").view_as(st.tok) * 7 + 3)
        toks = []
        for _ in range(8):
            st.graph.replay()
            toks.append(st.tok.clone())
        outs.append((torch.stack(toks), [c.view(torch.uint8).clone() for c in eng.k_cache + eng.v_cache]))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(u, v) for u, v in zip(outs[0][1], outs[1][1]))
