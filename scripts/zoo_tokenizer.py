#!/usr/bin/env python3
"""Train the bitnet-tiny BPE tokenizer (byte-level, 8192 ids) on the zoo's English training split.

Reads .assets/corpora/split/train/*.txt and wordnet_chat.jsonl (scripts/fetch_corpora.py makes them; never the
held-out files) and writes tokenizer.json + tokenizer_config.json (ChatML chat template) into --out.

Usage: python scripts/zoo_tokenizer.py [--split .assets/corpora/split] [--out bitnetlm/zoo/bundled/bitnet-tiny]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def render_chat(messages: list[dict]) -> str:
    """The ChatML text of a conversation, exactly as CHAT_TEMPLATE renders it."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def training_documents(split: str) -> dict[str, str]:
    """Name -> text of every training source; chats rendered with the chat template, docs joined by EOT."""
    docs = {}
    for p in sorted(glob.glob(os.path.join(split, "train", "*.txt"))):
        with open(p, encoding="utf-8") as f:
            docs[os.path.basename(p)[:-4]] = f.read()
    chat_path = os.path.join(split, "train", "wordnet_chat.jsonl")
    if os.path.exists(chat_path):
        with open(chat_path, encoding="utf-8") as f:
            chats = [render_chat(json.loads(line)["messages"]) for line in f]
        docs["wordnet_chat"] = "<|endoftext|>".join(chats)
    if not docs:
        raise FileNotFoundError(f"no training text under {split}/train; run scripts/fetch_corpora.py first")
    return docs


def train_tokenizer(docs: dict[str, str], vocab_size: int = 8192):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def chunks():
        for text in docs.values():
            for piece in text.split("<|endoftext|>"):
                for i in range(0, len(piece), 1 << 16):
                    yield piece[i : i + (1 << 16)]

    tok.train_from_iterator(chunks(), trainer=trainer)
    return tok


def write(tok, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json.tmp"))
    os.replace(os.path.join(out, "tokenizer.json.tmp"), os.path.join(out, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out, "tokenizer_config.json.tmp"), "w") as f:
        json.dump(cfg, f, indent=2)
    os.replace(os.path.join(out, "tokenizer_config.json.tmp"), os.path.join(out, "tokenizer_config.json"))
    sp = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump(sp, f, indent=2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", default=".assets/corpora/split", help="split dir from fetch_corpora.py")
    ap.add_argument("--out", default="bitnetlm/zoo/bundled/bitnet-tiny", help="output directory")
    ap.add_argument("--vocab-size", type=int, default=8192, help="vocabulary size (default 8192)")
    a = ap.parse_args(argv)
    docs = training_documents(a.split)
    tok = train_tokenizer(docs, a.vocab_size)
    write(tok, a.out)
    sample = "It is a truth universally acknowledged, that a single man"
    ids = tok.encode(sample).ids
    print(f"vocab {tok.get_vocab_size()}; {sample!r} -> {len(ids)} tokens; wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
