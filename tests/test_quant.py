import pytest
import torch

from bitnetlm.kernels import get_backend
from bitnetlm.quant import (
    BitLinear,
    PackingFormat,
    int_matmul,
    pack,
    pack_base3,
    pack_hf,
    quantize_activations,
    ternarize,
    unpack,
    unpack_base3,
    unpack_hf,
)


def test_pack_hf_matches_formats_example():
    t = torch.tensor([[-1, 0], [0, 1], [1, 1], [-1, -1], [1, 0], [0, -1], [1, -1], [0, 0]], dtype=torch.int8)
    assert pack_hf(t).tolist() == [[0b10101000, 0b00011001], [0b01010001, 0b01000010]]


@pytest.mark.parametrize("shape", [(8, 5), (640 * 4, 3), (12, 17), (4, 1)])
def test_pack_hf_equals_transformers(shape):
    from transformers.integrations.bitnet import pack_weights, unpack_weights

    unpack_weights = getattr(
        unpack_weights, "_torchdynamo_orig_callable", unpack_weights
    )  # skip torch.compile
    t = torch.randint(-1, 2, shape, dtype=torch.int8)
    ours = pack_hf(t)
    theirs = pack_weights(t.clone())
    assert torch.equal(ours, theirs)
    assert torch.equal(unpack_hf(ours, shape[0]), unpack_weights(theirs, dtype=torch.int8)[: shape[0]])


def test_pack_roundtrips_ragged_rows():
    for n in (1, 2, 3, 5, 7, 13):
        t = torch.randint(-1, 2, (n, 9), dtype=torch.int8)
        assert torch.equal(unpack_hf(pack_hf(t), n), t)
        assert torch.equal(unpack_base3(pack_base3(t), (n, 9)), t)
        for fmt in (PackingFormat.INT8, PackingFormat.HF_2BIT, PackingFormat.BASE3):
            assert torch.equal(unpack(pack(t, fmt), fmt, (n, 9)), t)


def test_base3_density_and_digits():
    t = torch.tensor([[1, 0, -1, 1, 1]], dtype=torch.int8)  # digits 2,1,0,2,2 -> 2*81+27+0+6+2
    assert pack_base3(t).tolist() == [197]
    assert pack_base3(torch.zeros(10, 100, dtype=torch.int8)).numel() == 200  # 1.6 bits per weight


def test_ternarize_absmean_and_zero_matrix():
    w = torch.tensor([[0.5, -0.1, 2.0, -3.0]])
    t, s = ternarize(w)
    assert float(s) == pytest.approx(1.4)
    assert t.tolist() == [[0, 0, 1, -1]]
    t0, s0 = ternarize(torch.zeros(3, 4))  # all-zero layers exist in real Hub files: the clamp keeps s > 0
    assert float(s0) == pytest.approx(1e-5) and not t0.any()


def test_activation_quant_range_and_scale():
    x = torch.randn(4, 7, 33) * 10
    q, a = quantize_activations(x)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    assert torch.equal(q.abs().amax(-1), torch.full((4, 7), 127, dtype=torch.int8))
    assert torch.allclose(q.float() / a, x, atol=float(x.abs().amax() / 127))


def test_int_matmul_is_exact():
    x = torch.randint(-128, 128, (5, 6912), dtype=torch.int8)
    t = torch.randint(-1, 2, (33, 6912), dtype=torch.int8)
    expected = (x.double() @ t.double().T).to(torch.int64)
    assert torch.equal(int_matmul(x, t).to(torch.int64), expected)
    worst = torch.full((1, 6912), 127, dtype=torch.int8)
    assert int(int_matmul(worst, torch.ones(1, 6912, dtype=torch.int8))) == 127 * 6912


@pytest.mark.parametrize("shape", [(3, 64, 40), (1, 2560, 640), (2, 100, 7)])
def test_reference_backend_integer_part_exact(shape):
    m, k, n = shape
    t = torch.randint(-1, 2, (n, k), dtype=torch.int8)
    x = torch.randn(m, k)
    s = torch.tensor(0.37)
    y = get_backend("reference").linear(x, pack_hf(t), s.reshape(1), n)
    xq, a = quantize_activations(x)
    y_int = torch.round(y.double() * a.double() / 0.37)  # undo the float scale
    assert torch.equal(y_int.to(torch.int64), int_matmul(xq, t).to(torch.int64))


def test_bitlinear_train_vs_infer_and_ste():
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 20, bias=True)
    b = BitLinear.from_linear(lin)
    x = torch.randn(2, 3, 48, requires_grad=True)
    y = b(x)
    y.sum().backward()
    # STE: gradient w.r.t. the latent weight is the plain linear gradient of the quantized forward
    assert b.weight.grad is not None and b.weight.grad.abs().sum() > 0
    assert torch.allclose(x.grad, torch.ones(2, 3, 20) @ (b.ternary_weight().float() * b.scale()), atol=1e-6)
    inf = b.to_inference()
    assert not inf.training_mode and inf.packed.dtype == torch.uint8
    torch.testing.assert_close(inf(x.detach()), y.detach(), atol=1e-5, rtol=1e-5)
    assert torch.equal(inf.ternary_weight(), b.ternary_weight())


def test_bitlinear_state_dict_is_hf_layout():
    t = torch.randint(-1, 2, (12, 16), dtype=torch.int8)
    b = BitLinear.from_ternary(t, 0.5)
    sd = b.state_dict()
    assert torch.equal(sd["packed"], pack_hf(t)) and float(sd["weight_scale"]) == 0.5
    b2 = BitLinear(16, 12, mode="infer")
    b2.load_state_dict(sd)
    assert torch.equal(b2.ternary_weight(), t)


def test_unknown_backend_error():
    with pytest.raises(ValueError, match="unknown kernel backend"):
        get_backend("nope")
