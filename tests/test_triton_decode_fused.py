"""The fused q|k|v + RoPE decode kernel (decode.py) equals the unfused launches bit for bit.

Without a GPU they run under Triton's interpreter on small shapes; the `gpu` tests use the 2B4T shapes.
"""

from __future__ import annotations

import pytest
import torch
from triton_interp import DEV, triton_modules

L, R, F, layout, P = triton_modules("launch", "rope", "decode", "layout", "plan")


def _rand(shape, seed, dev):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dev)


def _rope_tables(hd, s_len, dev):
    """HF's RoPE cos / sin tables [s_len, hd / 2] (theta 10,000), as the engine holds them."""
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    fr = torch.arange(s_len, dtype=torch.float32)[:, None] * inv[None, :]
    return fr.cos().contiguous().to(dev), fr.sin().contiguous().to(dev)


def _tern(n, k, seed, dev):
    g = torch.Generator().manual_seed(seed)
    return layout.pack_triton(torch.randint(-1, 2, (n, k), generator=g, dtype=torch.int8)).to(dev)


def _check_qkv_rope(m, hidden, nh, nkv, hd, dtype, dev, seed=0, per_row=True, plan=None):
    """quantize_into + qkv_rope (the row GEMV up to 2 rows, the split-K GEMM from 3) vs ternary_linear(rowq) +
    rope_cache, and qkv_rope quantizing x itself vs ternary_linear(row) + rope_cache: q and both caches bit for
    bit. plan: the `DecodePlan` of every launch (None: the default)."""
    eps = 1e-5
    # quarters in [-8, 8]: every sum of squares is exact in float32, so the programs that quantize the rows
    # themselves (each launch with its own tuned warps, hence its own summation order) agree bit for bit
    x = (_rand((m, hidden), seed, dev) * 12).round().clamp(-32, 32).div(4).to(dtype)
    nin = 1 + 0.1 * _rand((hidden,), seed + 1, dev)
    nqkv = (nh + 2 * nkv) * hd
    w = _tern(nqkv, hidden, seed + 3, dev)
    s = 0.01 + _rand((nqkv,), seed + 4, dev).abs() if per_row else torch.full((1,), 0.03, device=dev)
    xq = F.QuantBuf(m, hidden, dev)
    F.quantize_into(x, nin, xq, eps)
    q_ref, a_ref, rs_ref = L.quantize_rows(x, nin, eps)
    assert torch.equal(xq.q[:, :hidden], q_ref) and torch.equal(xq.a, a_ref) and torch.equal(xq.rs, rs_ref)
    s_len = 24
    pos = torch.tensor([5, 17, 0, 11, 22][:m], dtype=torch.int32, device=dev)
    pos = torch.cat([pos, torch.arange(m - pos.numel(), device=dev, dtype=torch.int32) % 20])
    cos, sin = _rope_tables(hd, s_len, dev)
    kc = _rand((m, nkv, s_len, hd), seed + 5, dev).to(dtype)
    vc = _rand((m, nkv, s_len, hd), seed + 6, dev).to(dtype)
    kr, vr = kc.clone(), vc.clone()
    q = torch.zeros((m, 1, nh, hd), dtype=dtype, device=dev)
    F.qkv_rope(xq, m, w, s, q, cos, sin, pos, kc, vc, nh, nkv, plan=plan)
    qkv = L.ternary_linear(x, w, s, nqkv, norm_weight=nin, eps=eps, path="rowq", plan=plan)
    qr = torch.zeros_like(q)
    R.rope_cache(qkv, cos, sin, pos, qr, kr, vr, nh, nkv, 1)
    assert torch.equal(q, qr) and torch.equal(kc, kr) and torch.equal(vc, vr)
    # the quantizing variant (every program normalizes and quantizes x itself) vs the row GEMV that does the same
    kc2, vc2 = kc.clone(), vc.clone()
    kr2, vr2 = kc.clone(), vc.clone()
    pos2 = pos + 1  # fresh cache slots
    F.qkv_rope(x, m, w, s, q, cos, sin, pos2, kc2, vc2, nh, nkv, nin, eps, plan=plan)
    qkv = L.ternary_linear(x, w, s, nqkv, norm_weight=nin, eps=eps, path="row", plan=plan)
    R.rope_cache(qkv, cos, sin, pos2, qr, kr2, vr2, nh, nkv, 1)
    assert torch.equal(q, qr) and torch.equal(kc2, kr2) and torch.equal(vc2, vr2)
    assert not torch.equal(kc2, kc)  # the slots were written


@pytest.mark.parametrize("early", [4096, 0])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_qkv_rope_exact(m, early):
    # early: the quantizing kernels load their norm weights before (or after) the PDL wait (early_norm_max_k)
    plan = P.DecodePlan(early_norm_max_k=early)
    # K not a multiple of 16 (padding), GQA group of 2, head_dim 16; per-row and single scales
    _check_qkv_rope(m, hidden=72, nh=4, nkv=2, hd=16, dtype=torch.float32, dev=DEV, seed=m, plan=plan)
    _check_qkv_rope(
        m, hidden=64, nh=2, nkv=1, hd=32, dtype=torch.float32, dev=DEV, seed=m + 7, per_row=False, plan=plan
    )
    if m > 2:  # the split-K GEMM's reduction: K = 520 is 5 chunks of 32 bytes, in 3 splits
        _check_qkv_rope(
            m, hidden=520, nh=4, nkv=2, hd=16, dtype=torch.float32, dev=DEV, seed=m + 9, plan=plan
        )


def test_engine_fused_step_equals_unfused(tiny_model):
    """The engine's fused decode step gives the unfused step's logits and cache (the unfused q|k|v may take the
    row GEMV that quantizes inside each program, whose sum order differs: close, not bit-identical). Unfused: a
    plan that fuses at no batch (`DecodePlan.fused_max_b` 0)."""
    import copy
    import dataclasses

    from bitnetlm.runtime.cuda.engine import CudaEngine, EngineConfig

    model = copy.deepcopy(tiny_model)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # norms other than ones: a norm applied in the wrong place shows
        for name, prm in model.named_parameters():
            if "norm" in name:
                prm.copy_(0.5 + torch.rand(prm.shape, generator=g))
    for b in (1, 2, 8):  # the row GEMV (quantizing the rows itself, or over pre-quantized rows), the GEMM
        eng = CudaEngine.from_model(
            model, EngineConfig(max_batch=8, max_seq_len=16, dtype=torch.float32), device=DEV
        )
        tok = torch.randint(0, 512, (b, 5), generator=torch.Generator().manual_seed(b)).to(DEV)
        nxt = torch.randint(0, 512, (b, 1), generator=torch.Generator().manual_seed(9)).to(DEV)
        with torch.no_grad():
            eng.forward(tok, torch.zeros(b, dtype=torch.int32, device=DEV))
            pos = torch.full((b,), 5, dtype=torch.int32, device=DEV)
            fused = eng.plan
            eng.plan = dataclasses.replace(fused, fused_max_b=0)
            ref = eng.forward(nxt, pos)
            kref = [k.clone() for k in eng.k_cache]
            eng.plan = fused
            got = eng.forward(nxt, pos)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        for k, r in zip(eng.k_cache, kref):
            torch.testing.assert_close(k, r, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 8, 64])
def test_gpu_qkv_rope_2b4t_exact(m):
    for dtype in (torch.bfloat16, torch.float32):
        _check_qkv_rope(m, hidden=2560, nh=20, nkv=5, hd=128, dtype=dtype, dev="cuda", seed=m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_cache_copy_to_writes_both_rows(dtype):
    """rope_cache with copy_to (the captured prefill's target row, read on the device): the keys and values land
    in the launch's row and in that one, bit for bit as two plain launches write them; q and the other rows are
    untouched by the second store."""
    nh, nkv, hd, t, s_len, rows = 4, 2, 16, 7, 24, 4
    qkv = _rand((t, (nh + 2 * nkv) * hd), 1, DEV).to(dtype)
    cos, sin = _rope_tables(hd, s_len, DEV)
    pos = torch.zeros(1, dtype=torch.int32, device=DEV)
    kc = _rand((rows, nkv, s_len, hd), 2, DEV).to(dtype)
    vc = _rand((rows, nkv, s_len, hd), 3, DEV).to(dtype)
    kr, vr = kc.clone(), vc.clone()
    q = torch.zeros((1, t, nh, hd), dtype=dtype, device=DEV)
    qr = torch.zeros_like(q)
    target = torch.tensor([1], dtype=torch.long, device=DEV)
    R.rope_cache(qkv, cos, sin, pos, q, kc[3:4], vc[3:4], nh, nkv, t, copy_to=target, row0=3)
    for r in (3, 1):
        R.rope_cache(qkv, cos, sin, pos, qr, kr[r : r + 1], vr[r : r + 1], nh, nkv, t)
    assert torch.equal(q, qr) and torch.equal(kc, kr) and torch.equal(vc, vr)
    assert not torch.equal(kc[1], _rand((rows, nkv, s_len, hd), 2, DEV).to(dtype)[1])  # row 1 was written
    with pytest.raises(ValueError, match="copy_to needs one cache row, found 2"):
        R.rope_cache(qkv, cos, sin, pos, q, kc[2:4], vc[2:4], nh, nkv, t, copy_to=target, row0=2)


@pytest.mark.parametrize(
    "q_dtype,kv_dtype", [(torch.bfloat16, torch.float8_e4m3fn), (torch.float32, torch.bfloat16)]
)
def test_rope_cache_kv16_holds_the_cache_values_upcast(q_dtype, kv_dtype):
    """rope_cache with kv16 (a prefill's attention operands over a cache of another dtype): slot t of k16/v16
    holds the cache's stored k/v of token t in q's dtype, bit for bit, for every row; the slots past T keep what
    they held, and q and the caches are what a launch without kv16 writes."""
    nh, nkv, hd, b, t, tp, s_len = 4, 2, 16, 2, 5, 8, 24
    qkv = _rand((b * t, (nh + 2 * nkv) * hd), 4, DEV).to(q_dtype)
    cos, sin = _rope_tables(hd, s_len, DEV)
    pos = torch.zeros(b, dtype=torch.int32, device=DEV)
    kc, vc = (torch.zeros((b, nkv, s_len, hd), device=DEV).to(kv_dtype) for _ in range(2))
    kr, vr = kc.clone(), vc.clone()
    q, qr = (torch.zeros((b, t, nh, hd), dtype=q_dtype, device=DEV) for _ in range(2))
    k16, v16 = (torch.full((b, nkv, tp, hd), 7.0, dtype=q_dtype, device=DEV) for _ in range(2))
    R.rope_cache(qkv, cos, sin, pos, q, kc, vc, nh, nkv, t, kv16=(k16, v16))
    R.rope_cache(qkv, cos, sin, pos, qr, kr, vr, nh, nkv, t)
    assert torch.equal(q, qr) and torch.equal(kc.float(), kr.float()) and torch.equal(vc.float(), vr.float())
    assert kc[:, :, :t].float().abs().sum() > 0  # the launch wrote the cache
    assert torch.equal(k16[:, :, :t], kc[:, :, :t].to(q_dtype)) and torch.equal(
        v16[:, :, :t], vc[:, :, :t].to(q_dtype)
    )
    assert bool((k16[:, :, t:] == 7).all()) and bool((v16[:, :, t:] == 7).all())
    with pytest.raises(ValueError, match=r"k16 must be contiguous .* found .*\(not contiguous\)"):
        wide = torch.zeros((b, nkv, tp, 2 * hd), dtype=q_dtype, device=DEV)[..., :hd]
        R.rope_cache(qkv, cos, sin, pos, q, kc, vc, nh, nkv, t, kv16=(wide, v16))
    with pytest.raises(ValueError, match=r"v16 must be contiguous"):
        R.rope_cache(qkv, cos, sin, pos, q, kc, vc, nh, nkv, t, kv16=(k16, v16[:, :, :3].contiguous()))
