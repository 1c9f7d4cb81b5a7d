"""`bitnetlm.embed`: sentence embeddings from an encoder, batched with padding, pooled and normalised as the
model's sentence-transformers files say."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from bitnetlm.models.bert import Encoder, pool


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
    if not _is_encoder(model):
        raise ValueError(f"embed: expected an encoder model (BERT family), found {type(model).__name__}")
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
