"""GGUF files of BERT-family encoders: llama.cpp's `bert` architecture, tensor names and WordPiece tokenizer.

Tensors (gguf's MODEL_TENSOR names for MODEL_ARCH.BERT): token_embd, token_types, position_embd,
token_embd_norm, blk.N.{attn_q, attn_k, attn_v, attn_output, attn_output_norm, ffn_up, ffn_down,
layer_output_norm}, each with its .bias. Ternary projections are TQ1_0 / TQ2_0 / I2_S (W = T*s) with float biases
added after the scale, as ggml computes them; everything else is float.
Tokenizer (tokenizer.ggml.model "bert"), as llama.cpp's converter writes it: WordPiece tokens in "phantom space"
form ("##ing" -> "ing", "word" -> "\u2581word", "[CLS]"-style specials kept), [CLS] / [SEP] as bos / eos and
seperator, add_bos / add_eos from the [CLS] $A [SEP] template. llama.cpp's WordPiece always lower-cases, so only
lower-casing tokenizers are written. Sentence pooling is `bert.pooling_type` (mean 1, cls 2, last token 3);
L2 normalisation and max_seq_length have no llama.cpp key and travel as bitnetlm.embedding.* metadata.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from bitnetlm.formats import gguf_codecs as codecs
from bitnetlm.formats.gguf_file import GGUFError, GGUFFile, TensorToWrite, write_gguf
from bitnetlm.formats.names import bert_modules
from bitnetlm.models import build_empty_encoder
from bitnetlm.models.bert import Encoder, EncoderConfig
from bitnetlm.quant.bitlinear import BitLinear
from bitnetlm.quant.packing import PackingFormat

ARCH = "bert"
POOLING_TYPES = {"mean": 1, "cls": 2, "lasttoken": 3}  # llama.cpp's enum llama_pooling_type
_HF_TO_GGUF = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.position_embeddings": "position_embd",
    "embeddings.token_type_embeddings": "token_types",
    "embeddings.LayerNorm": "token_embd_norm",
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
_UINT32, _BOOL = 4, 7


def gguf_names(num_layers: int):
    """Yield (our module name, GGUF tensor name without .weight, kind) for every module of an encoder."""
    for ours, hf, kind in bert_modules(num_layers):
        if hf.startswith("encoder.layer."):
            _, _, i, rest = hf.split(".", 3)
            yield ours, f"blk.{i}.{_HF_TO_GGUF[rest]}", kind
        else:
            yield ours, _HF_TO_GGUF[hf], kind


# ---- writing --------------------------------------------------------------------------------------


def save_bert_gguf(
    model: Encoder, path: str | os.PathLike, qtype: str = "tq2_0", tokenizer=None, embed_type: str = "auto"
) -> Path:
    """Write an encoder as a llama.cpp `bert` GGUF file (atomically), tokenizer included when given."""
    from bitnetlm.formats.gguf_tensors import GGML_QUANT_VERSION, GGUF_FORMAT_VERSION

    cfg = model.config
    ternary = cfg.quant == "ternary"
    qkey = qtype.lower()
    if ternary and qkey not in codecs.TERNARY_TYPES:
        raise ValueError(
            f"--type must be one of {sorted(codecs.TERNARY_TYPES)} for a ternary model, got {qtype!r}"
        )
    if len(cfg.pooling) != 1 or cfg.pooling[0] not in POOLING_TYPES:
        raise ValueError(
            f"pooling {'+'.join(cfg.pooling)}: a GGUF bert file holds one of {', '.join(POOLING_TYPES)}"
        )
    if cfg.hidden_act != "gelu":
        raise ValueError(f"hidden_act {cfg.hidden_act!r}: llama.cpp's bert runs GELU (erf) only")
    tensors = [
        t
        for name, g, kind in gguf_names(cfg.num_hidden_layers)
        for t in _tensors(model, name, g, kind, qkey, embed_type)
    ]
    p = ARCH
    meta: dict[str, Any] = {
        "general.name": getattr(model, "name", None) or f"bert {cfg.num_hidden_layers}L {cfg.hidden_size}d",
        f"{p}.context_length": cfg.max_position_embeddings,
        f"{p}.embedding_length": cfg.hidden_size,
        f"{p}.feed_forward_length": cfg.intermediate_size,
        f"{p}.block_count": cfg.num_hidden_layers,
        f"{p}.attention.head_count": cfg.num_attention_heads,
        f"{p}.attention.layer_norm_epsilon": float(cfg.layer_norm_eps),
        f"{p}.attention.causal": False,
        f"{p}.pooling_type": POOLING_TYPES[cfg.pooling[0]],
        "bitnetlm.embedding.normalize": bool(cfg.normalize),
        "bitnetlm.format_version": GGUF_FORMAT_VERSION,
        "general.quantization_version": GGML_QUANT_VERSION,
    }
    types = {k: (_UINT32, None) for k in meta if isinstance(meta[k], int) and not isinstance(meta[k], bool)}
    types.update({k: (_BOOL, None) for k in meta if isinstance(meta[k], bool)})
    if cfg.max_seq_length:
        meta["bitnetlm.embedding.max_seq_length"] = cfg.max_seq_length
        types["bitnetlm.embedding.max_seq_length"] = (_UINT32, None)
    if ternary:
        meta["general.file_type"] = {"tq1_0": 36, "tq2_0": 37, "i2_s": 40}[qkey]  # llama_ftype MOSTLY_*
        types["general.file_type"] = (_UINT32, None)
    if tokenizer is not None:
        tmeta, ttypes = wordpiece_metadata(tokenizer, cfg)
        meta.update(tmeta)
        types.update(ttypes)
    path = Path(path)
    write_gguf(path, ARCH, meta, tensors, value_types=types)
    return path


def _tensors(model: Encoder, name: str, g: str, kind: str, qkey: str, embed_type: str) -> list[TensorToWrite]:
    from bitnetlm.formats.gguf_tensors import FLOAT_TYPES, float_entry, smallest_lossless, ternary_entry

    m = model.get_submodule(name)
    out = []
    if isinstance(m, BitLinear):
        out.append(ternary_entry(g + ".weight", m, qkey))
    elif kind == "embed":
        w = m.weight
        tid = smallest_lossless(w) if embed_type == "auto" else FLOAT_TYPES[embed_type]
        out.append(float_entry(g + ".weight", w, tid))
    elif kind == "proj":
        tid = FLOAT_TYPES["f16" if embed_type == "auto" else embed_type]
        out.append(float_entry(g + ".weight", m.weight, tid))
    else:
        out.append(float_entry(g + ".weight", m.weight, codecs.TYPE_F32))
    if kind != "embed":
        out.append(float_entry(g + ".bias", m.bias, codecs.TYPE_F32))
    return out


def _phantom(token: str) -> str:
    """llama.cpp's converter: WordPiece continuations lose '##', word starts get the phantom space."""
    if token.startswith("[") and token.endswith("]"):
        return token
    return token[2:] if token.startswith("##") else "\u2581" + token


def _lowercases(normalizer) -> bool:
    text = json.dumps(normalizer or {})
    return '"lowercase": true' in text or '"Lowercase"' in text


def _wordpiece_vocab(tj: dict) -> tuple[dict[str, int], dict[str, dict]]:
    """A lower-casing WordPiece tokenizer.json's (token -> id with the added tokens, added tokens by content)."""
    model = tj.get("model") or {}
    if model.get("type") != "WordPiece":
        raise ValueError(f"tokenizer: a bert GGUF holds a WordPiece tokenizer, found {model.get('type')!r}")
    if not _lowercases(tj.get("normalizer")):
        raise ValueError(
            "tokenizer: llama.cpp's WordPiece lower-cases every text; a cased tokenizer cannot be written"
        )
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    added = {a["content"]: a for a in tj.get("added_tokens") or []}
    for a in added.values():
        vocab.setdefault(a["content"], a["id"])
    return vocab, added


def _token_table(
    vocab: dict[str, int], added: dict[str, dict], cfg: EncoderConfig | None
) -> tuple[list, list]:
    """(tokens in phantom-space form, token types) by id; ids no token holds are unused [PADi] tokens."""
    from bitnetlm.formats.gguf_tokenizer import CONTROL, NORMAL, UNUSED, USER_DEFINED

    n = max(max(vocab.values()) + 1, cfg.vocab_size if cfg else 0)
    tokens, types = [f"[PAD{i}]" for i in range(n)], [UNUSED] * n
    for t, i in vocab.items():
        a = added.get(t)
        tokens[i] = _phantom(t)
        types[i] = NORMAL if a is None else CONTROL if a.get("special") else USER_DEFINED
    return tokens, types


def _special_ids(tc: dict, vocab: dict[str, int], meta: dict[str, Any], vtypes: dict[str, tuple]) -> dict:
    """Adds the special tokens' ids that the vocabulary holds to meta and vtypes; returns the special tokens by
    name (bos / eos: cls / sep where the config names none)."""
    from bitnetlm.formats.gguf_tokenizer import _token_str

    named = {k: _token_str(tc.get(f"{k}_token")) for k in ("cls", "sep", "unk", "pad", "mask", "bos", "eos")}
    named["bos"], named["eos"] = (
        named["bos"] or named["cls"],
        named["eos"] or named["sep"],
    )  # as gguf's SpecialVocab
    keys = {
        "bos": "bos",
        "eos": "eos",
        "unk": "unknown",
        "sep": "seperator",
        "pad": "padding",
        "mask": "mask",
    }
    for k, key in keys.items():
        if named[k] in vocab:
            meta[f"tokenizer.ggml.{key}_token_id"] = vocab[named[k]]
            vtypes[f"tokenizer.ggml.{key}_token_id"] = (_UINT32, None)
    return named


def _add_edge_flags(tj: dict, named: dict, meta: dict[str, Any], vtypes: dict[str, tuple]) -> None:
    """Adds add_bos_token / add_eos_token to meta and vtypes: whether the single-text template starts (ends)
    with the bos (eos) or cls (sep) token."""
    single = (tj.get("post_processor") or {}).get("single") or []
    edges = {"bos": single[0] if single else {}, "eos": single[-1] if single else {}}
    for k, alias in (("bos", "cls"), ("eos", "sep")):  # the template's first / last special token
        first = edges[k].get("SpecialToken", {}).get("id")
        meta[f"tokenizer.ggml.add_{k}_token"] = first is not None and first in (named[k], named[alias])
        vtypes[f"tokenizer.ggml.add_{k}_token"] = (_BOOL, None)


def wordpiece_metadata(tok, cfg: EncoderConfig | None = None) -> tuple[dict[str, Any], dict[str, tuple]]:
    """GGUF tokenizer metadata (and value types) of a WordPiece tokenizer, as llama.cpp's converter writes it."""
    from bitnetlm.formats.gguf_file import ARRAY, INT32, STRING
    from bitnetlm.formats.gguf_tokenizer import _tokenizer_dir_files

    tj, tc = _tokenizer_dir_files(tok)
    vocab, added = _wordpiece_vocab(tj)
    tokens, types = _token_table(vocab, added, cfg)
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "bert",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.token_type_count": cfg.type_vocab_size if cfg else 2,
    }
    vtypes: dict[str, tuple] = {
        "tokenizer.ggml.tokens": (ARRAY, STRING),
        "tokenizer.ggml.token_type": (ARRAY, INT32),
        "tokenizer.ggml.token_type_count": (_UINT32, None),
    }
    named = _special_ids(tc, vocab, meta, vtypes)
    _add_edge_flags(tj, named, meta, vtypes)
    return meta, vtypes


# ---- reading --------------------------------------------------------------------------------------


def encoder_config_from_gguf(f: GGUFFile) -> EncoderConfig:
    from bitnetlm.formats.gguf_arch import _check_blocks, _meta

    hidden = _meta(f, "embedding_length", required=True)
    n_layers = _meta(f, "block_count", required=True)
    _check_blocks(f, n_layers)
    shapes = {}
    for g in ("token_embd", "position_embd", "token_types"):
        ti = f.tensors.get(g + ".weight")
        if ti is None:
            raise GGUFError(f"{f.path}: tensor '{g}.weight' is missing")
        shapes[g] = ti.shape[0]
    pooling = _meta(f, "pooling_type", 1)
    modes = {v: k for k, v in POOLING_TYPES.items()}
    if pooling not in modes:
        raise GGUFError(
            f"{f.path}: metadata 'bert.pooling_type' is {pooling}; supported: 1 (mean), 2 (cls), 3 (last)"
        )
    ternary = any(ti.type_id in codecs.TYPE_NAMES for ti in f.tensors.values())
    try:
        return EncoderConfig(
            vocab_size=shapes["token_embd"],
            hidden_size=hidden,
            intermediate_size=_meta(f, "feed_forward_length", required=True),
            num_hidden_layers=n_layers,
            num_attention_heads=_meta(f, "attention.head_count", required=True),
            max_position_embeddings=shapes["position_embd"],
            type_vocab_size=shapes["token_types"],
            layer_norm_eps=float(_meta(f, "attention.layer_norm_epsilon", 1e-12, kind=float)),
            pad_token_id=f.metadata.get("tokenizer.ggml.padding_token_id"),
            quant="ternary" if ternary else "none",
            pooling=(modes[pooling],),
            # llama.cpp's embedding tools L2-normalise by default
            normalize=bool(f.metadata.get("bitnetlm.embedding.normalize", True)),
            max_seq_length=f.metadata.get("bitnetlm.embedding.max_seq_length"),
        )
    except ValueError as e:
        raise GGUFError(f"{f.path}: {e}") from None


def load_bert_gguf(f: GGUFFile, mode: str = "infer", dtype: torch.dtype = torch.float32) -> Encoder:
    """An encoder from an open `bert` GGUF file (CPU); ternary tensors become packed BitLinear weights."""
    from bitnetlm.formats.gguf_tensors import float_tensor, projection

    cfg = encoder_config_from_gguf(f)
    model = build_empty_encoder(cfg, mode)
    sd, used = {}, set()
    for name, g, kind in gguf_names(cfg.num_hidden_layers):
        module = model.get_submodule(name)
        used.add(g + ".weight")
        if kind == "proj":
            shape = (module.out_features, module.in_features)
            sd.update(projection(f, g + ".weight", name, module, shape, cfg, False, dtype, False))
        else:
            sd[name + ".weight"] = float_tensor(f, g + ".weight", tuple(module.weight.shape), dtype)
        if kind != "embed":
            used.add(g + ".bias")
            bdtype = torch.float32 if isinstance(module, BitLinear) else dtype
            n = module.out_features if kind == "proj" else module.weight.shape[0]
            sd[name + ".bias"] = float_tensor(f, g + ".bias", (n,), bdtype)
    extra = sorted(set(f.tensors) - used)
    if extra:
        raise GGUFError(f"{f.path}: unexpected tensors for a bert model: {extra[:5]}")
    model.load_state_dict(sd, strict=True, assign=True)
    for m in model.modules():
        if isinstance(m, BitLinear) and not m.training_mode:
            m.layout = PackingFormat.HF_2BIT
    model.source_metadata = {"format": "gguf", "path": str(f.path)}
    return model.eval() if mode != "train" else model
