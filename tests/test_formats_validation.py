"""Bad checkpoints get one line naming the file and the tensor / field, exit code 2, never a traceback or a hang:
corrupt safetensors headers (every reader validates offsets the way the safetensors library does), config.json
values, layer counts checked against the tensors present before anything is built, GGUF offsets and metadata,
and GGUF vocabularies with invalid UTF-8 (read as llama.cpp reads them: U+FFFD)."""

import json
import math
import struct

import numpy as np
import pytest
import torch
from oracle import byte_level_bpe
from safetensors import safe_open

import bitnetlm
from bitnetlm.cli import main
from bitnetlm.formats.gguf import save_gguf
from bitnetlm.formats.gguf_file import TensorToWrite, read_gguf, write_gguf
from bitnetlm.formats.hf import save_hf

ST_DTYPES = {torch.uint8: "U8", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    byte_level_bpe().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text("{}")
    return d


@pytest.fixture
def model_dir(tiny_model, tok_dir, tmp_path):
    """A packed autobitlinear directory with a tokenizer: `bitnetlm.load` maps it zero-copy (formats/native.py)."""
    files = {f.name: f.read_text() for f in tok_dir.iterdir()}
    return save_hf(tiny_model, tmp_path / "m", extra_files=files)


def test_the_unbroken_files_generate(model_dir, gguf_path, capsys):
    """The files every test below breaks one thing of: intact, both generate."""
    for path in (model_dir, gguf_path):
        assert main(["generate", "-m", str(path), "-p", "truth", "-n", "2"]) == 0
    capsys.readouterr()


def _fail(argv, capsys, *needles) -> str:
    """Run the CLI in-process: exit 2 and one stderr line that names every needle."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)
    return err


def _tensors(path) -> list[tuple[str, str, list[int], bytes]]:
    with safe_open(str(path), framework="pt") as f:
        return [
            (k, ST_DTYPES[t.dtype], list(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
            for k in f.keys()  # noqa: SIM118 (safe_open has no items())
            for t in [f.get_tensor(k)]
        ]


def _write_raw(path, entries, offsets=None, metadata=None, data=None) -> None:
    """A safetensors file from (name, dtype, shape, bytes) in this order; `offsets` overrides the data ranges."""
    header, pos = {}, 0
    for name, dtype, shape, raw in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(raw)]}
        pos += len(raw)
    for name, rng in (offsets or {}).items():
        header[name]["data_offsets"] = list(rng)
    header["__metadata__"] = metadata or {"format": "pt"}
    h = json.dumps(header).encode()
    h += b" " * (-(8 + len(h)) % 8)  # the data region starts 8-byte aligned, as the library writes it
    blob = b"".join(e[3] for e in entries) if data is None else data
    path.write_bytes(struct.pack("<Q", len(h)) + h + blob)


def _logits(model, ids=(1, 5, 9, 42)):
    with torch.no_grad():
        return model(torch.tensor([list(ids)]))


# ---- safetensors headers ---------------------------------------------------------------------------------


def test_overlapping_offsets_are_refused_not_loaded(model_dir, capsys):
    """Two tensors over the same bytes: the safetensors library refuses the file; the zero-copy loader used to
    load it and change the model's output (up_proj read gate_proj's weights)."""
    st = model_dir / "model.safetensors"
    entries = _tensors(st)
    gate, up = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
    kept = [e for e in entries if e[0] != up]
    start = sum(len(e[3]) for e in kept[: [e[0] for e in kept].index(gate)])
    up_entry = next(e for e in entries if e[0] == up)
    _write_raw(st, [*kept, (up, "U8", up_entry[2], b"")], {up: (start, start + len(up_entry[3]))})
    with pytest.raises(Exception, match="invalid offset"):  # the library's verdict on the same file
        with safe_open(str(st), framework="pt") as f:
            f.get_tensor(up)
    _fail(["generate", "-m", str(model_dir), "-p", "hi", "-n", "1"], capsys, str(st), repr(up), "overlaps")
    _fail(["inspect", str(model_dir)], capsys, str(st), "overlaps")


@pytest.mark.parametrize("case", ["gap", "shifted", "short", "trailing"])
def test_offsets_must_tile_the_data_exactly(model_dir, capsys, case):
    st = model_dir / "model.safetensors"
    entries = _tensors(st)
    name, _, _, raw = entries[1]
    a = sum(len(e[3]) for e in entries[:1])
    offsets, data = {}, None
    if case == "gap":  # a hole before the tensor
        offsets = {name: (a + 2, a + 2 + len(raw))}
    elif case == "shifted":  # one byte late: overlaps the next tensor
        offsets = {name: (a + 1, a + 1 + len(raw))}
    elif case == "short":  # fewer bytes than dtype size x element count
        offsets = {name: (a, a + len(raw) - 1)}
    else:
        data = b"".join(e[3] for e in entries) + b"\0" * 8
    _write_raw(st, entries, offsets, data=data)
    err = _fail(["generate", "-m", str(model_dir), "-p", "hi", "-n", "1"], capsys, str(st))
    if case != "trailing":
        assert repr(name) in err
    _fail(["inspect", str(model_dir)], capsys, str(st))


def test_unaligned_offsets_load_as_the_safetensors_library_reads_them(model_dir):
    """Offsets that are contiguous but not a multiple of the element size are legal (the library reads them):
    the validation accepts them, and the zero-copy loader copies such tensors to aligned memory."""
    want = _logits(bitnetlm.load(model_dir)[0])
    st = model_dir / "model.safetensors"
    odd = ("model.layers.0.self_attn.rotary_emb.inv_freq", "U8", [3], b"\1\2\3")  # an ignored buffer
    _write_raw(st, [odd, *_tensors(st)], metadata={"format": "pt", "bitnetlm_layout": "hf-2bit"})
    with safe_open(str(st), framework="pt") as f:  # the library accepts the file
        assert f.get_tensor("model.norm.weight").numel() == 64
    from bitnetlm.formats.native import mmap_safetensors

    tensors, _ = mmap_safetensors(st)
    assert all(t.data_ptr() % t.element_size() == 0 for t in tensors.values())
    torch.testing.assert_close(_logits(bitnetlm.load(model_dir)[0]), want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"", "not a safetensors file"),
        (b"\xff" * 64, "header length"),
        (struct.pack("<Q", 6) + b"{nope}", "not JSON"),
        (struct.pack("<Q", 2) + b"[]", "expected a JSON object, found list"),
        (struct.pack("<Q", 8) + b'{"a": 1}', "'a'"),
    ],
    ids=["empty", "garbage", "not-json", "list-header", "entry-not-object"],
)
def test_corrupt_safetensors_in_inspect_and_load(model_dir, capsys, content, needle):
    st = model_dir / "model.safetensors"
    st.write_bytes(content)
    _fail(["inspect", str(model_dir)], capsys, str(st), needle)
    _fail(["generate", "-m", str(model_dir), "-p", "hi", "-n", "1"], capsys, str(st), needle)


@pytest.mark.parametrize(
    "shape, dtype", [([2**40, 2**40], "F32"), ([2**63, 2], "U8"), ([-2, 4], "F32"), ([1.5], "U8")]
)
def test_bad_shapes_in_inspect(model_dir, capsys, shape, dtype):
    """Element counts whose byte size overflows 64 bits (the library: "overflow computing buffer size"), negative
    or non-integer dims: one line naming the tensor, never a traceback."""
    st = model_dir / "model.safetensors"
    entries = _tensors(st)
    entries.append(("model.extra", dtype, shape, b""))
    _write_raw(st, entries)
    _fail(["inspect", str(model_dir)], capsys, str(st), "'model.extra'")
    _fail(["generate", "-m", str(model_dir), "-p", "hi", "-n", "1"], capsys, str(st), "'model.extra'")


# ---- config.json ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, field",
    [
        ([1, 2], "expected a JSON object, found list"),
        ({"rope_theta": [10000.0]}, "rope_theta"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"rope_scaling": "linear"}, "rope_scaling"),
        ({"rope_parameters": "default"}, "rope_parameters"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"intermediate_size": -128}, "intermediate_size"),
        ({"num_attention_heads": -4}, "num_attention_heads"),
        ({"num_key_value_heads": 0}, "num_key_value_heads"),
        ({"head_dim": -16}, "head_dim"),
        ({"max_position_embeddings": 0}, "max_position_embeddings"),
        ({"vocab_size": True}, "vocab_size"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"rms_norm_eps": -1e-5}, "rms_norm_eps"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
        ({"rms_norm_eps": "1e-5"}, "rms_norm_eps"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
        ({"quantization_config": "bitnet"}, "quantization_config"),
    ],
)
def test_bad_config_values_name_the_field(model_dir, capsys, change, field):
    cfg_file = model_dir / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg = change if isinstance(change, list) else {**cfg, **change}
    cfg_file.write_text(
        json.dumps(cfg)
    )  # json writes NaN as NaN, which json.loads (and transformers) read back
    _fail(["inspect", str(model_dir)], capsys, str(cfg_file), field)
    _fail(["generate", "-m", str(model_dir), "-p", "hi", "-n", "1"], capsys, str(cfg_file), field)


@pytest.mark.parametrize(
    "name, content, needle",
    [
        ("config.json", b"", "not valid JSON"),
        ("config.json", b"\xff\xfe{}", "not valid JSON"),
        ("model.safetensors.index.json", b"[]", "not a valid safetensors index"),
        ("model.safetensors.index.json", b'{"weight_map": ["a"]}', "'weight_map' must map"),
    ],
)
def test_empty_or_malformed_json_files(model_dir, capsys, name, content, needle):
    (model_dir / name).write_bytes(content)
    _fail(["inspect", str(model_dir)], capsys, str(model_dir / name), needle)
    _fail(["generate", "-m", str(model_dir), "-p", "hi", "-n", "1"], capsys, str(model_dir / name), needle)


def test_empty_gguf(tmp_path, capsys):
    (tmp_path / "e.gguf").write_bytes(b"")
    _fail(["inspect", str(tmp_path / "e.gguf")], capsys, str(tmp_path / "e.gguf"), "not a GGUF file")
    _fail(["generate", "-m", str(tmp_path / "e.gguf"), "-p", "hi"], capsys, str(tmp_path / "e.gguf"))


@pytest.mark.parametrize("layers", [10**9, 3, 1])
def test_layer_count_is_checked_against_the_tensors_before_building(model_dir, capsys, layers):
    """num_hidden_layers = 1e9 used to build a billion layers (hang, memory); now the count is compared with the
    `model.layers.N.` tensors present first, by every reader (zero-copy, generic HF, inspect)."""
    cfg_file = model_dir / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "num_hidden_layers": layers}))
    msg = f"num_hidden_layers = {layers}, the checkpoint holds tensors for 2 layers"
    _fail(["generate", "-m", str(model_dir), "-p", "hi", "-n", "1"], capsys, str(model_dir), msg)
    _fail(["inspect", str(model_dir)], capsys, msg)
    from bitnetlm.formats.hf import load_hf

    with pytest.raises(ValueError, match="holds tensors for 2 layers"):
        load_hf(model_dir)


# ---- GGUF ------------------------------------------------------------------------------------------------


def _rewrite_gguf(src, dst, meta_changes=None, tensors=None):
    f = read_gguf(src)
    meta = {k: v for k, v in f.metadata.items() if k != "general.architecture"}
    meta.update(meta_changes or {})
    ts = tensors or [
        TensorToWrite(n, np.array(f.raw(n)), ti.type_id, ti.shape) for n, ti in f.tensors.items()
    ]
    write_gguf(dst, f.metadata["general.architecture"], meta, ts, value_types=f.value_types)
    return dst


@pytest.fixture
def gguf_path(tiny_model, tok_dir, tmp_path):
    return save_gguf(tiny_model, tmp_path / "m.gguf", "i2_s", tokenizer=tok_dir)


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("block_count", 10**9, "is 1000000000, the file holds tensors for 2 blocks"),
        ("block_count", 3, "the file holds tensors for 2 blocks"),
        ("attention.layer_norm_rms_epsilon", float("nan"), "positive finite number"),
        ("attention.layer_norm_rms_epsilon", 0.0, "positive finite number"),
        ("rope.freq_base", -1.0, "positive finite number"),
        ("feed_forward_length", 0, "intermediate_size"),
    ],
)
def test_bad_gguf_metadata_fails_fast_naming_the_key(gguf_path, tmp_path, capsys, key, value, needle):
    arch = read_gguf(gguf_path).metadata["general.architecture"]
    bad = _rewrite_gguf(gguf_path, tmp_path / "bad.gguf", {f"{arch}.{key}": value})
    _fail(["generate", "-m", str(bad), "-p", "hi", "-n", "1"], capsys, str(bad), needle)


def test_gguf_tensor_data_must_follow_the_table(gguf_path, tmp_path, capsys):
    """llama.cpp refuses tensor data that does not follow the tensor table in order (overlap or gap); so do we:
    two tensors sharing bytes would otherwise load as a different model."""
    f = read_gguf(gguf_path)
    name, ti = list(f.tensors.items())[1]
    raw = bytearray(gguf_path.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    assert raw.count(key) == 1
    pos = raw.index(key) + len(key) + 4 + 8 * len(ti.shape) + 4  # past n_dims, dims and type: the offset
    assert struct.unpack_from("<Q", raw, pos)[0] == ti.offset - f.data_offset
    raw[pos : pos + 8] = struct.pack("<Q", 0)  # the first tensor's bytes
    bad = tmp_path / "overlap.gguf"
    bad.write_bytes(bytes(raw))
    _fail(["inspect", str(bad)], capsys, str(bad), repr(name), "expected")
    _fail(["generate", "-m", str(bad), "-p", "hi", "-n", "1"], capsys, str(bad), repr(name))


def test_gguf_vocabulary_with_invalid_utf8_reads_like_llama_cpp(tmp_path, capsys):
    """Token bytes that are not UTF-8 become U+FFFD per bad byte, as llama.cpp's unicode_cpts_from_utf8 reads
    them; two tokens that only differ in bad bytes no longer break the tokenizer; inspect prints the file."""
    from oracle import random_model

    tok = byte_level_bpe()
    d = tmp_path / "tok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text("{}")
    m = random_model("bitnet", vocab_size=512, hidden_act="relu2")
    path = save_gguf(m, tmp_path / "m.gguf", "i2_s", tokenizer=d)
    raw = path.read_bytes()
    for old, new in (
        (b"[PAD500]", b"\xffPAD500]"),
        (b"[PAD501]", b"\xfePAD500]"),
        (b"[PAD502]", b"\xe2\x82PAD50]"),
    ):
        assert raw.count(old) == 1
        raw = raw.replace(old, new)
    path.write_bytes(raw)
    tokens = read_gguf(path).metadata["tokenizer.ggml.tokens"]
    assert tokens[500] == tokens[501] == "\ufffdPAD500]" and tokens[502] == "\ufffd\ufffdPAD50]"
    model, back = bitnetlm.load(path)
    text = "It is a truth universally acknowledged"
    assert back.encode(text, add_special_tokens=False) == tok.encode(text).ids
    assert back.decode(tok.encode(text).ids) == text
    assert main(["inspect", str(path)]) == 0


def test_config_nan_and_inf_never_reach_the_model():
    from bitnetlm.models import ModelConfig

    for field, value in (("rms_norm_eps", math.inf), ("rope_theta", math.nan), ("rms_norm_eps", -0.0)):
        with pytest.raises(ValueError, match=field):
            ModelConfig(**{field: value})
