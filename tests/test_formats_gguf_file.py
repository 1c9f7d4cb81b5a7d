"""GGUF container reader/writer: agreement with gguf.GGUFReader, bad input, bounded-time fuzzing."""

import struct
import warnings

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bitnetlm.formats import gguf_codecs as c
from bitnetlm.formats.gguf_file import GGUFError, TensorToWrite, read_gguf, write_gguf


def _sample(tmp_path, with_i2s=False):
    rng = np.random.default_rng(0)
    t = rng.integers(-1, 2, (4, 512)).astype(np.int8)
    tensors = [
        TensorToWrite("blk.0.attn_q.weight", c.encode_tq2_0(t, 0.5), c.TYPE_TQ2_0, (4, 512)),
        TensorToWrite("blk.0.attn_k.weight", c.encode_tq1_0(t, 0.25), c.TYPE_TQ1_0, (4, 512)),
        TensorToWrite("norm", rng.standard_normal(512).astype(np.float32), c.TYPE_F32, (512,)),
        TensorToWrite("emb", rng.standard_normal((3, 512)).astype(np.float16), c.TYPE_F16, (3, 512)),
    ]
    if with_i2s:
        tensors.append(TensorToWrite("blk.0.attn_v.weight", c.encode_i2_s(t, 0.125), c.TYPE_I2_S, (4, 512)))
    meta = {"bitnet.block_count": 1, "tokenizer.ggml.tokens": ["a", "b", "é"], "x.scores": [0.5, -1.0]}
    path = tmp_path / "m.gguf"
    write_gguf(path, "bitnet", meta, tensors)
    return path, t, tensors


def test_reader_agrees_with_gguf_reader(tmp_path):
    path, t, tensors = _sample(tmp_path)
    ours = read_gguf(path)
    ref = gguf.GGUFReader(path)
    assert set(ours.tensors) == {rt.name for rt in ref.tensors}
    for rt in ref.tensors:
        ti = ours.tensors[rt.name]
        assert ti.type_id == int(rt.tensor_type)
        assert ti.offset == rt.data_offset and ti.nbytes == rt.n_bytes
        assert ti.shape == tuple(int(d) for d in reversed(rt.shape))
        np.testing.assert_array_equal(ours.raw(rt.name), rt.data.reshape(-1).view(np.uint8))
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):  # GGUFReader's pseudo-fields for the header
            continue
        assert ours.metadata[key] == field.contents(), key
    np.testing.assert_array_equal(ours.ternary("blk.0.attn_q.weight")[0], t)
    np.testing.assert_array_equal(ours.array("emb"), tensors[3].data)


def test_i2s_file_round_trip(tmp_path):
    path, t, _ = _sample(tmp_path, with_i2s=True)
    f = read_gguf(path)
    t2, s = f.ternary("blk.0.attn_v.weight")
    np.testing.assert_array_equal(t2, t)
    assert s == 0.125 and f.tensors["blk.0.attn_v.weight"].type_name == "I2_S"


def test_bad_inputs(tmp_path):
    path, _, _ = _sample(tmp_path)
    data = path.read_bytes()
    bad = tmp_path / "bad.gguf"

    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(GGUFError, match="wrong magic"):
        read_gguf(bad)

    bad.write_bytes(data[:-100])  # tensor data past end of file
    with pytest.raises(GGUFError, match="runs past the end"):
        read_gguf(bad)

    bad.write_bytes(data[:200])  # truncated inside the metadata
    with pytest.raises(GGUFError, match="truncated"):
        read_gguf(bad)

    bad.write_bytes(data[:10])
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf(bad)

    bad.write_bytes(data[:4] + struct.pack("<I", 7) + data[8:])
    with pytest.raises(GGUFError, match="unsupported GGUF version 7"):
        read_gguf(bad)

    # absurd counts: 2**62 metadata entries must fail before any allocation
    bad.write_bytes(data[:16] + struct.pack("<Q", 1 << 62) + data[24:])
    with pytest.raises(GGUFError, match="truncated or corrupt"):
        read_gguf(bad)

    f = read_gguf(path)
    first = f.tensors["blk.0.attn_q.weight"]
    name = b"blk.0.attn_q.weight"
    pos = data.index(name) + len(name)  # n_dims u32, dims u64 x2, type u32, offset u64
    dims_at, type_at = pos + 4, pos + 4 + 16
    # unknown type id
    bad.write_bytes(data[:type_at] + struct.pack("<I", 99) + data[type_at + 4 :])
    with pytest.raises(GGUFError, match="unknown type id 99"):
        read_gguf(bad)
    # absurd dimensions
    bad.write_bytes(data[:dims_at] + struct.pack("<QQ", 1 << 40, 1 << 40) + data[dims_at + 16 :])
    with pytest.raises(GGUFError, match="absurd dimensions"):
        read_gguf(bad)
    # dims that fit the element limit but not the file
    bad.write_bytes(data[:dims_at] + struct.pack("<QQ", 512, 1 << 20) + data[dims_at + 16 :])
    with pytest.raises(GGUFError, match="runs past the end"):
        read_gguf(bad)
    # too many dims
    bad.write_bytes(data[:pos] + struct.pack("<I", 9) + data[pos + 4 :])
    with pytest.raises(GGUFError, match="9 dims"):
        read_gguf(bad)
    assert first.nbytes == 4 * 2 * 66


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fuzz_reader(tmp_path_factory, data):
    """Random corruption of a valid file: the reader either succeeds or raises GGUFError, nothing else."""
    base = tmp_path_factory.getbasetemp() / "fuzz_base.gguf"
    if not base.exists():
        _sample(tmp_path_factory.mktemp("fz"), with_i2s=True)[0].rename(base)
    raw = bytearray(base.read_bytes())
    mode = data.draw(st.sampled_from(["flip", "truncate", "splice", "header"]))
    if mode == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
    elif mode == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    elif mode == "splice":
        i = data.draw(st.integers(0, len(raw)))
        raw[i:i] = data.draw(st.binary(min_size=1, max_size=16))
    else:  # overwrite a u64 inside the header/metadata region with an arbitrary value
        i = data.draw(st.integers(4, min(len(raw), 600) - 8))
        raw[i : i + 8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
    p = tmp_path_factory.getbasetemp() / "fuzz_case.gguf"
    p.write_bytes(bytes(raw))
    try:
        f = read_gguf(p)
    except GGUFError:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # corrupted block scales warn; that is fine here
        for name, ti in f.tensors.items():  # whatever was accepted must also decode or fail cleanly
            try:
                if ti.type_id in c.TYPE_NAMES:
                    f.ternary(name)
                else:
                    f.array(name)
            except GGUFError:
                pass
