"""Tiny Qwen3, Gemma 3 (text) and GPT-2 checkpoints written by transformers itself: full precision, online
(float master weights under transformers' bitnet quantization_config) and offline packed (2-bit weights).

Qwen3 and Gemma3 keep nn.Linear projections, so transformers' bitnet quantizer turns them into AutoBitLinear and
its from_pretrained is the oracle for all three variants. GPT-2's projections are Conv1D, which transformers 5.25's
quantizer does not convert (it warns that no linear layer was found and runs the float model); its ternary
oracle is transformers' GPT2LMHeadModel with each Conv1D swapped for transformers' own AutoBitLinear over the
transposed weight (online: the float master weight; offline: the unpacked ternary values and their scale).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from oracle import PROJ, _clear_weight_ties
from safetensors.torch import load_file, save_file

FAMILIES = ("qwen3", "gemma3", "gpt2")
QUANT_VARIANTS = ("fp", "online", "offline")
GPT2_PROJ = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
ONLINE = {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "online"}
OFFLINE = {**ONLINE, "quantization_mode": "offline"}


def config(family: str, **overrides):
    """transformers' config object of a tiny `family` model."""
    import transformers

    common = dict(vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "gpt2":
        kw = dict(n_embd=64, n_layer=2, n_head=4, n_positions=128, activation_function="gelu_new")
        return transformers.GPT2Config(**{**common, **kw, **overrides})
    kw = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    if family == "qwen3":
        return transformers.Qwen3Config(**{**common, **kw, "rope_theta": 10000.0, **overrides})
    kw.update(
        num_hidden_layers=3,
        query_pre_attn_scalar=24,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
        final_logit_softcapping=15.0,
    )
    return transformers.Gemma3TextConfig(**{**common, **kw, **overrides})


def model_class(family: str):
    import transformers

    return {
        "qwen3": transformers.Qwen3ForCausalLM,
        "gemma3": transformers.Gemma3ForCausalLM,
        "gpt2": transformers.GPT2LMHeadModel,
    }[family]


def _reinit(model: torch.nn.Module, seed: int) -> None:
    """Realistic spread: projections ~N(0, 0.05) (biases too), embeddings ~N(0, 1), norm weights ~1 +- 0.1
    (Gemma's (1 + w) norms ~0 +- 0.1)."""
    g = torch.Generator().manual_seed(seed)
    gemma = "Gemma" in type(model).__name__
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "norm" in name or ".ln_" in name:
                p.copy_(0.1 * r if name.endswith("bias") or gemma else 1 + 0.1 * r)
            elif "embed" in name or "wte" in name:
                p.copy_(r)
            elif "wpe" in name:
                p.copy_(0.3 * r)
            else:
                p.copy_(0.05 * r)


def make_checkpoint(path: Path, family: str, variant: str, seed: int = 0, **overrides) -> Path:
    """Write `family`'s `variant` checkpoint into `path` with transformers; returns `path`."""
    path = Path(path)
    torch.manual_seed(seed)
    model = model_class(family)(config(family, **overrides))
    _reinit(model, seed)
    model.save_pretrained(path)
    if variant == "fp":
        return path
    file, cfg_file = path / "model.safetensors", path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    names = GPT2_PROJ if family == "gpt2" else PROJ
    if variant == "online":
        _clear_weight_ties(file, names=names)
        cfg["quantization_config"] = ONLINE
    else:
        _pack(file, names, transposed=family == "gpt2")
        cfg["quantization_config"] = OFFLINE
    cfg_file.write_text(json.dumps(cfg, indent=2))
    return path


def _pack(file: Path, names, transposed: bool) -> None:
    """Projections -> transformers' packed 2-bit rows + a bf16 `weight_scale` (the multiply convention)."""
    from transformers.integrations.bitnet import pack_weights

    out = {}
    for k, v in load_file(str(file)).items():
        if any(k.endswith(f"{p}.weight") for p in names):
            w = (v.t() if transposed else v).float()
            s = w.abs().mean().clamp(min=1e-5)
            t = (w / s).round().clamp(-1, 1).to(torch.int8)
            out[k] = pack_weights(t.clone())
            out[k.removesuffix(".weight") + ".weight_scale"] = s.reshape(1).to(torch.bfloat16)
        else:
            out[k] = v
    save_file(out, str(file), metadata={"format": "pt"})


def oracle_model(path: Path):
    """transformers' model of a checkpoint `make_checkpoint` wrote (fp32, eval, eager attention)."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    family = {"gemma3_text": "gemma3"}.get(cfg["model_type"], cfg["model_type"])
    qc = cfg.get("quantization_config")
    if family != "gpt2" or qc is None:
        return (
            model_class(family).from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        )
    return _gpt2_bitnet(path, cfg, qc["quantization_mode"])


def _gpt2_bitnet(path: Path, cfg: dict, mode: str):
    """transformers' GPT-2 whose Conv1D projections are transformers' AutoBitLinear layers (see module doc)."""
    import transformers
    from transformers.integrations.bitnet import AutoBitLinear, unpack_weights

    c = {k: v for k, v in cfg.items() if k != "quantization_config"}
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**c)).float().eval()
    sd = load_file(str(path / "model.safetensors"))
    plain = {k: v for k, v in sd.items() if not any(f"{p}.weight" in k for p in GPT2_PROJ)}
    model.load_state_dict(plain, strict=False)
    for i in range(model.config.n_layer):
        for p in GPT2_PROJ:
            key = f"transformer.h.{i}.{p}"
            conv = model.get_submodule(key)
            n_in, n_out = conv.weight.shape
            lin = AutoBitLinear(n_in, n_out, bias=True, online_quant=mode == "online")
            with torch.no_grad():
                w, b = sd[key + ".weight"], sd[key + ".bias"]
                if mode == "online":
                    lin.weight.copy_(w.t())
                    lin.bias.copy_(b)
                else:  # offline AutoBitLinear scales (x T + bias) by s: its bias is b / s
                    s = sd[key + ".weight_scale"].float()
                    lin.weight.copy_(unpack_weights(w, dtype=torch.float32))
                    lin.weight_scale.copy_(s)
                    lin.bias.copy_(b / s)
            model.set_submodule(key, lin)
    model.tie_weights()
    return model.eval()


def hf_module_name(family: str, ours: str) -> str:
    """transformers' module name of our module `ours` (for pinning quantizer inputs)."""
    from bitnetlm.formats.names import hf_name

    return hf_name(ours, family)
