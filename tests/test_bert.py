"""BERT-family encoders and sentence embeddings against transformers' BertModel and sentence-transformers."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from oracle_bert import make_bert, oracle_bert

import bitnetlm
from bitnetlm.embedding import embed
from bitnetlm.models.bert import Encoder

# one torch thread: with several, the BLAS may pick its thread count per call on a busy machine, and a batch's sums
# then differ from a single text's by an ulp
pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = [
    "It is a truth universally acknowledged.",
    "A single man in possession of a good fortune must be in want of a wife!",
    "However little known the feelings or views of such a man may be on his first entering a neighbourhood, "
    "this truth is so well fixed in the minds of the surrounding families.",
    "views",
]


def _batch(tok, texts):
    enc = tok.backend.encode_batch(texts)
    width = max(len(e.ids) for e in enc)
    ids = torch.zeros(len(texts), width, dtype=torch.long)
    mask = torch.zeros(len(texts), width, dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, : len(e.ids)] = torch.tensor(e.ids)
        mask[i, : len(e.ids)] = 1
    return ids, mask


def _cos_min(a, b) -> float:
    return float(F.cosine_similarity(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]), dim=-1).min())


def _st_embeddings(path, texts) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(path), device="cpu")
    return st.encode(texts, convert_to_tensor=True, batch_size=len(texts)).float()


@pytest.mark.parametrize(
    "pooling,normalize",
    [(("mean",), True), (("cls",), False), (("max", "mean_sqrt_len_tokens", "lasttoken"), False)],
)
def test_fp_matches_transformers_and_sentence_transformers(tmp_path, pooling, normalize):
    path = make_bert(tmp_path / "m", "fp", pooling=pooling, normalize=normalize)
    model, tok = bitnetlm.load(path)
    assert isinstance(model, Encoder) and model.config.pooling == pooling
    ids, mask = _batch(tok, TEXTS)
    with torch.no_grad():
        ref = oracle_bert(path)(input_ids=ids, attention_mask=mask).last_hidden_state
        ours = model(ids, mask)
    real = mask.bool()
    assert torch.allclose(ours[real], ref[real], atol=1e-5, rtol=0)
    got, want = embed(model, tok, TEXTS), _st_embeddings(path, TEXTS)
    assert got.shape == want.shape == (len(TEXTS), 64 * len(pooling))
    assert _cos_min(got, want) > 1 - 1e-5
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    if normalize:
        assert torch.allclose(got.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-6)


@pytest.mark.parametrize("variant", ["online", "packed-autobitlinear", "packed-bitlinear"])
def test_ternary_matches_transformers_bitnet(tmp_path, variant):
    path = make_bert(tmp_path / "m", variant)
    model, tok = bitnetlm.load(path)
    assert model.config.quant == "ternary"
    ids, mask = _batch(tok, TEXTS)
    with torch.no_grad():
        ref = oracle_bert(path)(input_ids=ids, attention_mask=mask).last_hidden_state
        ours = model(ids, mask)
    real = mask.bool()
    # per-token int8 activations: a value at a rounding tie may round the other way in transformers' compiled
    # quantizer, so token vectors agree to a cosine, not bit for bit
    assert _cos_min(ours[real], ref[real]) > 1 - 1e-5
    assert _cos_min(embed(model, tok, TEXTS), _st_embeddings(path, TEXTS)) > 1 - 1e-5


@pytest.mark.parametrize("variant", ["fp", "packed-autobitlinear"])
def test_padding_invariance(tmp_path, variant):
    model, tok = bitnetlm.load(make_bert(tmp_path / "m", variant))
    batch = embed(model, tok, TEXTS)
    # ternary layers quantize their inputs to int8: the last-bit differences of a padded batch's float attention
    # (summed over other lengths) can move one activation across a rounding step, about 1e-4 in the output
    tol = 1e-6 if variant == "fp" else 1e-3
    for i, text in enumerate(TEXTS):
        assert torch.allclose(embed(model, tok, [text])[0], batch[i], atol=tol, rtol=0)


def test_truncation_keeps_special_tokens(tmp_path):
    from bitnetlm.embedding import tokenize

    path = make_bert(tmp_path / "m", "fp")
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8}))
    model, tok = bitnetlm.load(path)
    assert model.config.max_tokens == 8
    ids = tokenize(tok, [TEXTS[2]], 8)[0]
    full = tok.backend.encode(TEXTS[2]).ids
    assert ids == full[:7] + [full[-1]]  # [CLS] + 6 tokens + [SEP], as transformers truncates
    assert embed(model, tok, TEXTS).shape == (len(TEXTS), 64)


def test_saved_ternary_loads_in_transformers_and_back(tmp_path):
    from bitnetlm.formats.hf_bert import save_bert_hf

    model, tok = bitnetlm.load(make_bert(tmp_path / "m", "online", pooling=("cls",), normalize=False))
    out = save_bert_hf(model, tmp_path / "out", tokenizer=tok)
    again, tok2 = bitnetlm.load(out)
    assert again.config.pooling == ("cls",) and not again.config.normalize
    assert torch.allclose(embed(again, tok2, TEXTS), embed(model, tok, TEXTS), atol=1e-5, rtol=0)
    ids, mask = _batch(tok, TEXTS)
    with torch.no_grad():
        ref = oracle_bert(out)(input_ids=ids, attention_mask=mask).last_hidden_state
        got = again(ids, mask)
    real = mask.bool()
    assert _cos_min(got[real], ref[real]) > 1 - 1e-5


def test_bad_pooling_config_is_one_line(tmp_path):
    path = make_bert(tmp_path / "m", "fp")
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "weightedmean"}))
    with pytest.raises(
        ValueError, match=r"1_Pooling/config.json: pooling mode 'weightedmean' is not supported"
    ):
        bitnetlm.load(path)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}))
    mods = json.loads((path / "modules.json").read_text()) + [
        {"path": "3", "type": "sentence_transformers.models.Dense"}
    ]
    (path / "modules.json").write_text(json.dumps(mods))
    with pytest.raises(ValueError, match=r"modules.json: module type .*Dense.* is not supported"):
        bitnetlm.load(path)


def test_missing_tensor_and_bad_config_name_the_file(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_bert(tmp_path / "m", "fp")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "hidden_act": "swish"}))
    with pytest.raises(ValueError, match=r"config.json: field 'hidden_act' must be one of"):
        bitnetlm.load(path)
    (path / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(path / "model.safetensors"))
    del sd["encoder.layer.1.output.dense.bias"]
    save_file(sd, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"tensor 'encoder.layer.1.output.dense.bias' is missing"):
        bitnetlm.load(path)


def test_embed_refuses_what_is_no_model():
    with pytest.raises(ValueError, match="expected an encoder or a decoder model, found Linear"):
        embed(torch.nn.Linear(2, 2), None, ["hello"])


def _one_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_cli_embed_prints_the_library_vectors(tmp_path, capsys, monkeypatch):
    import io

    from bitnetlm.cli import main

    path = make_bert(tmp_path / "m", "packed-autobitlinear")
    text = tmp_path / "texts.txt"
    text.write_text("\n".join(TEXTS) + "\n")
    want = embed(*bitnetlm.load(path), TEXTS)
    assert main(["embed", "-m", str(path), str(text), "--json", "-t", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dimensions"] == 64 and torch.allclose(torch.tensor(doc["vectors"]), want, atol=1e-6, rtol=0)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(text.read_bytes())))
    assert main(["embed", "-m", str(path), "--normalize", "no"]) == 0
    rows = [[float(v) for v in line.split()] for line in capsys.readouterr().out.splitlines()]
    raw = embed(*bitnetlm.load(path), TEXTS, normalize=False)
    assert torch.allclose(torch.tensor(rows), raw, rtol=1e-6, atol=1e-6)


def test_cli_embed_errors_are_one_line(tmp_path, capsys):
    from bitnetlm.cli import main

    path = make_bert(tmp_path / "m", "fp")
    empty, binary, text = tmp_path / "empty.txt", tmp_path / "bin.txt", tmp_path / "t.txt"
    empty.write_text("")
    binary.write_bytes(b"caf\xe9\n")
    text.write_text("hello\n")
    capsys.readouterr()  # transformers' progress bars while writing the checkpoint
    cases = [
        (["embed", "-m", str(path), str(empty)], f"{empty}: no text to embed (expected one text per line)"),
        (["embed", "-m", str(path), str(binary)], f"{binary}: not UTF-8 text (byte 3)"),
        (["embed", "-m", str(path), str(tmp_path / "nope.txt")], "nope.txt"),
        (["embed", "-m", str(path), str(text), "-b", "0"], "batch_size must be a positive integer, found 0"),
    ]
    for argv, want in cases:
        assert main(argv) == 2
        line = _one_line(capsys.readouterr().err)
        assert line.startswith("bitnet embed: error: ") and want in line, line


def _gguf_reference(path):
    """What gguf's own tools say a llama.cpp `bert` file of the HF directory `path` holds: tensor names (its
    TensorNameMap) and special-token metadata (its SpecialVocab, which llama.cpp's converter runs)."""
    import gguf
    from safetensors import safe_open

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, 2)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        hf = [k for k in f.keys() if not k.startswith("pooler.") and k.endswith((".weight", ".bias"))]
    tensors = {names.get_name(k, try_suffixes=(".weight", ".bias")) for k in hf}
    sv = gguf.SpecialVocab(path, load_merges=False, n_vocab=160)
    key = {"unk": "unknown", "sep": "seperator", "pad": "padding"}
    special = {
        f"tokenizer.ggml.{key.get(k, k)}_token_id": v for k, v in sv.special_token_ids.items() if k != "cls"
    }
    special.update(
        {f"tokenizer.ggml.add_{k}_token": v for k, v in sv.add_special_token.items() if k in ("bos", "eos")}
    )
    return tensors, special


@pytest.mark.parametrize(
    "variant,qtype", [("fp", "f32"), ("packed-autobitlinear", "tq2_0"), ("online", "i2_s")]
)
def test_gguf_round_trip_with_llama_cpp_names(tmp_path, variant, qtype):
    from gguf import GGUFReader

    from bitnetlm.formats.gguf import save_gguf

    kw = (
        {"hidden_size": 256, "intermediate_size": 256} if qtype == "tq2_0" else {}
    )  # TQ2_0: rows of 256 values
    path = make_bert(tmp_path / "m", variant, pooling=("cls",), normalize=True, **kw)
    model, tok = bitnetlm.load(path)
    out = save_gguf(
        model,
        tmp_path / "m.gguf",
        qtype="tq2_0" if qtype == "f32" else qtype,
        tokenizer=tok,
        embed_type="f32" if qtype == "f32" else "auto",
    )
    if qtype == "i2_s":  # bitnet.cpp's type 36, which gguf's reader no longer knows
        from bitnetlm.formats.gguf_file import read_gguf

        f = read_gguf(out)
        meta, names = f.metadata, set(f.tensors)
    else:
        r = GGUFReader(str(out))
        meta, names = {f.name: f.contents() for f in r.fields.values()}, {t.name for t in r.tensors}
    tensors, special = _gguf_reference(path)
    assert names == tensors
    assert meta["general.architecture"] == "bert" and meta["bert.pooling_type"] == 2
    assert meta["bert.attention.causal"] is False and meta["tokenizer.ggml.model"] == "bert"
    assert {k: meta[k] for k in special} == special
    vocab = tok.backend.get_vocab()
    assert (
        meta["tokenizer.ggml.tokens"][vocab["##e"]] == "e"
        and meta["tokenizer.ggml.tokens"][vocab["the"]] == "\u2581the"
    )
    again, tok2 = bitnetlm.load(out)
    assert (
        again.config.pooling == ("cls",)
        and again.config.normalize
        and again.config.quant == model.config.quant
    )
    assert [e.ids for e in tok2.backend.encode_batch(TEXTS)] == [
        e.ids for e in tok.backend.encode_batch(TEXTS)
    ]
    ids, mask = _batch(tok, TEXTS)
    with torch.no_grad():
        want, got = model(ids, mask), again(ids, mask)
    real = mask.bool()
    if variant == "fp":
        assert torch.equal(got[real], want[real])
    else:  # the same ternary codes and scales; only the scale's float16 rounding in TQ2_0 / I2_S may differ
        assert _cos_min(got[real], want[real]) > 1 - 1e-5
    assert _cos_min(embed(again, tok2, TEXTS), embed(model, tok, TEXTS)) > 1 - 1e-5


def test_gguf_refuses_what_llama_cpp_cannot_hold(tmp_path):
    from bitnetlm.formats.gguf import save_gguf

    model, tok = bitnetlm.load(make_bert(tmp_path / "m", "fp", pooling=("max",)))
    with pytest.raises(ValueError, match="pooling max: a GGUF bert file holds one of mean, cls, lasttoken"):
        save_gguf(model, tmp_path / "a.gguf")
    model.config.pooling = ("mean",)
    tok.backend.normalizer = None
    with pytest.raises(ValueError, match="a cased tokenizer cannot be written"):
        save_gguf(model, tmp_path / "b.gguf", tokenizer=tok)
    assert not list(tmp_path.glob("*.gguf"))


def test_cli_convert_encoder_to_gguf_and_back(tmp_path, capsys):
    from bitnetlm.cli import main

    path = make_bert(tmp_path / "m", "packed-autobitlinear")  # 64 values a row: TQ2_0 cannot, I2_S can
    want = embed(*bitnetlm.load(path), TEXTS)
    assert main(["convert", str(path), str(tmp_path / "m.gguf")]) == 0
    assert main(["convert", str(tmp_path / "m.gguf"), str(tmp_path / "back")]) == 0
    for out in (tmp_path / "m.gguf", tmp_path / "back"):
        assert _cos_min(embed(*bitnetlm.load(out), TEXTS), want) > 1 - 1e-5
    capsys.readouterr()
    assert main(["convert", str(path), str(tmp_path / "m.onnx")]) == 2
    assert "ONNX export of an encoder is not supported" in _one_line(capsys.readouterr().err)


def test_a_tokenizer_files_fixed_padding_and_truncation_are_ignored(tmp_path):
    """all-MiniLM-L6-v2's tokenizer.json pads and truncates every text to 128 tokens; transformers applies neither
    unless a call asks, and an embedding of a padded text would differ from the text's own."""
    from oracle_bert import wordpiece

    from bitnetlm.text.tokenizer import Tokenizer

    tk = wordpiece()
    want = tk.encode(TEXTS[2]).ids
    tk.enable_truncation(8)
    tk.enable_padding(length=128, pad_id=0, pad_token="[PAD]")
    tk.save(str(tmp_path / "tokenizer.json"))
    assert json.loads((tmp_path / "tokenizer.json").read_text())["truncation"]["max_length"] == 8
    assert Tokenizer.from_dir(tmp_path).backend.encode(TEXTS[2]).ids == want


def test_inspect_an_encoder(tmp_path):
    from transformers import BertModel

    from bitnetlm.formats.gguf import save_gguf
    from bitnetlm.inspect import inspect_path

    path = make_bert(tmp_path / "m", "packed-autobitlinear")
    info = inspect_path(path)
    n = sum(
        p.numel() for name, p in BertModel.from_pretrained(path).named_parameters() if "pooler" not in name
    )
    assert info["architecture"] == "bert" and info["parameters"] == n
    assert (
        info["quantization"] == "ternary (autobitlinear, offline)"
        and info["ternary_parameters"] == 2 * 32768 + 64 * 64  # the file's: its packed pooler too
    )
    model, tok = bitnetlm.load(path)
    g = inspect_path(save_gguf(model, tmp_path / "m.gguf", "i2_s", tokenizer=tok))
    assert g["architecture"] == "bert (gguf: bert)" and g["quantization"] == "ternary (I2_S)"
