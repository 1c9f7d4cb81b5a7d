"""`bitnetlm.embed`: sentence embeddings from an encoder, batched with padding, pooled and normalised as the
model's sentence-transformers files say."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from bitnetlm.models.bert import Encoder, pool
from bitnetlm.models.transformer import CausalLM


def _is_encoder(model) -> bool:
    return isinstance(model, Encoder)


def tokenize(tokenizer, texts: Sequence[str], max_tokens: int) -> list[list[int]]:
    """Token ids of each text with the tokenizer's special tokens ([CLS] ... [SEP]), the text cut so that the
    whole fits `max_tokens` (as transformers truncates: the special tokens are kept)."""
    backend = tokenizer.backend
    out = []
    for text, enc in zip(texts, backend.encode_batch(list(texts), add_special_tokens=True)):
        if len(enc.ids) > max_tokens:
            plain = backend.encode(text, add_special_tokens=False)
            plain.truncate(max(max_tokens - backend.num_special_tokens_to_add(False), 0))
            enc = backend.post_process(plain, None, True)
        out.append(enc.ids)
    return out


def _pad_id(model: Encoder, tokenizer) -> int:
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = model.config.pad_token_id
    return int(pad or 0)


def embed(
    model: Encoder,
    tokenizer,
    texts: str | Sequence[str],
    *,
    batch_size: int = 32,
    normalize: bool | None = None,
) -> torch.Tensor:
    """Sentence embeddings of `texts` as a float32 tensor [N, D] on the CPU (one row per text, in order).

    Texts are batched by length with right padding (the attention mask keeps a text's vector what it is alone),
    cut to the model's max_seq_length, pooled per the model's config (CLS / mean / max / last token) and
    L2-normalised when the model has a Normalize module (`normalize` overrides that)."""
    if isinstance(model, CausalLM):
        return embed_decoder(model, tokenizer, texts, batch_size=batch_size, normalize=normalize)
    if not _is_encoder(model):
        raise ValueError(f"embed: expected an encoder or a decoder model, found {type(model).__name__}")
    if tokenizer is None:
        raise ValueError("embed: the model has no tokenizer (tokenizer.json next to config.json)")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"embed: batch_size must be a positive integer, found {batch_size!r}")
    cfg = model.config
    ids = tokenize(tokenizer, texts, cfg.max_tokens)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out = torch.empty(len(ids), cfg.embedding_dim, dtype=torch.float32)
    device = next(model.parameters()).device
    pad = _pad_id(model, tokenizer)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            width = max(len(ids[i]) for i in rows)
            x = torch.full((len(rows), width), pad, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for r, i in enumerate(rows):
                x[r, : len(ids[i])] = torch.tensor(ids[i])
                mask[r, : len(ids[i])] = 1
            x, mask = x.to(device), mask.to(device)
            out[rows] = pool(model(x, mask), mask, cfg.pooling).float().cpu()
    if cfg.normalize if normalize is None else normalize:
        out = F.normalize(out, p=2, dim=-1)
    return out


# ---- decoders, and what every model's vectors share (the server's route too) ---------------------------
DECODER_POOLING = ("lasttoken",)  # as sentence-transformers and vLLM pool decoder embedders (Qwen3-Embedding)


@dataclass(frozen=True)
class EmbedSpec:
    """How a model's token vectors become a sentence vector: the pooling modes (concatenated), whether it is
    L2-normalised, and the sizes it may be cut to (Matryoshka: False none, True any, or those listed)."""

    pooling: tuple[str, ...] = DECODER_POOLING
    normalize: bool = True
    matryoshka: bool | tuple[int, ...] = False
    error: str | None = None  # why the model's files give no usable spec (it still generates)

    def check(self) -> EmbedSpec:
        """This spec; ValueError with the reason when the model's files gave none."""
        if self.error is not None:
            raise ValueError(self.error)
        return self


_specs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> EmbedSpec read at load


def configure(model, spec: EmbedSpec) -> None:
    """Record the EmbedSpec of `model` (read from its files by `bitnetlm.load`)."""
    _specs[model] = spec


def spec_for(model) -> EmbedSpec:
    """The model's EmbedSpec: an encoder pools as its config says; a decoder by its sentence-transformers files
    when it was loaded with them, else its last token, L2-normalised."""
    got = _specs.get(model, EmbedSpec())
    if _is_encoder(model):
        return EmbedSpec(tuple(model.config.pooling), bool(model.config.normalize), got.matryoshka)
    return got


def read_spec(path: Path, encoder: bool) -> EmbedSpec:
    """The EmbedSpec of model directory `path`: pooling and Normalize from modules.json (a decoder's; an
    encoder's config has them), Matryoshka sizes from config.json's `is_matryoshka` / `matryoshka_dimensions`
    (as vLLM reads them). A decoder whose files are unusable for embeddings still loads: its spec carries the
    reason, raised when it is asked for embeddings."""
    try:
        return _read_spec(path, encoder)
    except (ValueError, FileNotFoundError) as e:
        if encoder:
            raise
        return EmbedSpec(error=str(e))


def _read_spec(path: Path, encoder: bool) -> EmbedSpec:
    from bitnetlm.formats.hf_bert import _json, _sentence_modules

    spec = EmbedSpec()
    if not encoder and (path / "modules.json").is_file():
        spec = EmbedSpec(*_sentence_modules(path))
    file = path / "config.json"
    raw = _json(file) if file.is_file() else {}
    raw = raw if isinstance(raw, dict) else {}
    dims, flag = raw.get("matryoshka_dimensions"), raw.get("is_matryoshka")
    if dims is not None:
        if not (isinstance(dims, list) and dims and all(type(d) is int and d > 0 for d in dims)):
            raise ValueError(
                f"{file}: field 'matryoshka_dimensions' must be a list of positive integers, found {dims!r:.80}"
            )
        return replace(spec, matryoshka=tuple(sorted(set(dims))))
    if flag is not None and not isinstance(flag, bool):
        raise ValueError(f"{file}: field 'is_matryoshka' must be true or false, found {flag!r:.80}")
    return replace(spec, matryoshka=bool(flag))


def max_tokens(model) -> int:
    """The most tokens one text may have."""
    return model.config.max_tokens if _is_encoder(model) else model.config.max_position_embeddings


def batches(lengths: Sequence[int], max_rows: int, max_padded: int | None = None) -> list[list[int]]:
    """Indices of texts in batches of similar length (shortest first): at most `max_rows` rows and, where
    `max_padded` is given, at most that many tokens with the padding (one text alone may exceed it)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out: list[list[int]] = []
    for i in order:
        cur = out[-1] if out else None
        if cur and len(cur) < max_rows and (max_padded is None or lengths[i] * (len(cur) + 1) <= max_padded):
            cur.append(i)
        else:
            out.append([i])
    return out


def pooled(model, rows: Sequence[Sequence[int]], pooling: tuple[str, ...], pad_id: int = 0) -> torch.Tensor:
    """Pooled, unnormalised vectors [len(rows), D] (float32, CPU) of one batch of token-id lists, right-padded
    with `pad_id` (any id in the vocabulary: the padding is masked out).

    A decoder runs without a KV cache (its forward touches no runner state): causal attention with the padding
    masked out, each row's positions counted from its own first token, so a row's vector is what it is alone."""
    device = next(model.parameters()).device
    width = max(len(r) for r in rows)
    x = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, ids in enumerate(rows):
        x[r, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
        mask[r, : len(ids)] = True
    x, mask = x.to(device), mask.to(device)
    with torch.inference_mode():
        if _is_encoder(model):
            h = model(x, mask.long())
        else:
            positions = (mask.long().cumsum(1) - 1).clamp(min=0)
            h = model.hidden_states(x, positions, mask)
        return pool(h, mask.long(), pooling).float().cpu()


def finish(vectors: torch.Tensor, normalize: bool, dimensions: int | None = None) -> torch.Tensor:
    """Vectors cut to their first `dimensions` (Matryoshka), then L2-normalised where `normalize`."""
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    return F.normalize(vectors, p=2, dim=-1) if normalize else vectors


def embed_decoder(
    model: CausalLM,
    tokenizer,
    texts: str | Sequence[str],
    *,
    batch_size: int = 32,
    normalize: bool | None = None,
) -> torch.Tensor:
    """`embed` for a decoder: the final hidden state (after the final norm) pooled per `spec_for(model)`
    (the last token unless its sentence-transformers files say otherwise), L2-normalised unless they say not
    to (`normalize` overrides that). Texts longer than the model's context are cut to it."""
    if tokenizer is None:
        raise ValueError("embed: the model has no tokenizer (tokenizer.json next to config.json)")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"embed: batch_size must be a positive integer, found {batch_size!r}")
    spec = spec_for(model).check()
    ids = tokenize(tokenizer, texts, max_tokens(model))
    if any(len(i) == 0 for i in ids):
        raise ValueError("embed: a text has no tokens (an empty text and a tokenizer that adds none)")
    out = torch.empty(len(ids), model.config.hidden_size * len(spec.pooling), dtype=torch.float32)
    for rows in batches([len(i) for i in ids], batch_size):
        out[rows] = pooled(model, [ids[i] for i in rows], spec.pooling)
    return finish(out, spec.normalize if normalize is None else normalize)
