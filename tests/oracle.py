"""Tiny BitNet checkpoints written by transformers itself, in every variant of FORMATS.md.

The reference library (transformers' BitNetForCausalLM / LlamaForCausalLM) writes and runs them, so our loader
and forward are checked against the oracle, not against our own output.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

VARIANTS = ("fp", "online", "packed-autobitlinear", "packed-bitlinear", "1bitllm", "llama")
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_config_kwargs(variant: str) -> dict:
    kw = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    if variant == "1bitllm":
        kw.update(num_key_value_heads=4, hidden_act="silu", tie_word_embeddings=False)
    return kw


def _reinit(model: torch.nn.Module, seed: int) -> None:
    """Realistic spread: linears ~N(0, 0.05), embeddings ~N(0, 1), norms ~1 +- 0.1 (not all-ones)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def _build_fp(path: Path, variant: str, seed: int, rope_theta: float = 10000.0, **overrides):
    from transformers import BitNetConfig, BitNetForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    kw = {**tiny_config_kwargs(variant), **overrides}
    if variant == "llama":
        cfg = LlamaConfig(**kw, rope_theta=rope_theta)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = BitNetConfig(**kw, rope_theta=rope_theta)
        model = BitNetForCausalLM(cfg)
    _reinit(model, seed)
    model.save_pretrained(path)
    return model


def make_checkpoint(path: Path, variant: str, seed: int = 0, **overrides) -> Path:
    """Write checkpoint `variant` into `path` using transformers; returns the directory to load in transformers.

    `overrides`: config fields that replace `tiny_config_kwargs` (e.g. sizes whose rows fit GGUF's TQ types).

    For '1bitllm' the returned oracle dir is a BitNet online checkpoint with the same weights; `path` itself gets
    the 1bitLLM spelling (BitnetForCausalLM, model_type llama, renamed sub-norms, weight_bits/input_bits).
    """
    path = Path(path)
    if variant not in VARIANTS:
        raise ValueError(variant)
    if variant in ("fp", "llama"):
        _build_fp(path, variant, seed, **overrides)
        return path
    from transformers.integrations.bitnet import pack_weights

    oracle = path if variant != "1bitllm" else path.with_name(path.name + "-oracle")
    _build_fp(oracle, variant, seed, **overrides)
    cfg = json.loads((oracle / "config.json").read_text())
    if variant in ("online", "1bitllm"):
        _clear_weight_ties(oracle / "model.safetensors")
        cfg["quantization_config"] = {
            "quant_method": "bitnet",
            "linear_class": "autobitlinear",
            "quantization_mode": "online",
        }
        (oracle / "config.json").write_text(json.dumps(cfg, indent=2))
        if variant == "1bitllm":
            _write_1bitllm(path, oracle, cfg)
        return oracle
    linear_class = variant.removeprefix("packed-")
    sd = load_file(str(oracle / "model.safetensors"))
    out = {}
    for k, v in sd.items():
        if any(k.endswith(f"{p}.weight") for p in PROJ):
            w = v.float()
            s = w.abs().mean().clamp(min=1e-5)
            t = (w / s).round().clamp(-1, 1).to(torch.int8)
            out[k] = pack_weights(t.clone())
            scale = s if linear_class == "autobitlinear" else 1.0 / s
            out[k.removesuffix(".weight") + ".weight_scale"] = scale.reshape(1).to(
                torch.bfloat16 if linear_class == "autobitlinear" else torch.float32
            )
        else:
            out[k] = v
    save_file(out, str(oracle / "model.safetensors"), metadata={"format": "pt"})
    cfg["quantization_config"] = {
        "quant_method": "bitnet",
        "linear_class": linear_class,
        "quantization_mode": "offline",
    }
    (oracle / "config.json").write_text(json.dumps(cfg, indent=2))
    return oracle


def _clear_weight_ties(file: Path, margin: float = 1e-4, names=PROJ) -> None:
    """Move float master weights off the ternarization ties |w| / mean|W| = 0.5 (by `margin` of the scale).

    transformers ternarizes online weights in a torch.compile'd WeightQuant whose mean|W| reduction order depends
    on the CPU's vector width and the thread count, so a weight within a float32 ulp of a tie gets a ternary value
    that depends on the machine (about one weight in 2*10^7 disagrees with our eager mean). With no weight that
    close the checkpoint means one ternary model everywhere; ~10 of ~7*10^4 weights move, it stays an ordinary one.
    """
    sd = load_file(str(file))
    for k, w in sd.items():
        if any(k.endswith(f"{p}.weight") for p in names):
            s = w.abs().mean()
            near = ((w.abs() / s) - 0.5).abs() < margin
            w[near] = (
                w[near].sign() * torch.where(w[near].abs() / s < 0.5, 0.5 - 2 * margin, 0.5 + 2 * margin) * s
            )
            r = w.abs() / w.abs().mean()
            assert ((r - 0.5).abs() >= margin / 2).all(), k
    save_file(sd, str(file), metadata={"format": "pt"})


def _write_1bitllm(path: Path, oracle: Path, cfg: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    sd = load_file(str(oracle / "model.safetensors"))
    ren = {
        k.replace("self_attn.attn_sub_norm", "self_attn.inner_attn_ln").replace(
            "mlp.ffn_sub_norm", "mlp.ffn_layernorm"
        ): v
        for k, v in sd.items()
    }
    ren["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(
        8
    )  # real 1bitLLM files carry these buffers
    save_file(ren, str(path / "model.safetensors"), metadata={"format": "pt"})
    c = {k: v for k, v in cfg.items() if k not in ("quantization_config", "model_type", "architectures")}
    c.update(architectures=["BitnetForCausalLM"], model_type="llama", weight_bits=1, input_bits=8)
    (path / "config.json").write_text(json.dumps(c, indent=2))


BPE_TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
    "want of a wife. However little known the feelings or views of such a man may be on his first entering "
    "a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
    "considered the rightful property of some one or other of their daughters. 0123456789"
)


def byte_level_bpe(vocab_size: int = 400):
    """A GPT-2-style byte-level BPE trained by `tokenizers` itself, small enough for the tiny checkpoints' vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([BPE_TEXT] * 4, trainer)
    return tok


def embedder_tokenizer():
    """`byte_level_bpe` whose post-processor appends <|endoftext|>, as Qwen3-Embedding's does (last-token pooling
    then reads the end token), as our Tokenizer."""
    from tokenizers import processors

    from bitnetlm.text.tokenizer import Tokenizer

    tok = byte_level_bpe(400)
    eot = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", eot)]
    )
    return Tokenizer.from_tokenizers(tok, {"eos_token": "<|endoftext|>"})


def oracle_model(oracle_dir: Path):
    """The transformers model for an oracle directory, fp32, eval mode."""
    import transformers

    cfg = json.loads((Path(oracle_dir) / "config.json").read_text())
    cls = (
        transformers.LlamaForCausalLM if cfg.get("model_type") == "llama" else transformers.BitNetForCausalLM
    )
    return cls.from_pretrained(oracle_dir, dtype=torch.float32).eval()


@contextmanager
def pinned_quantizer_inputs(ref, model, ids: torch.Tensor, atol: float = 1e-4, rename=None):
    """Feed `model`'s int8 activation quantizers the exact inputs transformers' quantizers get on `ids`.

    Both sides round x * 127 / max|x| to int8 with the same formula, but their float32 rounding differs (HF's
    AutoBitLinear multiplies dequantized floats where we scale an exact integer product; attention, norms, GEMM
    blocking and the thread count move last bits): x * 127 / max|x| differs by up to ~1e-4 between the two, while
    ~10 activations of a 2x24-token forward lie within 1e-4 of a k + 0.5 tie. When one rounds to different codes
    the logits move by ~1e-3..1e-2 (same model, no bug: 36 of 600 random inputs on a 2-thread Zen 5). Inside this
    context each of our BitLinears first checks that its own input equals transformers' within `atol` (so every
    norm / attention / RoPE / MLP segment between quantizers is still compared with the oracle), then computes
    from transformers' input. `rename`: transformers' module name -> ours, where they differ ("model." prefix
    removed by default). Yields a dict: module name -> max |input diff|.
    """
    rename = rename or (lambda n: n.removeprefix("model."))
    from transformers.integrations.bitnet import AutoBitLinear
    from transformers.integrations.bitnet import BitLinear as HFBitLinear

    from bitnetlm.quant import BitLinear

    seen: dict[str, torch.Tensor] = {}
    handles = [
        m.register_forward_pre_hook(lambda m, a, n=rename(n): seen.__setitem__(n, a[0].detach()))
        for n, m in ref.named_modules()
        if isinstance(m, (AutoBitLinear, HFBitLinear))
    ]
    try:
        with torch.no_grad():
            ref(ids)
    finally:
        for h in handles:
            h.remove()
    ours = {n: m for n, m in model.named_modules() if isinstance(m, BitLinear)}
    if set(ours) != set(seen):
        raise AssertionError(f"quantizing linears differ: ours {sorted(ours)}, transformers {sorted(seen)}")
    diffs: dict[str, float] = {}

    def pin(name):
        def hook(m, args):
            x, want = args[0], seen[name]
            assert x.shape == want.shape, (name, x.shape, want.shape)
            diffs[name] = (x - want.to(x.dtype)).abs().max().item()
            assert diffs[name] <= atol, f"{name}: max |input diff| = {diffs[name]} (allowed {atol})"
            return (want.to(x.dtype),) + tuple(args[1:])

        return hook

    handles = [m.register_forward_pre_hook(pin(n)) for n, m in ours.items()]
    try:
        yield diffs
    finally:
        for h in handles:
            h.remove()


def random_model(arch: str = "bitnet", seed: int = 0, hidden: int = 256, inter: int = 512, **overrides):
    """A tiny training-mode (ternary) or fp (llama) model of ours with a realistic random spread.

    Hidden and intermediate default to multiples of 256 because GGUF's TQ types need rows of 256.
    """
    from bitnetlm.models import ModelConfig, build_model

    kw = dict(
        vocab_size=300,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "1bitllm":
        kw.update(hidden_act="silu", num_key_value_heads=4, tie_word_embeddings=False)
    if arch == "llama":
        kw.update(hidden_act="silu", quant="none", tie_word_embeddings=False)
    kw.update(overrides)
    cfg = ModelConfig(arch=arch, **kw)
    torch.manual_seed(seed)
    m = build_model(cfg, "train" if cfg.quant == "ternary" else "fp")
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
        m.embed_tokens.weight.normal_()
    return m


def greedy_with_cache(model, prompt: torch.Tensor, n: int, cache_dtype=None) -> torch.Tensor:
    """Greedy decoding with the model's own KV cache (of `cache_dtype`, default the model's): prompt [B, T] -> the
    next n tokens [B, n]."""
    b, t0 = prompt.shape
    cache = model.new_cache(b, t0 + n, dtype=cache_dtype)
    with torch.inference_mode():
        logits = model(prompt, cache=cache, last_only=True)[:, -1]
        out = [logits.argmax(-1)]
        for i in range(n - 1):
            pos = torch.full((b, 1), t0 + i, dtype=torch.long, device=prompt.device)
            logits = model(out[-1][:, None], positions=pos, cache=cache)[:, -1]
            out.append(logits.argmax(-1))
    return torch.stack(out, 1)
