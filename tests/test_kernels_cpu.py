"""The C kernel backend ("cpu", csrc/): bit-exact against the integer oracle on every ISA path this machine runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from bitnetlm.kernels import cpu as cpuk
from bitnetlm.kernels import reference, select_backend
from bitnetlm.kernels.cpu import ops
from bitnetlm.quant.packing import PackingFormat
from bitnetlm.quant.ternary import int_matmul, quantize_activations


def test_library_is_built():
    # CI builds the extension from a clean checkout (pip install -e .): it must be there and load.
    assert cpuk.available(), cpuk._lib.load_error()
    assert "scalar" in cpuk.supported_isas()


ISAS = cpuk.supported_isas() if cpuk.available() else ["scalar"]

# (N, K, M): 2B4T projections, odd sizes, K not a multiple of the 128 block, M not a multiple of the token tile
SHAPES = [
    (2560, 2560, 1),
    (6912, 2560, 1),
    (2560, 6912, 1),
    (640, 2560, 5),
    (2560, 6912, 2),
    (37, 300, 7),
    (5, 129, 1),
    (1, 1, 1),
    (13, 127, 4),
    (66, 384, 9),
    (3, 1000, 3),
    # prefill tiles: 8-token tiles over several 16-block K chunks, with 4/3-token tails; more rows than one
    # L2 row chunk
    (70, 2560, 21),
    (9, 6912, 16),
    (1100, 300, 11),
]


def _rand_ternary(n, k, gen):
    return torch.randint(-1, 2, (n, k), generator=gen, dtype=torch.int8)


def test_layout_roundtrip_and_c_pack_agree():
    gen = torch.Generator().manual_seed(1)
    for n, k, _ in SHAPES:
        t = _rand_ternary(n, k, gen)
        p = cpuk.BACKEND.pack(t)
        assert p.shape == ((n + 3) // 4 * 4, cpuk.padded_k(k) // 4) and p.dtype == torch.uint8
        assert torch.equal(cpuk.BACKEND.unpack(p, (n, k)), t)
        # the C library's own packer writes the same bytes as the torch definition
        pc = torch.empty_like(p)
        cpuk._lib.load().bn_pack(t.data_ptr(), n, k, pc.data_ptr())
        assert torch.equal(pc, p)
        tc = torch.empty_like(t)
        cpuk._lib.load().bn_unpack(p.data_ptr(), n, k, tc.data_ptr())
        assert torch.equal(tc, t)


def test_layout_example():
    # row r, element e of block b: byte (r // 4) * 4 * (Kp / 4) + 128 * b + 32 * (r % 4) + e % 32,
    # bits 2 * ((e % 128) // 32); code t + 1; rows padded to a multiple of 4 with code 1
    t = torch.zeros(1, 130, dtype=torch.int8)
    t[0, 0], t[0, 33], t[0, 127], t[0, 129] = 1, -1, 1, -1
    p = cpuk.pack_cpu(t)
    assert p.shape == (4, 64)
    assert p[0, 0] == 0b01010110  # e=0 code 2 at bits 0-1, e=32/64/96 code 1
    assert p[0, 1] == 0b01010001  # e=1 code 1, e=33 code 0 at bits 2-3
    assert p[0, 31] == 0b10010101  # e=127 code 2 at bits 6-7
    flat = p.flatten()
    assert flat[129] == 0b01010100  # block 1 (byte 128 + 32 * row 0), e=129 -> byte 129, code 0 at bits 0-1
    assert (flat[32:128] == 0b01010101).all()  # padding rows 1-3 of the group: t = 0
    t2 = torch.zeros(5, 128, dtype=torch.int8)
    t2[1, 0], t2[4, 0] = 1, -1
    p2 = cpuk.pack_cpu(t2).flatten()
    assert p2.numel() == 8 * 32
    assert p2[32] == 0b01010110  # row 1: second 32 bytes of group 0's block
    assert p2[128] == 0b01010100  # row 4: first row of group 1


@pytest.mark.parametrize("isa", ISAS)
def test_int_matmul_bit_exact(isa):
    gen = torch.Generator().manual_seed(2)
    with cpuk.use_isa(isa):
        for n, k, m in SHAPES:
            t = _rand_ternary(n, k, gen)
            t[:4] = 1  # code 2 everywhere in the first row group: with x = -128 the int16 sums' worst case
            p = cpuk.pack_cpu(t)
            # the full int8 range, -128 included (the kernels' int16 stages must not saturate)
            xq = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
            xq[0] = -128
            if m > 1:
                xq[-1] = 127
            got = ops.ternary_matmul_i32(xq, p, n)
            assert torch.equal(got, int_matmul(xq, t)), (isa, n, k, m)


@pytest.mark.parametrize("isa", ISAS)
def test_linear_bit_identical_to_reference(isa):
    gen = torch.Generator().manual_seed(3)
    ref = reference.BACKEND
    with cpuk.use_isa(isa):
        for n, k, m in SHAPES:
            t = _rand_ternary(n, k, gen)
            s = torch.tensor([0.0123 + n % 7])
            x = torch.randn(m, k, generator=gen) * 3
            y = cpuk.BACKEND.linear(x, cpuk.pack_cpu(t), s, n)
            assert torch.equal(y, ref.linear(x, ref.pack(t), s, n)), (isa, n, k, m)
        # bf16 input: quantized from its float32 value, output cast back, like the reference
        t = _rand_ternary(96, 200, gen)
        xb = torch.randn(2, 3, 200, generator=gen).bfloat16()
        s = torch.tensor([0.5])
        y = cpuk.BACKEND.linear(xb, cpuk.pack_cpu(t), s, 96)
        assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 96)
        assert torch.equal(y, ref.linear(xb, ref.pack(t), s, 96))


@pytest.mark.parametrize("isa", ISAS)
def test_activation_quantization_bit_exact(isa):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 301, generator=gen) * 5
    x[1] = 0.0  # all-zero row: the 1e-5 clamp
    x[2] = 1e-7
    x[3, :10] = torch.tensor([0.5, -0.5, 1.5, -2.5, 126.5, -126.5, 127.0, 3.5, 2.5, -0.0]) / 127 * 1.0
    x[3, 10:] = 0.0  # ties at exactly .5 after scaling: round half to even
    x[4, 0] = 1e30
    with cpuk.use_isa(isa):
        q, a = ops.quantize_activations(x)
    qr, ar = quantize_activations(x)
    assert torch.equal(q, qr) and torch.equal(a, ar)


def test_thread_counts_agree():
    gen = torch.Generator().manual_seed(5)
    t = _rand_ternary(1000, 700, gen)
    p = cpuk.pack_cpu(t)
    x = torch.randn(11, 700, generator=gen)
    prev = cpuk.get_num_threads()
    try:
        outs = []
        for nt in (1, 2, 3, 5):
            assert cpuk.set_num_threads(nt) == nt
            outs.append(cpuk.BACKEND.linear(x, p, torch.tensor([1.0]), 1000))
            outs.append(cpuk.BACKEND.linear(x[:1], p, torch.tensor([1.0]), 1000))
        for o in outs[2::2]:
            assert torch.equal(o, outs[0])
        for o in outs[3::2]:
            assert torch.equal(o, outs[1])
    finally:
        cpuk.set_num_threads(prev)
    assert cpuk.set_num_threads(None) == cpuk.physical_cores()


def test_bandwidth_helpers_touch_every_byte():
    """The benchmarks' bandwidth helpers (benchmarks/common.py): the parallel copy reproduces the source and
    the parallel read's word sum equals torch's, for sizes that are not a multiple of the 1 MiB thread chunk or
    of the 8-byte word (the tail bytes past the last word are not read), at 1 and 3 threads."""
    lib = cpuk._lib.load()
    prev = cpuk.get_num_threads()
    try:
        for nt in (1, 3):
            cpuk.set_num_threads(nt)
            for nbytes in (8, 1000, (3 << 20) + 4100):
                src = torch.randint(
                    0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes)
                )
                dst = torch.zeros_like(src)
                lib.bn_parallel_copy(dst.data_ptr(), src.data_ptr(), nbytes)
                assert torch.equal(dst, src)
                words = src[: nbytes // 8 * 8].view(torch.int64)
                # the C sum wraps modulo 2**64: compare as uint64 through Python ints
                want = sum(int(w) & (2**64 - 1) for w in words.tolist()) % 2**64
                assert lib.bn_parallel_read(src.data_ptr(), nbytes) == want
    finally:
        cpuk.set_num_threads(prev)


def test_linear_multi_equals_single():
    gen = torch.Generator().manual_seed(6)
    sizes = [256, 64, 64, 3]
    ts = [_rand_ternary(n, 256, gen) for n in sizes]
    ps = [cpuk.pack_cpu(t) for t in ts]
    ss = [torch.tensor([0.1 * (i + 1)]) for i in range(len(sizes))]
    for m in (1, 6):
        x = torch.randn(1, m, 256, generator=gen)
        ys = cpuk.BACKEND.linear_multi(x, ps, ss, sizes)
        for y, p, s, n in zip(ys, ps, ss, sizes):
            assert torch.equal(y, cpuk.BACKEND.linear(x, p, s, n))


def test_float_heads_match_torch():
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(301, 259, generator=gen)
    x = torch.randn(3, 259, generator=gen)
    wb = w.bfloat16()
    torch.testing.assert_close(ops.gemm_float(x, wb), x @ wb.float().T, rtol=1e-5, atol=1e-4)
    q = torch.randint(-127, 128, (301, 259), generator=gen, dtype=torch.int8)
    ws = torch.rand(301, generator=gen) + 0.01
    want = (
        x.double() @ q.double().T * ws.double()
    ).float()  # float32 accumulation order differs: 1e-6 relative
    # x is quantized to int16 per row (error <= 1.5e-5 of max|x| per element), products summed exactly
    got = ops.gemm_i8row(x, q, ws)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    with cpuk.use_isa("scalar"):  # every path: the same integer sums, the same float epilogue
        assert torch.equal(ops.gemm_i8row(x, q, ws), got)
    xl = torch.randn(2, 9000, generator=gen)  # K beyond one 4096-element int32 chunk
    ql = torch.randint(-127, 128, (5, 9000), generator=gen, dtype=torch.int8)
    wl = (xl.double() @ ql.double().T).float()
    torch.testing.assert_close(
        ops.gemm_i8row(xl, ql, torch.ones(5)), wl, rtol=1e-4, atol=1e-4 * wl.abs().max().item()
    )
    with cpuk.use_isa("scalar"):
        torch.testing.assert_close(ops.gemm_float(x, wb), x @ wb.float().T, rtol=1e-5, atol=1e-4)


def test_bad_packed_shape_is_a_clear_error():
    with pytest.raises(ValueError, match="cpu-2bit-v2"):
        cpuk.BACKEND.linear(
            torch.randn(1, 256), torch.zeros(4, 32, dtype=torch.uint8), torch.tensor([1.0]), 4
        )
    with pytest.raises(ValueError, match="not supported|unknown"):
        cpuk.set_isa("sse9")


def test_custom_ops_trace_under_compile():
    gen = torch.Generator().manual_seed(8)
    t = _rand_ternary(70, 150, gen)
    p = cpuk.pack_cpu(t)
    s = torch.tensor([0.3])
    x = torch.randn(2, 150, generator=gen)
    torch.library.opcheck(ops.cpu_ternary_linear, (x, p, s, 70))
    torch.library.opcheck(
        ops.cpu_ternary_matmul_i32, (torch.randint(-128, 128, (3, 150), dtype=torch.int8), p, 70)
    )

    def f(x):
        return torch.relu(cpuk.BACKEND.linear(x, p, s, 70)) * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), f(x))


def test_bitlinear_dispatches_to_cpu_backend():
    from bitnetlm.quant.bitlinear import BitLinear

    gen = torch.Generator().manual_seed(9)
    t = _rand_ternary(48, 200, gen)
    layer = BitLinear.from_ternary(t, torch.tensor(0.7))
    x = torch.randn(2, 5, 200, generator=gen)
    y_ref = reference.BACKEND.linear(x, reference.BACKEND.pack(t), torch.tensor([0.7]), 48)
    layer.use_kernel(select_backend("cpu", "cpu"))
    assert PackingFormat(layer.layout) is PackingFormat.CPU_2BIT
    assert torch.equal(layer(x), y_ref)
    assert select_backend("cpu").name == "cpu"


def test_package_works_with_extension_disabled():
    code = (
        "import torch\n"
        "from bitnetlm.kernels.cpu import _lib\n"
        "_lib.library_path = lambda: None  # as if it had not been built\n"
        "from bitnetlm.kernels import select_backend, available_backends\n"
        "from bitnetlm.kernels import cpu\n"
        "from bitnetlm.quant.bitlinear import BitLinear\n"
        "assert not cpu.available() and not cpu.BACKEND.is_available('cpu')\n"
        "assert available_backends('cpu') == ['reference'], available_backends('cpu')\n"
        "assert select_backend('cpu').name == 'reference'\n"
        "t = torch.randint(-1, 2, (8, 16), dtype=torch.int8)\n"
        "m = BitLinear.from_ternary(t, 1.0)\n"
        "print(m(torch.randn(1, 16)).shape)\n"
    )
    env = dict(os.environ)
    env.pop("BITNETLM_BACKEND", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "torch.Size([1, 8])" in r.stdout


def test_forced_scalar_by_environment():
    code = "from bitnetlm.kernels import cpu; print(cpu.get_isa())"
    env = {**os.environ, "BITNETLM_CPU_ISA": "scalar"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "scalar"


def test_repack_from_hf_layout_equals_pack():
    # the load-time path: transformers' 2-bit bytes straight into cpu-2bit-v2, no int8 copy
    from bitnetlm.quant.packing import pack_hf

    gen = torch.Generator().manual_seed(11)
    for n, k in [(1, 1), (3, 130), (5, 128), (7, 300), (13, 6912), *[(n, k) for n, k, _ in SHAPES]]:
        t = _rand_ternary(n, k, gen)
        got = cpuk.BACKEND.repack(pack_hf(t), PackingFormat.HF_2BIT, (n, k))
        assert torch.equal(got, cpuk.pack_cpu(t)), (n, k)
    # anything else is not its job: the caller falls back to unpack + pack
    t = _rand_ternary(8, 128, gen)
    assert cpuk.BACKEND.repack(cpuk.pack_cpu(t), PackingFormat.CPU_2BIT, (8, 128)) is None
