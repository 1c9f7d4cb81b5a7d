"""llama.cpp's BPE pre-tokenizer names (`tokenizer.ggml.pre`) and how its converter picks one.

llama.cpp refuses a GGUF whose pre-tokenizer name it does not know ("unknown pre-tokenizer type"), so we write only
names from `LLAMA_CPP_PRE_TOKENIZERS`. Its converter (convert_hf_to_gguf.py, `get_vocab_base_pre`) names a
tokenizer by the sha256 of the token ids it gives for `CHKTXT`; we do the same for the tokenizers whose names our
own GGUF reader implements (`KNOWN_HASHES`), and otherwise recognise the pre-tokenizer by its structure.

Vendored from llama.cpp commit 0c1e57098 (the tree in llama-cpp-python 0.3.36, which scripts/build_llama_bench.sh
builds): the names from src/llama-vocab.cpp, the text and the hashes from conversion/base.py.
"""

from __future__ import annotations

import json
from hashlib import sha256

LLAMA_CPP_COMMIT = "0c1e57098"

# every name src/llama-vocab.cpp accepts for a BPE vocabulary
LLAMA_CPP_PRE_TOKENIZERS = tuple(
    """
    default minicpm5 llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano
    deepseek-llm deepseek-coder deepseek-v3 spark2_5 youtu falcon mpt starcoder gpt-2 phi-2 jina-es
    jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert jais-2 gemma4
    granite-embed-multi-311m sarvam-moe jina-v1-en jina-v2-code roberta-bpe whitespace refact command-r
    qwen2 deepseek-r1-qwen kormo f2llmv2 qwen35 stablelm2 olmo dbrx smaug-bpe poro-chat chatglm-bpe glm4
    glm5 viking jais tekken smollm codeshell bloom gpt3-finnish exaone exaone4 exaone-moe chameleon
    minerva-7b megrez gpt-4o llama4 kanana2 talkie granite-embed-multi-97m tiny_aya cohere2moe superbpe
    trillion granite-docling bailingmoe bailingmoe2 llada-moe seed-coder hunyuan hunyuan-dense hy_v4
    joyai-llm kimi-k2 ufakzeka grok-2 afmoe laguna minimax-m2 solar-open mellum2
    """.split()
)

# the converter's fixed text (whitespace runs, emoji, digits, scripts, quotes, contractions)
CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multipl"
    "e emojis concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3."
    ".3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български "
    "''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE "
    "you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)

# sha256(str(ids of CHKTXT)) -> name, for the converter's entries whose name is in WRITABLE
KNOWN_HASHES = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Meta-Llama-3-8B
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM-135M
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # openai-community/gpt2
    "0fe1cf6eda062318a1af7270f3331a85c539a01778ff948e24388e949c5282f4": "gpt-2",  # ruGPT3XL
}

# LLaMA-3's split pattern (the regex of its tokenizer.json's Split pre-tokenizer)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2/2.5/3's: LLaMA-3's with digits one at a time (llama.cpp's `qwen2`)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# the names this writer can choose: those our GGUF reader (gguf_tokenizer) rebuilds exactly
WRITABLE = ("gpt-2", "smollm", "llama-bpe", "qwen2")


def _by_structure(pre: dict | None) -> str | None:
    """The name of a tokenizer.json pre-tokenizer our reader rebuilds exactly, from its shape (None: no such)."""
    if not isinstance(pre, dict):
        return None
    kind = pre.get("type")
    if kind == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return "gpt-2"
    steps = pre.get("pretokenizers") if kind == "Sequence" else None
    if not isinstance(steps, list) or len(steps) != 2 or not all(isinstance(s, dict) for s in steps):
        return None
    first, last = steps
    if last.get("type") != "ByteLevel" or last.get("add_prefix_space"):
        return None
    if first.get("type") == "Digits" and first.get("individual_digits") and last.get("use_regex", True):
        return "smollm"
    pattern = (first.get("pattern") or {}).get("Regex", "") if first.get("type") == "Split" else ""
    if not last.get("use_regex", True):
        return {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}.get(pattern)
    return None


def pre_tokenizer_name(tokenizer_json: dict, source: str = "tokenizer.json") -> str:
    """`tokenizer.ggml.pre` for a byte-level BPE tokenizer.json, chosen as llama.cpp's converter chooses it (the
    hash of its ids on CHKTXT) and else by the pre-tokenizer's structure; ValueError if neither knows it."""
    from tokenizers import Tokenizer

    try:
        ids = Tokenizer.from_str(json.dumps(tokenizer_json)).encode(CHKTXT).ids
    except Exception as e:  # tokenizers raises its own exception types
        raise ValueError(f"{source}: cannot load the tokenizer: {str(e).splitlines()[0]}") from None
    name = KNOWN_HASHES.get(sha256(str(ids).encode()).hexdigest()) or _by_structure(
        tokenizer_json.get("pre_tokenizer")
    )
    if name is None:
        found = json.dumps(tokenizer_json.get("pre_tokenizer"))[:120]
        raise ValueError(
            f"{source}: its pre-tokenizer has no llama.cpp name this writer knows (GPT-2 byte-level, SmolLM "
            f"digits + byte-level, LLaMA-3 or Qwen2 split + byte-level); found {found}"
        )
    return name
