"""Tokenizer <-> GGUF metadata (tokenizer.ggml.*, tokenizer.chat_template).

Read: the metadata becomes a `tokenizers` tokenizer.json (+ a tokenizer_config.json with the chat template and
special tokens), built the way llama.cpp tokenizes: `gpt2` = byte-level BPE with the pre-tokenizer named by
`tokenizer.ggml.pre`; `llama` = SentencePiece-style BPE with byte fallback (merges from the file, or derived
from the scores). Write: the reverse, from a tokenizer.json + tokenizer_config.json.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from bitnetlm.formats.gguf_pretok import LLAMA3_SPLIT, QWEN2_SPLIT, pre_tokenizer_name

# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

LLAMA3_PRES = ("llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe", "falcon3", "pixtral")
SPLIT_PRES = {p: LLAMA3_SPLIT for p in LLAMA3_PRES} | {"qwen2": QWEN2_SPLIT}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the byte-level BPE alphabet)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a token into two vocabulary pieces,
    ordered by the merged token's score (best first), ties by the pieces' ids (as tokenizers' extractor)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for tok, _ in sorted(zip(tokens, scores), key=lambda x: -x[1]):
        local = []
        for i in range(1, len(tok)):
            a, b = tok[:i], tok[i:]
            if a in vocab and b in vocab:
                local.append((vocab[a], vocab[b], a, b))
        local.sort()
        merges.extend((a, b) for _, _, a, b in local)
    return merges


def _checked_tokens(meta: dict[str, Any], source: str) -> tuple[Any, list[str], list[int]]:
    """(tokenizer.ggml.model, tokens, token types) of the metadata; one-line errors when they are unusable."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise ValueError(
            f"{source}: no tokenizer in the GGUF metadata (tokenizer.ggml.model / tokens missing)"
        )
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{source}: tokenizer.ggml.tokens must be a list of strings")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{source}: {len(types)} token types for {len(tokens)} tokens")
    return kind, tokens, types


def _token_of(meta: dict[str, Any], tokens: list[str], key: str) -> str | None:
    """The token whose id metadata `tokenizer.ggml.<key>` holds (None if absent or out of range)."""
    i = meta.get(f"tokenizer.ggml.{key}")
    return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None


def _byte_level_bpe(meta: dict[str, Any], vocab: dict[str, int]):
    """A `gpt2` tokenizer: byte-level BPE with the pre-tokenizer llama.cpp names in tokenizer.ggml.pre."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre", "default")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in LLAMA3_PRES, fuse_unk=False)
    tk = Tokenizer(model)
    if pre in SPLIT_PRES:
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(SPLIT_PRES[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre == "smollm":  # llama.cpp: digits one by one, then the GPT-2 split
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    return tk


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str], vocab: dict[str, int], unk: str | None):
    """A `llama` tokenizer: SentencePiece-style BPE with byte fallback (merges from the file or the scores)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    merges_raw = meta.get("tokenizer.ggml.merges")
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in merges_raw] if merges_raw else _spm_merges(tokens, scores)
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    tk = Tokenizer(model)
    norms = [normalizers.Replace(" ", "\u2581")]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        norms.insert(0, normalizers.Prepend("\u2581"))
    tk.normalizer = normalizers.Sequence(norms)
    tk.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tk


def _add_typed_tokens(tk, tokens: list[str], types: list[int], alphabet: set[str] | None) -> None:
    """CONTROL tokens as special added tokens (byte-level: only those it can spell, or <...>), USER_DEFINED
    tokens as plain added tokens."""
    from tokenizers import AddedToken

    special = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types)
        if ty == CONTROL and (alphabet is None or set(t) <= alphabet or t.startswith("<"))
    ]
    user = [
        AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED
    ]
    if special:
        tk.add_special_tokens(special)
    if user:
        tk.add_tokens(user)


def _set_post_processor(tk, kind: str, vocab: dict[str, int], bos, eos, add_bos, add_eos) -> None:
    """BOS / EOS added by a template post-processor when the metadata asks for them (byte-level: offsets)."""
    from tokenizers import processors

    if (add_bos and bos) or (add_eos and eos):
        single = (f"{bos}:0 " if add_bos and bos else "") + "$A:0" + (f" {eos}:0" if add_eos and eos else "")
        pair = (
            single
            + (f" {bos}:1 " if add_bos and bos else " ")
            + "$B:1"
            + (f" {eos}:1" if add_eos and eos else "")
        )
        specials = [(t, vocab[t]) for t in {bos if add_bos else None, eos if add_eos else None} if t]
        tk.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    elif kind == "gpt2":
        tk.post_processor = processors.ByteLevel(trim_offsets=False)


def tokenizer_from_gguf_metadata(meta: dict[str, Any], source: str = "GGUF") -> tuple[Any, dict[str, Any]]:
    """(tokenizers.Tokenizer, tokenizer_config dict) described by GGUF metadata."""
    kind, tokens, types = _checked_tokens(meta, source)
    vocab = {t: i for i, t in enumerate(tokens)}
    bos, eos, unk, pad = (
        _token_of(meta, tokens, key)
        for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")
    )
    if kind == "bert":
        return wordpiece_from_metadata(meta, tokens, types, source)
    if kind == "gpt2":
        tk, alphabet = _byte_level_bpe(meta, vocab), set(_bytes_to_unicode().values())
    elif kind == "llama":
        tk, alphabet = _sentencepiece_bpe(meta, tokens, vocab, unk), None
    else:
        raise ValueError(
            f"{source}: tokenizer.ggml.model {kind!r} is not supported (supported: gpt2, llama, bert)"
        )
    _add_typed_tokens(tk, tokens, types, alphabet)
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    _set_post_processor(tk, kind, vocab, bos, eos, add_bos, add_eos)
    config: dict[str, Any] = {
        "add_bos_token": bool(add_bos),
        "add_eos_token": bool(add_eos),
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": pad,
        "model_max_length": meta.get(f"{meta.get('general.architecture')}.context_length", 4096),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tk, {k: v for k, v in config.items() if v is not None}


def tokenizer_files_from_gguf(meta: dict[str, Any], source: str = "GGUF") -> dict[str, str]:
    """{'tokenizer.json': ..., 'tokenizer_config.json': ...} text of the tokenizer in GGUF metadata."""
    tk, config = tokenizer_from_gguf_metadata(meta, source)
    return {
        "tokenizer.json": tk.to_str(),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False),
    }


def load_gguf_tokenizer(path: str | os.PathLike):
    """The tokenizer stored in a GGUF file as a bitnetlm Tokenizer (None if the file has none)."""
    from bitnetlm.formats.gguf_file import read_gguf

    f = read_gguf(path)
    if "tokenizer.ggml.tokens" not in f.metadata:
        return None
    from bitnetlm.text.tokenizer import Tokenizer

    tk, config = tokenizer_from_gguf_metadata(f.metadata, str(path))
    return Tokenizer.from_tokenizers(tk, config)


# ---- writing --------------------------------------------------------------------------------------


def _tokenizer_dir_files(tok) -> tuple[dict, dict]:
    """(tokenizer.json dict, tokenizer_config dict) from a directory path or an object with .save(dir)."""
    if isinstance(tok, (str, os.PathLike)):
        d = Path(tok)
        tj = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
        cfg_file = d / "tokenizer_config.json"
        tc = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
        return tj, tc
    with tempfile.TemporaryDirectory() as td:
        tok.save(td)
        return _tokenizer_dir_files(td)


def _token_str(v) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v


def _token_table(tj: dict, model: dict, cfg) -> tuple[dict[str, int], list[str], list[int]]:
    """(vocabulary with the added tokens, tokens by id, llama.cpp token types): ids no token holds (and any
    beyond, up to the model's vocab_size) become [PAD<i>] UNUSED; byte-fallback pieces <0xNN> are BYTE."""
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    added = {a["content"]: a for a in tj.get("added_tokens") or []}
    for a in added.values():
        vocab.setdefault(a["content"], a["id"])
    n = max(vocab.values()) + 1 if vocab else 0
    if cfg is not None and cfg.vocab_size > n:
        n = cfg.vocab_size
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [UNUSED] * n
    for t, i in vocab.items():
        tokens[i] = t
        a = added.get(t)
        types[i] = NORMAL if a is None else CONTROL if a.get("special") else USER_DEFINED
    if model.get("byte_fallback"):
        for i, t in enumerate(tokens):
            if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                types[i] = BYTE
    return vocab, tokens, types


def _merge_strings(kind: str, pairs: list[tuple]) -> list[str]:
    """tokenizer.ggml.merges ("a b"); none for a SentencePiece vocabulary whose pieces hold spaces."""
    if kind == "llama" and any(" " in a or " " in b for a, b in pairs):
        # "a b" cannot hold a piece with a space (Gemma's whitespace runs): the reader derives the merges from
        # the scores instead, as llama.cpp's SentencePiece converter leaves them out
        return []
    return [" ".join(p) for p in pairs]


def _merge_scores(pairs: list[tuple], tokens: list[str]) -> list[float]:
    """SentencePiece scores that order the merges: minus the rank of the first merge making each token."""
    rank = {}
    for r, (a, b) in enumerate(pairs):
        rank.setdefault(a + b, r)
    return [float(-rank.get(t, 0)) for t in tokens]


def _special_ids(tc: dict, vocab: dict[str, int], cfg) -> dict[str, int | None]:
    """BOS / EOS / UNK / PAD ids: tokenizer_config's tokens, else the model config's ids (the first of a list)."""

    def tid(name: str, fallback) -> int | None:
        t = _token_str(tc.get(name))
        if t is not None and t in vocab:
            return vocab[t]
        if isinstance(fallback, list):
            fallback = fallback[0] if fallback else None
        return fallback

    return {
        "bos_token_id": tid("bos_token", getattr(cfg, "bos_token_id", None)),
        "eos_token_id": tid("eos_token", getattr(cfg, "eos_token_id", None)),
        "unknown_token_id": tid("unk_token", None),
        "padding_token_id": tid("pad_token", getattr(cfg, "pad_token_id", None)),
    }


def _adds_bos(tj: dict, tc: dict, bos_tok: str | None) -> bool:
    """tokenizer_config's add_bos_token, else whether the post-processor's template inserts the BOS token."""
    add_bos = tc.get("add_bos_token")
    if add_bos is None:
        post = json.dumps(tj.get("post_processor") or {})
        add_bos = bool(bos_tok) and "TemplateProcessing" in post and json.dumps(bos_tok) in post
    return bool(add_bos)


def _default_chat_template(tc: dict) -> str | None:
    """The chat template, or the one named "default" of a list of named templates."""
    tmpl = tc.get("chat_template")
    if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, ...]
        tmpl = next((x.get("template") for x in tmpl if x.get("name") == "default"), None)
    return tmpl


def tokenizer_metadata(tok, cfg=None) -> tuple[dict[str, Any], dict[str, tuple[int, int | None]]]:
    """GGUF tokenizer metadata (and value types) for a tokenizer directory or bitnetlm Tokenizer."""
    from bitnetlm.formats.gguf_file import ARRAY, BOOL, FLOAT32, INT32, STRING, UINT32

    tj, tc = _tokenizer_dir_files(tok)
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"only BPE tokenizers can be written to GGUF, found {model.get('type')!r}")
    vocab, tokens, types = _token_table(tj, model, cfg)
    kind = "llama" if model.get("byte_fallback") else "gpt2"
    pairs = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []]
    merges = _merge_strings(kind, pairs)
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": kind,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
    }
    vtypes = {
        "tokenizer.ggml.tokens": (ARRAY, STRING),
        "tokenizer.ggml.token_type": (ARRAY, INT32),
    }
    if merges:  # GGUF has no empty arrays (gguf-py refuses them); readers treat a missing key as no merges
        meta["tokenizer.ggml.merges"] = merges
        vtypes["tokenizer.ggml.merges"] = (ARRAY, STRING)
    if kind == "gpt2":
        source = (
            str(Path(tok) / "tokenizer.json") if isinstance(tok, (str, os.PathLike)) else "tokenizer.json"
        )
        meta["tokenizer.ggml.pre"] = pre_tokenizer_name(tj, source)
    else:
        meta["tokenizer.ggml.scores"] = _merge_scores(pairs, tokens)
        vtypes["tokenizer.ggml.scores"] = (ARRAY, FLOAT32)
        meta["tokenizer.ggml.add_space_prefix"] = "Prepend" in json.dumps(tj.get("normalizer"))
        vtypes["tokenizer.ggml.add_space_prefix"] = (BOOL, None)
    ids = _special_ids(tc, vocab, cfg)
    for k, v in ids.items():
        if v is not None:
            meta[f"tokenizer.ggml.{k}"] = int(v)
            vtypes[f"tokenizer.ggml.{k}"] = (UINT32, None)
    bos_tok = tokens[ids["bos_token_id"]] if ids["bos_token_id"] is not None else None
    meta["tokenizer.ggml.add_bos_token"] = _adds_bos(tj, tc, bos_tok)
    meta["tokenizer.ggml.add_eos_token"] = bool(tc.get("add_eos_token", False))
    vtypes["tokenizer.ggml.add_bos_token"] = (BOOL, None)
    vtypes["tokenizer.ggml.add_eos_token"] = (BOOL, None)
    tmpl = _default_chat_template(tc)
    if tmpl:
        meta["tokenizer.chat_template"] = tmpl
        vtypes["tokenizer.chat_template"] = (STRING, None)
    return meta, vtypes


def wordpiece_from_metadata(meta: dict[str, Any], tokens: list[str], types: list[int], source: str):
    """(tokenizers.Tokenizer, tokenizer_config dict) of a `bert` tokenizer in GGUF metadata."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    def unphantom(t: str, ty: int) -> str:
        if ty == CONTROL or (t.startswith("[") and t.endswith("]")):
            return t
        return t[1:] if t.startswith("\u2581") else "##" + t

    words = [unphantom(t, ty) for t, ty in zip(tokens, types)]
    vocab = {}
    for i, w in enumerate(words):
        vocab.setdefault(w, i)

    def tok_of(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return words[i] if isinstance(i, int) and 0 <= i < len(words) else None

    cls, sep, unk = tok_of("bos"), tok_of("eos"), tok_of("unknown")
    if unk is None:
        raise ValueError(
            f"{source}: tokenizer.ggml.unknown_token_id is missing (WordPiece needs an unknown token)"
        )
    tk = Tokenizer(
        models.WordPiece(
            vocab=vocab, unk_token=unk, continuing_subword_prefix="##", max_input_chars_per_word=100
        )
    )
    tk.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece(prefix="##")
    tk.add_special_tokens([w for w, ty in zip(words, types) if ty == CONTROL])
    add_bos, add_eos = (
        meta.get("tokenizer.ggml.add_bos_token", True),
        meta.get("tokenizer.ggml.add_eos_token", True),
    )
    parts = ([cls] if add_bos and cls else []), ([sep] if add_eos and sep else [])
    if parts[0] or parts[1]:
        single = " ".join([*(f"{t}:0" for t in parts[0]), "$A:0", *(f"{t}:0" for t in parts[1])])
        pair = single + " " + " ".join(["$B:1", *(f"{t}:1" for t in parts[1])])
        specials = [(t, vocab[t]) for t in {*parts[0], *parts[1]}]
        tk.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    config = {
        "tokenizer_class": "BertTokenizer",
        "do_lower_case": True,
        "cls_token": cls,
        "sep_token": sep,
        "unk_token": unk,
        "pad_token": tok_of("padding"),
        "mask_token": tok_of("mask"),
        "model_max_length": meta.get("bert.context_length", 512),
    }
    return tk, {k: v for k, v in config.items() if v is not None}
