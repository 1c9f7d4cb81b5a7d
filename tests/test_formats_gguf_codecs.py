"""Ternary GGUF codecs against the oracle (gguf.quants) and the I2_S byte layout (FORMATS.md)."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from bitnetlm.formats import gguf_codecs as c


def _ternary(rng, shape, zero_block=True):
    t = rng.integers(-1, 2, shape).astype(np.int8)
    if zero_block:
        t[0, :256] = 0  # an all-zero block gets scale 0 in llama.cpp's encoding
    return t


@pytest.mark.parametrize("qtype,tid", [(Q.TQ1_0, c.TYPE_TQ1_0), (Q.TQ2_0, c.TYPE_TQ2_0)])
@pytest.mark.parametrize("scale", [0.0123, 1.0, 3.7e-3, 1e-5])
def test_tq_bytes_equal_gguf_quants(qtype, tid, scale):
    rng = np.random.default_rng(1)
    t = _ternary(rng, (6, 768))
    ref = quants.quantize(t.astype(np.float32) * np.float32(scale), qtype)
    mine = c.encode(t, scale, tid)
    assert mine.dtype == np.uint8 and mine.shape == ref.shape
    np.testing.assert_array_equal(mine, ref)
    t2, s2 = c.decode(ref, t.shape, tid, strict=True)
    np.testing.assert_array_equal(t2, t)
    assert s2 == float(np.float16(scale))
    # our decoder agrees with gguf's dequantizer value for value
    np.testing.assert_array_equal(quants.dequantize(ref, qtype), t2.astype(np.float32) * np.float32(s2))


def test_tq1_0_layout_hand_example():
    # one block: value i has trit pattern chosen so each region of the layout is visible
    t = np.zeros((1, 256), dtype=np.int8)
    t[0, 0], t[0, 32], t[0, 64], t[0, 96], t[0, 128] = 1, -1, 0, 1, -1  # byte 0: digits 2,0,1,2,0
    t[0, 160 + 3], t[0, 240 + 1], t[0, 252 + 1] = 1, -1, 1  # byte 35 digit 0; byte 49 digits 0 and 3
    b = c.encode_tq1_0(t, 1.0)[0]
    code0 = 81 * 2 + 27 * 0 + 9 * 1 + 3 * 2 + 0
    assert b[0] == (code0 * 256 + 242) // 243
    assert b[32 + 3] == ((81 * 2 + 27 + 9 + 3 + 1) * 256 + 242) // 243
    assert b[48 + 1] == ((81 * 0 + 27 + 9 + 3 * 2) * 256 + 242) // 243
    assert b[52:54].view(np.float16)[0] == 1.0


def test_i2_s_hand_built_example():
    # 2 x 64 matrix = one 128-value block. Codes c = t + 1, byte j = c[j]<<6 | c[j+32]<<4 | c[j+64]<<2 | c[j+96].
    flat = np.zeros(128, dtype=np.int8)
    flat[0], flat[32], flat[64], flat[96] = 1, -1, 0, 1  # codes 2,0,1,2 -> 0b10_00_01_10
    flat[5], flat[37], flat[69], flat[101] = -1, -1, -1, -1  # codes 0 -> byte 0
    t = flat.reshape(2, 64)
    b = c.encode_i2_s(t, 0.75)
    assert b.size == 128 // 4 + 32
    expected = np.full(32, 0b01010101, dtype=np.uint8)  # all-zero values are code 1 in every slot
    expected[0] = 0b10000110
    expected[5] = 0
    np.testing.assert_array_equal(b[:32], expected)
    assert b[32:36].view("<f4")[0] == np.float32(0.75)
    assert not b[36:].any()
    t2, s = c.decode_i2_s(b, (2, 64))
    np.testing.assert_array_equal(t2, t)
    assert s == 0.75


def test_i2_s_round_trip_random():
    rng = np.random.default_rng(2)
    t = rng.integers(-1, 2, (40, 384)).astype(np.int8)
    t2, s = c.decode_i2_s(c.encode_i2_s(t, 0.0421), t.shape)
    np.testing.assert_array_equal(t2, t)
    assert s == float(np.float32(0.0421))


def test_codec_errors():
    t = np.zeros((2, 100), dtype=np.int8)
    with pytest.raises(c.CodecError, match="multiple of 256"):
        c.encode_tq2_0(t, 1.0)
    with pytest.raises(c.CodecError, match="multiple of 128"):
        c.encode_i2_s(np.zeros((1, 100), np.int8), 1.0)
    with pytest.raises(c.CodecError, match="int8"):
        c.encode_tq1_0(np.zeros((1, 256), np.float32), 1.0)
    with pytest.raises(c.CodecError, match="needs 132 bytes"):
        c.decode_tq2_0(np.zeros(131, np.uint8), (1, 512))
    bad = c.encode_tq2_0(np.zeros((1, 256), np.int8), 1.0)
    bad[0, 0] = 0xFF  # code 3 is not ternary
    with pytest.raises(c.CodecError, match="code 3"):
        c.decode_tq2_0(bad, (1, 256))
    with pytest.raises(c.CodecError, match="positive finite"):
        c.encode_tq2_0(np.ones((1, 256), np.int8), 1e6)  # overflows fp16


def test_mixed_block_scales_warn_or_fail():
    x = np.ones((1, 512), np.float32)
    x[0, 256:] *= 2.0
    b = quants.quantize(x, Q.TQ2_0)
    with pytest.raises(c.CodecError, match="block scales differ"):
        c.decode_tq2_0(b, (1, 512), strict=True)
    with pytest.warns(UserWarning, match="block scales differ"):
        t, s = c.decode_tq2_0(b, (1, 512))
    assert s == 1.5 and (t == 1).all()


def test_bits_per_weight():
    assert c.bits_per_weight(c.TYPE_TQ2_0, 256 * 100) == pytest.approx(66 * 8 / 256)
    assert c.bits_per_weight(c.TYPE_TQ1_0, 256 * 100) == pytest.approx(54 * 8 / 256)
    assert c.bits_per_weight(c.TYPE_I2_S, 2560 * 2560) == pytest.approx(2.0, abs=1e-4)
