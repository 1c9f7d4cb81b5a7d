"""A tiny random model + a small trained BPE tokenizer with a chat template, for serving tests and benchmarks.

The weights are random (ternary projections, Gaussian embeddings); the text it writes is noise, but every
code path (prefill, batched decode, sampling, detokenization, stop handling) runs for real.
"""

from __future__ import annotations

import torch

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)
SPECIALS = ["<|bos|>", "<|eos|>", "<|start|>", "<|end|>"]

_TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
    "want of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
    "considered the rightful property of some one or other of their daughters. Hello world! The quick brown "
    "fox jumps over the lazy dog. 0123456789 café naïve — “quotes” 你好 🙂"
)


def tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained in memory on a paragraph (fast, deterministic)."""
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    from bitnetlm.text.tokenizer import Tokenizer

    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TEXT] * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 0)])
    cfg = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": CHAT_TEMPLATE}
    t = Tokenizer.from_tokenizers(tok, cfg)
    t.eos_token_ids = sorted({tok.token_to_id("<|eos|>"), tok.token_to_id("<|end|>")})
    return t


def tiny_model(
    vocab_size: int,
    max_len: int = 256,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 64,
    backend: str | None = "reference",
):
    """A random BitNet-architecture model (packed ternary projections) small enough for CPU tests."""
    from bitnetlm.kernels import prepare
    from bitnetlm.models import ModelConfig, build_model
    from bitnetlm.quant.bitlinear import BitLinear

    cfg = ModelConfig(
        arch="bitnet",
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
        rope_theta=10000.0,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    g = torch.Generator().manual_seed(seed)
    model = build_model(cfg, mode="infer")
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.randn(model.embed_tokens.weight.shape, generator=g))
        # an untied head with moderate logits: varied, not-too-peaked next-token distributions
        model.lm_head.weight.copy_(0.3 * torch.randn(model.lm_head.weight.shape, generator=g))
        for m in model.modules():
            if isinstance(m, BitLinear):
                t = torch.randint(-1, 2, (m.out_features, m.in_features), generator=g, dtype=torch.int8)
                m.load_ternary(t, 0.5 / m.in_features**0.5)
    return prepare(model, "cpu", backend).eval()


def tiny_model_and_tokenizer(max_len: int = 256, seed: int = 0, **kw):
    tok = tiny_tokenizer()
    return tiny_model(tok.vocab_size, max_len=max_len, seed=seed, **kw), tok
