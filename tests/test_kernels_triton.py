"""Triton kernels vs the pure-torch reference: integer product exact, float result bit-identical.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, see triton_interp.py) on small
ragged shapes; the `gpu` tests run the compiled kernels on the 2B4T shapes.
"""

from __future__ import annotations

import pytest
import torch
from triton_interp import DEV, triton_modules

from bitnetlm.quant.ternary import int_matmul, int_matmul_f32, quantize_activations

L, H, T, layout, P = triton_modules("launch", "head", "tune", "layout", "plan")


def _fused_reference(x, t, scale, norm=None, residual=None, gated=False, act="relu2", eps=1e-5):
    """Reference for the fused launcher: RMSNorm, per-token quant, exact product, scale, act, residual."""
    xf = x.float()
    if norm is not None:
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        xf = (xf * rstd) * norm.float()
    xq, a = quantize_activations(xf)
    y = int_matmul_f32(xq, t) * (scale.float().reshape(1, -1) / a)
    if gated:
        n = t.shape[0] // 2
        g, u = y[:, :n], y[:, n:]
        y = (torch.relu(g) ** 2 if act == "relu2" else torch.nn.functional.silu(g)) * u
    if residual is not None:
        y = y + residual.float()
    return y


def _case(m, n, k, seed, dev=DEV):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(-1, 2, (n, k), generator=g, dtype=torch.int8)
    x = torch.randn(m, k, generator=g) * (1 + 3 * torch.rand(m, 1, generator=g))
    s = 0.01 + torch.rand(1, generator=g)
    return t.to(dev), x.to(dev), s.to(dev)


def test_layout_roundtrip_and_example():
    g = torch.Generator().manual_seed(0)
    for n, k in [(1, 1), (5, 17), (8, 64), (3, 100)]:
        t = torch.randint(-1, 2, (n, k), generator=g, dtype=torch.int8)
        p = layout.pack_triton(t)
        assert p.shape == (n, layout.packed_row_bytes(k)) and p.shape[1] % 4 == 0
        assert torch.equal(layout.unpack_triton(p, (n, k)), t)
    # k = 0..15 -> slabs of width Kp = 4: byte b holds k = b, b+4, b+8, b+12 (codes t+1, low bits first)
    t = torch.zeros(1, 16, dtype=torch.int8)
    t[0, 0], t[0, 4], t[0, 8], t[0, 12] = 1, -1, 1, 0
    assert layout.pack_triton(t)[0, 0].item() == 2 | (0 << 2) | (2 << 4) | (1 << 6)
    with pytest.raises(ValueError, match="expected uint8"):
        layout.unpack_triton(p, (n + 1, k))


# every path (fused dp4a GEMV, row GEMV fused / pre-quantized, split-K tensor-core GEMM, tiled GEMM) on ragged
# N and K (K not a multiple of 16 exercises the padding; M > 16 the BM=64 tiles)
@pytest.mark.parametrize("path", ["gemv", "gemv8", "row", "rowq", "splitk", "splitk_t", "gemm", "gemm_t"])
@pytest.mark.parametrize("m,n,k", [(1, 70, 200), (3, 40, 64), (17, 33, 130)])
def test_ternary_linear_exact(m, n, k, path):
    t, x, s = _case(m, n, k, seed=m * 1000 + n)
    p = layout.pack_triton(t)
    y = L.ternary_linear(x, p, s, n, path=path)
    xq, a = quantize_activations(x)
    ref = int_matmul_f32(xq, t) * (s / a)
    assert torch.equal(y, ref)  # bit-identical float result
    # the integer part: with x already integer and max |x| = 127 per row, a = 1 and s = 1 give X @ T^T itself
    xi = torch.randint(-127, 128, (m, k), device=x.device).float()
    xi[:, 0] = 127
    yi = L.ternary_linear(xi, p, torch.ones(1, device=x.device), n, path=path)
    assert torch.equal(yi.to(torch.int32), int_matmul(xi.to(torch.int8).cpu(), t.cpu()).to(x.device))
    # split-K leaves its tile counters zeroed for the next call (CUDA-graph replays rely on it)
    assert all(int(c.abs().sum()) == 0 for _, c in L._workspaces.values())


def test_default_dispatch_exact():
    for m in (2, 40, 100):  # (100: the tiled GEMM's and the swapped split-K's tiles both candidates)
        t, x, s = _case(m, 24, 100, seed=m)
        xq, a = quantize_activations(x)
        assert torch.equal(L.ternary_linear(x, layout.pack_triton(t), s, 24), int_matmul_f32(xq, t) * (s / a))


def test_row_gemv_norm_weights_before_the_wait_change_nothing():
    """The quantizing row GEMV loads its norm weights before its PDL wait (`DecodePlan.early_norm_max_k`) or
    after it, with bit-identical outputs: plain with a residual, and gated; one row and two."""
    n, k = 24, 200  # K = 200: the last word of each slab part padding

    def run(early, m):
        plan = P.DecodePlan(early_norm_max_k=early)
        t, x, _ = _case(m, 2 * n, k, seed=40 + m)
        g = torch.Generator().manual_seed(m)
        norm = (1 + 0.1 * torch.randn(k, generator=g)).to(x.device)
        srow = (0.01 + torch.rand(2 * n, generator=g)).to(x.device)
        res = torch.randn(m, n, generator=g).to(x.device)
        p, p1 = layout.pack_triton(t), layout.pack_triton(t[:n])
        return (
            L.ternary_linear(x, p1, srow[:n], n, norm_weight=norm, residual=res, path="row", plan=plan),
            L.ternary_linear(x, p, srow, n, norm_weight=norm, gated=True, path="row", plan=plan),
        )

    for m in (1, 2):
        for a, b in zip(run(4096, m), run(0, m)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("k", [130, 640])
def test_rowq_in_two_parts_exact(k):
    """The pre-quantized row GEMV over a row of 9 (K = 130) or 40 (K = 640, as 2560 is 160) words in two
    power-of-two parts (`launch._row_parts`: 8 + 1, 32 + 8) equals the reference and the one-part kernel (the
    quantizing row GEMV, whose rows are one part) bit for bit: plain with a residual and per-row scales, and
    gated."""
    n = 24
    t, x, _ = _case(2, 2 * n, k, seed=k)
    g = torch.Generator().manual_seed(k)
    srow = (0.01 + torch.rand(2 * n, generator=g)).to(x.device)
    res = torch.randn(2, n, generator=g).to(x.device)
    p, p1 = layout.pack_triton(t), layout.pack_triton(t[:n])

    def run(path):
        return (
            L.ternary_linear(x, p1, srow[:n], n, residual=res, path=path),
            L.ternary_linear(x, p, srow, n, gated=True, path=path),
        )

    assert L._row_parts(layout.packed_row_bytes(k) // 4)[1] > 0  # the split runs
    xq, a = quantize_activations(x)
    assert torch.equal(run("rowq")[0], int_matmul_f32(xq, t[:n]) * (srow[:n] / a) + res)
    for got, ref in zip(run("rowq"), run("row")):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("n,early", [(40, 4096), (37, 0)])
def test_row_tiles_in_two_rows_parts_exact(n, early):
    """The quantizing row GEMV with a program's rows as two parts (`launch._row_tiles`: 8 + 2 rows where 16-row
    tiles would leave SMs idle, here 4 "SMs") equals the one-part kernel bit for bit and the reference: with a
    norm, per-row scales and a residual (norm weights before the wait and after it), one row and two; n = 37
    ends in a ragged program."""
    k = 200
    t, x, _ = _case(2, n, k, seed=n)
    g = torch.Generator().manual_seed(n)
    norm = (1 + 0.1 * torch.randn(k, generator=g)).to(x.device)
    srow = (0.01 + torch.rand(n, generator=g)).to(x.device)
    res = torch.randn(2, n, generator=g).to(x.device)
    p = layout.pack_triton(t)
    # planned for 4 SMs, where 16-row tiles leave SMs idle; for 1, where they do not (one part); every width
    # (down's, 6912, is past the default row_tiles_min_k)
    assert L._row_tiles(n, 16, 4) == (8, 2) and L._row_tiles(n, 16, 1) == (16, 0)  # the split runs, or not

    def run(tiles, m):
        plan = P.DecodePlan(sms=4 if tiles else 1, row_tiles_min_k=0, early_norm_max_k=early)
        return L.ternary_linear(x[:m], p, srow, n, norm_weight=norm, residual=res[:m], path="row", plan=plan)

    for m in (1, 2):
        got = run(True, m)
        assert torch.equal(got, run(False, m))
        ref = _fused_reference(x[:m], t, srow, norm, res[:m])
        torch.testing.assert_close(got.float(), ref, rtol=1e-5, atol=1e-4)


def test_quantize_rows_exact():
    _, x, _ = _case(5, 1, 70, seed=3)
    x[2] = 0  # all-zero row: the 1e-5 clamp
    q, a, rs = L.quantize_rows(x)
    xq, ar = quantize_activations(x)
    assert torch.equal(q, xq) and torch.equal(a, ar[:, 0]) and torch.equal(rs, xq.int().sum(1))


@pytest.mark.parametrize("m,path", [(2, None), (2, "rowq"), (20, None)])
def test_fused_variants(m, path):
    """norm + per-row scale (q|k|v), gated relu2 / silu (gate|up), residual: against the fused reference
    (M = 2 dispatches to the fused row GEMV, M = 20 to split-K; rowq = the row GEMV on pre-quantized rows)."""
    n, k = 24, 80
    t, x, _ = _case(m, 2 * n, k, seed=m)
    g = torch.Generator().manual_seed(7)
    norm = (1 + 0.1 * torch.randn(k, generator=g)).to(x.device)
    srow = (0.01 + torch.rand(2 * n, generator=g)).to(x.device)
    res = torch.randn(m, n, generator=g).to(x.device)
    p = layout.pack_triton(t)
    y = L.ternary_linear(x, p, srow, 2 * n, norm_weight=norm, path=path)
    torch.testing.assert_close(y, _fused_reference(x, t, srow, norm), rtol=2e-2, atol=2e-2)
    for act in ("relu2", "silu"):
        y = L.ternary_linear(x, p, srow, n, norm_weight=norm, gated=True, act=act, path=path)
        torch.testing.assert_close(
            y, _fused_reference(x, t, srow, norm, gated=True, act=act), rtol=3e-2, atol=3e-2
        )
    tn = t[:n]
    y = L.ternary_linear(x, layout.pack_triton(tn), srow[:1], n, residual=res, path=path)
    xq, a = quantize_activations(x)
    assert torch.equal(y, int_matmul_f32(xq, tn) * (srow[:1] / a) + res)


@pytest.mark.parametrize(
    "pair_path,ref_path,ms", [("gemm_pair", "gemm", (40, 70)), ("splitk_pair", "splitk", (3, 20))]
)
def test_gated_pair_equals_unpaired(pair_path, ref_path, ms):
    """The paired gated GEMMs (gate and up rows in one tile; tiled and split-K) give the unpaired GEMM's result
    bit for bit."""
    n, k = 40, 130
    for m in ms:
        t, x, _ = _case(m, 2 * n, k, seed=m + 5)
        g = torch.Generator().manual_seed(3)
        norm = (1 + 0.1 * torch.randn(k, generator=g)).to(x.device)
        srow = (0.01 + torch.rand(2 * n, generator=g)).to(x.device)
        p = layout.pack_triton(t)
        for act in ("relu2", "silu"):
            y = L.ternary_linear(x, p, srow, n, norm_weight=norm, gated=True, act=act, path=pair_path)
            assert torch.equal(
                y, L.ternary_linear(x, p, srow, n, norm_weight=norm, gated=True, act=act, path=ref_path)
            )
            torch.testing.assert_close(
                y, _fused_reference(x, t, srow, norm, gated=True, act=act), rtol=3e-2, atol=3e-2
            )
    assert all(int(c.abs().sum()) == 0 for _, c in L._workspaces.values())


def test_bad_packed_shape_is_a_clear_error():
    t, x, s = _case(1, 8, 32, seed=1)
    with pytest.raises(ValueError, match="expected packed triton-2bit-v1 weights"):
        L.ternary_linear(x, layout.pack_triton(t)[:, :4].contiguous(), s, 8)


def test_w8_linear():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 64, generator=g).to(DEV)
    w = torch.randint(-127, 128, (40, 64), generator=g, dtype=torch.int8).to(DEV)
    s = torch.rand(40, generator=g).to(DEV)
    y = H.w8_linear(x, w, s)
    ref = (x.bfloat16().float() @ w.float().T) * s
    # the interpreter truncates f32 -> bf16 where the GPU rounds: compare loosely, exactness is the GPU's test
    torch.testing.assert_close(y, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize16_and_w8a16_linear(dtype):
    """The int8 head over int16 activations. Without the norm the codes and scales equal torch's bit for bit
    (a = 32639 / max|x| as reciprocal then product, round half to even) and both halves lie in [-127, 127]; with
    it the codes stay within half a code of the rounded RMSNorm (its sum order differs from torch's). The int32
    sums are exact (only the float epilogue rounds) and the logits are within the codes' rounding of the float
    product."""
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(5, 96, generator=g) * 3).to(dtype).to(DEV)
    x[1, 7] = 40.0  # an outlier sets its row's scale
    nw = (torch.rand(96, generator=g) + 0.5).to(dtype).to(DEV)
    w = torch.randint(-127, 128, (40, 96), generator=g, dtype=torch.int8).to(DEV)
    s = torch.rand(40, generator=g).to(DEV)
    hi, lo, a = H.quantize16(x, None)
    xf = x.float()
    a_ref = xf.abs().amax(-1).reciprocal() * 32639.0
    assert torch.equal(a, a_ref)
    assert torch.equal(hi.long() * 256 + lo.long(), torch.round(xf * a_ref[:, None]).long())
    assert hi.abs().max() <= 127 and lo.abs().max() <= 127
    hi, lo, a = H.quantize16(x, nw, 1e-5)
    q = hi.long() * 256 + lo.long()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
    y_ref = ((xf * rstd) * nw.float()).to(dtype).float()
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-22  # the rounded norm may land one step apart
    err = (q.double() / a.double()[:, None] - y_ref.double()).abs()
    assert bool((err <= 0.5 / a.double()[:, None] + ulp * y_ref.double().abs() + 1e-30).all())
    y = H.w8a16_linear(x, nw, 1e-5, w, s)
    exact = ((q @ w.long().T).double() / a.double()[:, None]) * s.double()  # int64 sums
    torch.testing.assert_close(y.double(), exact, rtol=1e-6, atol=1e-6 * float(exact.abs().max()))
    ws = w.double() * s.double()[:, None]  # [N, K]
    ref = y_ref.double() @ ws.T
    # half a code a value, plus the rounded norm's step, times each weight; plus the epilogue's rounding
    bound = (0.5 / a.double()[:, None] + ulp * y_ref.double().abs()) @ ws.abs().T
    assert bool(((y.double() - ref).abs() <= bound + 1e-5 * float(ref.abs().max())).all())


def test_backend_and_custom_op_trace():
    from bitnetlm.kernels.triton import BACKEND, ops

    assert BACKEND.name == "triton" and BACKEND.layout.value == "triton-2bit-v1"
    assert BACKEND.is_available(DEV)
    t, x, s = _case(2, 16, 32, seed=9)
    p = BACKEND.pack(t)
    assert torch.equal(BACKEND.unpack(p, (16, 32)), t)
    xq, a = quantize_activations(x)
    assert torch.equal(BACKEND.linear(x, p, s, 16), int_matmul_f32(xq, t) * (s / a))

    def f(x):
        return ops.ternary_linear(x * 2, p, s, 16) + 1

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)  # traces through the fake impl
    assert torch.equal(compiled(x), f(x))


@pytest.mark.parametrize("m, k", [(1, 40), (3, 257)])
def test_rmsnorm_and_gated_act_equal_torch(m, k):
    """kernels/triton/norm.py (the dense engine's norms and MLP middle, the bf16 head's input) against PyTorch's
    ops, on ragged widths: RMSNorm in float32 and in bf16 (one rounding at the store), and act(gate) * up for
    both activations, over rows wider than one 1024-wide block."""
    (N,) = triton_modules("norm")
    g = torch.Generator().manual_seed(m * k)
    x, w = torch.randn(m, k, generator=g) * 3, torch.rand(k, generator=g) + 0.5
    for dt in (torch.float32, torch.bfloat16):
        xd, wd = x.to(dt), w.to(dt)
        ref = xd.float() * torch.rsqrt(xd.float().pow(2).mean(-1, keepdim=True) + 1e-5) * wd.float()
        got = N.rmsnorm(xd.to(DEV), wd.to(DEV), 1e-5).cpu()
        assert got.dtype == dt and got.shape == (m, k)
        torch.testing.assert_close(
            got.float(), ref.to(dt).float(), rtol=1e-5 if dt == torch.float32 else 8e-3, atol=1e-5
        )
    gu = torch.randn(2, m, 2 * (1024 + k), generator=g)
    n = gu.shape[-1] // 2
    for act, f in (("relu2", lambda v: torch.relu(v) ** 2), ("silu", torch.nn.functional.silu)):
        got = N.gated_act(gu.to(DEV), act).cpu()
        assert got.shape == (2, m, n)
        torch.testing.assert_close(got, f(gu[..., :n]) * gu[..., n:])


def test_engine_forward_matches_model(tiny_model):
    """The fused engine (prefill: GEMV path + SDPA, from 0 and continuing cached tokens; decode: attention
    kernel) vs the model's own forward."""
    from bitnetlm.runtime.cuda.engine import CudaEngine, EngineConfig

    eng = CudaEngine.from_model(
        tiny_model, EngineConfig(max_batch=2, max_seq_len=16, dtype=torch.float32), device=DEV
    )
    m = tiny_model.to(DEV)
    tok = torch.randint(0, 512, (2, 5), generator=torch.Generator().manual_seed(0)).to(DEV)
    with torch.no_grad():
        ref = m(tok)[:, -1]
        got = eng.forward(tok, torch.zeros(2, dtype=torch.int32, device=DEV))
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        nxt = ref.argmax(-1, keepdim=True)
        ref2 = m(torch.cat([tok, nxt], 1))[:, -1]
        got2 = eng.forward(nxt, torch.full((2,), 5, dtype=torch.int32, device=DEV))
        torch.testing.assert_close(got2, ref2, rtol=1e-4, atol=1e-4 * ref2.abs().max().item())
        # chunked prefill: the last 3 prompt tokens after the first 2 are cached (causal to the last key)
        eng.forward(tok[:, :2], torch.zeros(2, dtype=torch.int32, device=DEV))
        got3 = eng.forward(tok[:, 2:], torch.full((2,), 2, dtype=torch.int32, device=DEV), start=2)
        torch.testing.assert_close(got3, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    tiny_model.to("cpu")


def test_engine_prefill_over_a_float8_cache_matches_its_decode_steps(tiny_model):
    """A prefill from position 0 over a float8 cache attends over the K/V its RoPE launches hand it, upcast
    (rope_cache kv16): padded (5 tokens in 16 slots) and not (16), every position's logits are those of decode
    steps fed the same tokens one at a time, whose attention reads the cache itself. (The reference forward is
    the oracle on the GPU, test_kv_fp8.py: the interpreter rounds to float8 differently from torch.)"""
    from bitnetlm.runtime.cuda.engine import CudaEngine, EngineConfig

    ecfg = EngineConfig(max_batch=2, max_seq_len=16, dtype=torch.float32, kv_dtype=torch.float8_e4m3fn)
    pre, dec = (CudaEngine.from_model(tiny_model, ecfg, device=DEV) for _ in range(2))
    for t in (5, 16):
        tok = torch.randint(0, 512, (2, t), generator=torch.Generator().manual_seed(t)).to(DEV)
        with torch.no_grad():
            got = pre.forward(tok, torch.zeros(2, dtype=torch.int32, device=DEV), last_only=False)
            want = [
                dec.forward(tok[:, i : i + 1], torch.full((2,), i, dtype=torch.int32, device=DEV))
                for i in range(t)
            ]
        want = torch.stack(want, 1)  # [2, t, V]
        torch.testing.assert_close(got.view(2, t, -1), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        for a, b in zip(pre.k_cache + pre.v_cache, dec.k_cache + dec.v_cache):
            assert torch.equal(a[:2, :, :t].view(torch.uint8), b[:2, :, :t].view(torch.uint8))


# ---------------------------------------------------------------------------------------------------------
# GPU: compiled kernels on the BitNet b1.58 2B4T shapes
# ---------------------------------------------------------------------------------------------------------
SHAPES_2B4T = [(3840, 2560), (2560, 2560), (2560, 6912), (640, 2560)]  # q|k|v, o, down, k


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m,path",
    [
        (m, p)
        for m in (1, 5, 8, 16, 64, 128, 300)
        for p in ("gemv", "gemv8", "row", "rowq", "splitk", "splitk_t", "gemm", "gemm_t")
        if p not in ("gemv", "gemv8", "row", "rowq") or m <= 16
    ],
)
def test_gpu_2b4t_shapes_exact(m, path):
    for n, k in SHAPES_2B4T:
        t, x, s = _case(m, n, k, seed=n + k + m, dev="cuda")
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            y = L.ternary_linear(xd, layout.pack_triton(t), s, n, path=path)
            xq, a = quantize_activations(xd)
            acc = int_matmul(xq.cpu(), t.cpu()).cuda()  # int64 matmul runs on the CPU only
            assert torch.equal(y.float(), (acc.float() * (s / a)).to(dtype).float()), (m, n, k, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("gated", [True, False])
def test_gpu_every_splitk_candidate_exact(m, gated):
    """Every split-K candidate the tuner may pick (swapped, unswapped, gate|up paired, each batch tile BM)
    gives the tiled GEMM's result bit for bit: gate|up with norm and per-row scales, o_proj with a residual."""
    n = 6912 if gated else 2560
    rows = 2 * n if gated else n
    t, _, _ = _case(1, rows, 2560, seed=21 + m, dev="cuda")
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 2560, device="cuda", generator=g)
    norm = 1 + 0.1 * torch.randn(2560, device="cuda", generator=g)
    s = 0.05 * torch.rand(rows if gated else 1, device="cuda", generator=g)
    res = None if gated else torch.randn(m, n, device="cuda", generator=g).bfloat16()
    x = x if gated else x.bfloat16()
    p = layout.pack_triton(t)

    def run(path):
        return L.ternary_linear(x, p, s, n, norm_weight=norm, residual=res, gated=gated, path=path)

    ref = run("gemm")
    flags = (gated, True, res is not None, gated)  # as ternary_linear's tuning key
    for cfg in T._splitk_candidates(m, n, p.shape[1], gated):
        path = "splitk_pair" if cfg.get("PAIR") else ("splitk_t" if cfg["SWAP"] else "splitk")
        key = (path, n, 2560, T._next_pow2(m), *flags)
        T._choice[key] = cfg
        try:
            assert torch.equal(run(path), ref), cfg
        finally:
            T._choice.pop(key)
    assert all(int(c.abs().sum()) == 0 for _, c in L._workspaces.values())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
def test_gpu_row_tiles_exact(m):
    """Every quantizing row-GEMV candidate on o's and down's 2B4T shapes (norm, per-row scales, residual) gives
    the same bits with a program's rows in two parts (`launch._row_tiles`, 16 + 4 for BN 32 on a GPU of 132 SMs)
    as without, close to the float reference; the split runs for a 32-row tile (o's width too, past the default
    `DecodePlan.row_tiles_min_k`)."""
    # with the split for every width; without it for any (no width past the bound)
    plans = {True: P.DecodePlan(row_tiles_min_k=0), False: P.DecodePlan(row_tiles_min_k=1 << 30)}
    for n, k in ((2560, 2560), (2560, 6912)):
        t, x, _ = _case(m, n, k, seed=50 + m, dev="cuda")
        g = torch.Generator(device="cuda").manual_seed(m)
        norm = 1 + 0.1 * torch.randn(k, device="cuda", generator=g)
        s = 0.05 * torch.rand(n, device="cuda", generator=g)
        res = torch.randn(m, n, device="cuda", generator=g).bfloat16()
        x, p = x.bfloat16(), layout.pack_triton(t)
        key = ("row", n, k, m, False, True, True, True)  # as ternary_linear's tuning key
        assert L._row_tiles(n, 32, 132) == (16, 4)
        for cfg in T._row_candidates(p.shape[1] // 4, False, "row"):
            T._choice[key] = cfg
            try:
                out = []
                for tiles in (True, False):
                    kw = dict(norm_weight=norm, residual=res, path="row", plan=plans[tiles])
                    out.append(L.ternary_linear(x, p, s, n, **kw))
            finally:
                T._choice.pop(key)
            assert torch.equal(out[0], out[1]), (n, k, cfg)
            ref = _fused_reference(x, t, s, norm, res)
            torch.testing.assert_close(out[0].float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_gated_2b4t_and_int8_head():
    t, x, _ = _case(8, 2 * 6912, 2560, seed=11, dev="cuda")
    g = torch.Generator(device="cuda").manual_seed(11)
    srow = torch.rand(2 * 6912, device="cuda", generator=g) * 0.05
    norm = 1 + 0.1 * torch.randn(2560, device="cuda", generator=g)
    p = layout.pack_triton(t)
    for m in (1, 8, 64):
        xm = torch.randn(m, 2560, device="cuda", generator=g)
        ref = _fused_reference(xm, t, srow, norm, gated=True)
        # the reference's rsqrt and sum order may differ from the kernels' in the last bit and flip an int8 code
        # of a value at a rounding boundary (an error of up to ~1% of the largest output): exactness is checked
        # by test_gpu_every_splitk_candidate_exact and test_gpu_2b4t_shapes_exact
        atol = 2e-3 * float(ref.abs().max())
        paths = [None, "splitk", "splitk_t", "splitk_pair", "gemm", "gemm_t"]
        for path in paths + (["row", "rowq", "gemv"] if m <= 16 else []):
            y = L.ternary_linear(xm, p, srow, 6912, norm_weight=norm, gated=True, path=path)
            torch.testing.assert_close(
                y, ref, rtol=2e-3, atol=atol, msg=lambda e, m=m, path=path: f"{m} {path}: {e}"
            )
    xm = torch.randn(
        300, 2560, device="cuda", generator=g
    )  # prefill rows: the paired tile equals the unpaired split-K exactly
    y = L.ternary_linear(xm, p, srow, 6912, norm_weight=norm, gated=True, path="gemm_pair")
    assert torch.equal(y, L.ternary_linear(xm, p, srow, 6912, norm_weight=norm, gated=True, path="splitk"))
    ref = _fused_reference(xm, t, srow, norm, gated=True)
    torch.testing.assert_close(y, ref, rtol=2e-3, atol=2e-3 * float(ref.abs().max()))
    w = torch.randint(-127, 128, (1000, 2560), dtype=torch.int8, device="cuda")
    s = torch.rand(1000, device="cuda")
    # the tuned tile for float32 rows, then every tile the tuner may pick for bf16 rows (the engine's; float32
    # rows would overflow the largest tiles' shared memory)
    for m in (1, 8, 40, 64):
        xm = torch.randn(m, 2560, device="cuda")
        ref = (xm.bfloat16().float() @ w.float().T) * s
        for cfg in [None, *T._w8_candidates(m)]:
            xm = xm if cfg is None else xm.bfloat16()
            torch.testing.assert_close(
                H.w8_linear(xm, w, s, cfg=cfg),
                ref,
                rtol=1e-4,
                atol=1e-5 * ref.abs().max().item(),
                msg=str(cfg),
            )
            # the int16-activation head: int32 sums exact, only the float epilogue rounds
            nw = torch.ones(2560, device="cuda", dtype=xm.dtype)
            hi, lo, a = H.quantize16(xm, nw, 1e-5)
            q = hi.long() * 256 + lo.long()
            exact = ((q.double() @ w.double().T) / a.double()[:, None]) * s.double()
            logits = H.w8a16_linear(xm, nw, 1e-5, w, s, cfg=cfg)
            torch.testing.assert_close(
                logits.double(), exact, rtol=1e-6, atol=1e-6 * float(exact.abs().max()), msg=str(cfg)
            )
            if cfg is None:
                continue
            # the same tile reduced in place (the greedy decode step's head): each tile's max and first index
            maxima, index = H.w8a16_argmax(xm, nw, 1e-5, w, s, cfg=cfg)
            bn = cfg["BN"]
            for t in range(maxima.shape[1]):
                part = logits[:, t * bn : (t + 1) * bn]
                assert torch.equal(index[:, t].long(), part.argmax(-1) + t * bn), (cfg, t)
                assert torch.equal(maxima[:, t], part.amax(-1)), (cfg, t)


@pytest.mark.parametrize("keys", [0, 16, 1024])
@pytest.mark.parametrize("h,hkv", [(4, 2), (3, 3), (6, 2)])
def test_decode_attention_split_merge(h, hkv, keys):
    """Split-KV decode attention (the live context cut into spans, merged by the last program holding keys) vs
    softmax attention; GQA groups of 2, 1 (MHA) and 3 (not a power of two) query heads per KV head. Contexts of
    1 key, a few keys (one split busy), a span boundary and the whole cache (every split busy). keys: a
    short-context step's range (one split of one 16-key block here), which most rows outgrow; 1024 the
    default splits over small blocks (16 keys here, as the default's)."""
    from bitnetlm.kernels.triton.attention import attn_decode

    g = torch.Generator().manual_seed(3)
    b, s, d = 5, 64, 16
    q = torch.randn(b, h, d, generator=g).to(DEV)
    kc = torch.randn(b, hkv, s, d, generator=g).to(DEV)
    vc = torch.randn(b, hkv, s, d, generator=g).to(DEV)
    pos = torch.tensor([37, 4, 0, 47, 63], dtype=torch.int32, device=DEV)
    for _ in range(2):  # twice: the merge counters must be reset by the first call
        out = torch.full((b, h, d), float("nan"), device=DEV)
        attn_decode(q, kc, vc, pos, out, d**-0.5, keys)
        for i in range(b):
            n = int(pos[i]) + 1
            k = kc[i, :, :n].repeat_interleave(h // hkv, 0)  # [H, n, D]
            v = vc[i, :, :n].repeat_interleave(h // hkv, 0)
            w = torch.softmax((k @ q[i, :, :, None]).squeeze(-1) * d**-0.5, dim=-1)  # [H, n]
            torch.testing.assert_close(out[i], (w[:, None, :] @ v).squeeze(1), rtol=1e-5, atol=1e-5)


def _prefetch_case(b, h, hkv, s, d, kv, pf_programs, dev, keys=0):
    """The decode attention with and without its weight-prefetching programs: the same bits out, the weights
    untouched (the prefetch is a hint; those programs take no part in the splits' merge)."""
    from bitnetlm.kernels.triton.attention import attn_decode

    g = torch.Generator(device=dev).manual_seed(b + s)
    q = torch.randn(b, h, d, device=dev, generator=g).to(kv if kv == torch.float32 else torch.bfloat16)
    kc = torch.randn(b, hkv, s, d, device=dev, generator=g).to(kv)
    vc = torch.randn(b, hkv, s, d, device=dev, generator=g).to(kv)
    pos = torch.randint(0, s, (b,), device=dev, generator=g, dtype=torch.int32)
    pos[0] = s - 1
    w = torch.randint(-(2**31), 2**31 - 1, (777, 33), device=dev, generator=g, dtype=torch.int32)
    w2 = torch.randint(-(2**31), 2**31 - 1, (300, 5), device=dev, generator=g, dtype=torch.int32)
    w3 = torch.randint(0, 255, (1000,), device=dev, generator=g, dtype=torch.uint8)
    w0, w20, w30 = w.clone(), w2.clone(), w3.clone()
    outs = []
    # twice with one tensor (the merge counters still reset), once with two, once with three
    for n, pf in (
        (0, None),
        (pf_programs, w),
        (pf_programs, w),
        (pf_programs, (w, w2)),
        (pf_programs, (w, w2, w3)),
    ):
        out = torch.full((b, h, d), float("nan"), device=dev, dtype=q.dtype)
        attn_decode(q, kc, vc, pos, out, d**-0.5, keys, pf, n)
        outs.append(out)
    assert not outs[0].isnan().any()
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert torch.equal(w, w0) and torch.equal(w2, w20) and torch.equal(w3, w30)


@pytest.mark.parametrize("b,pf_programs", [(1, 6), (3, 7), (2, 1)])
def test_decode_attention_prefetch_programs_change_nothing(b, pf_programs):
    """Under the interpreter the prefetch is a no-op, but the extra programs' early exit and their share of the
    lines run: the splits' outputs are the same bits with them as without."""
    _prefetch_case(b, 6, 2, 200, 16, torch.float32, pf_programs, DEV)


def test_decode_attention_prefetch_takes_three_tensors_at_most():
    from bitnetlm.kernels.triton.attention import attn_decode

    q = torch.zeros(1, 2, 16, device=DEV)
    kc = torch.zeros(1, 1, 32, 16, device=DEV)
    w = torch.zeros(8, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="up to 3 tensors, got 4"):
        attn_decode(q, kc, kc, torch.zeros(1, dtype=torch.int32, device=DEV), q.clone(), 0.25, 0, (w,) * 4, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", [torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_decode_attention_prefetch_exact(kv):
    """At the 2B4T head shape, every batch the engine prefetches at (`DecodePlan.attn_pf_table`) and one past its
    programs' rounding: the attention's outputs with the L2 prefetch of a weight tensor equal those without."""
    for b, n, keys in (
        (1, 2048, 1024),
        (1, 2048, 0),
        (2, 2048, 1024),
        (4, 512, 0),
        (8, 2048, 0),
        (8, 2048, 256),
    ):
        _prefetch_case(b, 20, 5, 700, 128, kv, n, "cuda", keys)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", [torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_decode_attention_2b4t_bf16(kv):
    """The tensor-core attention path with bf16 queries at the 2B4T head shape, batch 1 and 64, against float64
    softmax over the cache's values: a bf16 cache, and a float8 one (float16 operands)."""
    from bitnetlm.kernels.triton.attention import attn_decode

    h, hkv, s, d = 20, 5, 700, 128
    # keys: a short-context range (one block), outgrown by most rows; 1024: the default splits over small
    # blocks; batch 8 with the default splits runs 2 warps a program (`DecodePlan.attn_narrow_min_b`), over a
    # float8 cache 13 splits (`attn_narrow_programs_per_sm`)
    for b, keys in ((1, 0), (8, 0), (64, 0), (1, 256), (8, 256), (1, 1024), (2, 1024)):
        g = torch.Generator(device="cuda").manual_seed(b)
        q = torch.randn(b, h, d, device="cuda", generator=g).bfloat16()
        kc = torch.randn(b, hkv, s, d, device="cuda", generator=g).to(kv)
        vc = torch.randn(b, hkv, s, d, device="cuda", generator=g).to(kv)
        pos = torch.randint(0, s, (b,), device="cuda", generator=g, dtype=torch.int32)
        pos[0] = s - 1
        for _ in range(2):
            out = torch.full((b, h, d), float("nan"), device="cuda", dtype=torch.bfloat16)
            attn_decode(q, kc, vc, pos, out, d**-0.5, keys)
            for i in range(b):
                n = int(pos[i]) + 1
                k = kc[i, :, :n].double().repeat_interleave(h // hkv, 0)
                v = vc[i, :, :n].double().repeat_interleave(h // hkv, 0)
                w = torch.softmax((k @ q[i].double()[:, :, None]).squeeze(-1) * d**-0.5, dim=-1)
                ref = (w[:, None, :] @ v).squeeze(1)
                err = (out[i].double() - ref).norm() / ref.norm()
                assert err < 1e-2, (b, keys, i, float(err))


def test_key_range_picks_small_blocks_or_one_range_block():
    """A captured step's key range: up to `attn_small_max_b` rows and `attn_small_max_keys` keys, that bound (the
    default splits over small blocks); else, up to `attn_range_max_b` rows, one range block up to one block of
    keys; else 0 (the default splits), and 0 for an unknown bound."""
    from bitnetlm.kernels.triton import attention

    plan = P.DecodePlan()
    bs = attention.key_ranges()[0]
    small = plan.attn_small_max_keys
    assert attention.key_ranges() == [bs, small] and small > bs
    ns = (0, 1, bs, bs + 1, small, small + 1)
    assert [attention.key_range(1, n) for n in ns] == [0, small, small, small, small, 0]
    few, big = plan.attn_small_max_b, plan.attn_range_max_b
    assert few < big and attention.key_range(few, small) == small
    assert [attention.key_range(few + 1, n) for n in ns] == [0, bs, bs, 0, 0, 0]
    assert attention.key_range(big, 1) == bs and attention.key_range(big + 1, 1) == 0
    no_small = P.DecodePlan(attn_small_max_b=0)
    assert attention.key_range(1, 1, no_small) == bs and attention.key_range(1, bs + 1, no_small) == 0
    assert attention.key_range(1, 1, P.DecodePlan(attn_small_max_b=0, attn_range_max_b=0)) == 0


def test_engine_argmax_first_index():
    """The engine's two-pass argmax equals torch.argmax (first index of the maximum), ties across chunks too."""
    from bitnetlm.runtime.cuda.engine import CudaEngine

    g = torch.Generator().manual_seed(4)
    for v in (128256, 32000, 512, 1001):
        x = torch.randn(5, v, generator=g).to(DEV)
        x[1, 7] = x[1, v - 3] = 100.0  # tie: first one wins
        x[2] = 0.0  # all tied
        x[3, v - 1] = 50.0
        x[4] = x[4].bfloat16().float()  # many ties
        assert torch.equal(CudaEngine.argmax(x), x.argmax(-1)), v
