"""Tiny BERT checkpoints written by transformers itself (full precision, online ternary, offline packed), with a
WordPiece tokenizer trained by `tokenizers` and sentence-transformers' module files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from oracle import BPE_TEXT
from safetensors.torch import load_file, save_file

BERT_VARIANTS = ("fp", "online", "packed-autobitlinear", "packed-bitlinear")
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def wordpiece(vocab_size: int = 160):
    """A BERT WordPiece tokenizer (lower-casing normalizer, [CLS] ... [SEP] template) trained on real text."""
    from tokenizers.implementations import BertWordPieceTokenizer

    tok = BertWordPieceTokenizer(lowercase=True)
    from tokenizers import processors

    tok.train_from_iterator(
        [BPE_TEXT] * 4, vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False
    )
    t = tok._tokenizer
    cls, sep = t.token_to_id("[CLS]"), t.token_to_id("[SEP]")
    t.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return t


def _reinit(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.copy_((1 if name.endswith("weight") else 0) + 0.1 * torch.randn(p.shape, generator=g))
            elif "embeddings" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def write_sentence_files(
    path: Path, pooling, normalize: bool, hidden: int, max_seq_length: int | None = None
):
    mods = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        mods.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(mods))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": hidden, "pooling_mode": list(pooling)})
    )
    if max_seq_length:
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))


def make_bert(
    path: Path, variant: str = "fp", pooling=("mean",), normalize: bool = True, seed: int = 0, **kw
) -> Path:
    """Write a tiny BertModel directory in `variant`; returns it (transformers and sentence-transformers load it)."""
    from transformers import BertConfig, BertModel

    path = Path(path)
    tok = wordpiece()
    cfg = dict(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    cfg.update(kw)
    torch.manual_seed(seed)
    model = BertModel(BertConfig(**cfg))
    _reinit(model, seed)
    model.save_pretrained(path)
    from bitnetlm.text.tokenizer import Tokenizer

    Tokenizer.from_tokenizers(
        tok,
        {
            "tokenizer_class": "BertTokenizer",
            "cls_token": "[CLS]",
            "sep_token": "[SEP]",
            "pad_token": "[PAD]",
            "unk_token": "[UNK]",
            "mask_token": "[MASK]",
            "do_lower_case": True,
        },
    ).save(path)
    write_sentence_files(path, pooling, normalize, cfg["hidden_size"])
    if variant != "fp":
        _ternary(path, variant)
    return path


def _ternary(path: Path, variant: str) -> None:
    from transformers.integrations.bitnet import pack_weights

    cfg = json.loads((path / "config.json").read_text())
    if variant == "online":
        qc = {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "online"}
    else:
        linear_class = variant.removeprefix("packed-")
        qc = {"quant_method": "bitnet", "linear_class": linear_class, "quantization_mode": "offline"}
        sd, out = load_file(str(path / "model.safetensors")), {}
        for k, v in sd.items():
            if k.endswith(".weight") and v.ndim == 2 and not k.startswith("embeddings."):
                w = v.float()
                s = w.abs().mean().clamp(min=1e-5)
                out[k] = pack_weights((w / s).round().clamp(-1, 1).to(torch.int8).clone())
                out[k.removesuffix(".weight") + ".weight_scale"] = (
                    s if linear_class == "autobitlinear" else 1 / s
                ).reshape(1)
            else:
                out[k] = v
        save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def oracle_bert(path: Path):
    from transformers import BertModel

    return BertModel.from_pretrained(path, dtype=torch.float32).eval()
