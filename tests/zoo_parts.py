"""smollm2-135m-1.58 and minilm-l6-1.58 without their teachers' embeddings: the zoo's real ternary parts
(bitnetlm/zoo/parts/) with a seeded random embedding, assembled by the zoo's own `assemble` (tests/test_gpu_zoo.py,
tests/test_zoo_minilm.py; benchmarks/quality.py --tables zoo).

The real embeddings come from the teachers' wheels on PyPI at first use (bitnetlm/zoo/sources.py), which a machine
without network cannot fetch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

NAME = "smollm2-135m-1.58"
MINILM = "minilm-l6-1.58"
TEXTS = [  # the prompts both check the zoo's models with
    "It is a truth universally acknowledged, that a single man in possession of a good fortune",
    "The sea was calm",
    "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition, seemed to unite",
]


def random_q8_0(shape: tuple[int, int], seed: int) -> np.ndarray:
    """GGUF Q8_0 bytes (per 32 values: fp16 scale d, 32 int8) of a seeded random [rows, cols] matrix."""
    g = np.random.default_rng(seed)
    nb = shape[0] * shape[1] // 32
    blocks = np.empty((nb, 34), np.uint8)
    blocks[:, :2] = g.uniform(2e-4, 6e-4, (nb, 1)).astype(np.float16).view(np.uint8)  # |value| < 0.08
    blocks[:, 2:] = g.integers(-127, 128, (nb, 32), dtype=np.int8).view(np.uint8)
    return blocks.reshape(-1)


def smollm2_random_embedding(root: Path, seed: int = 7) -> Path:
    """An HF directory under `root` of smollm2-135m-1.58's parts with a seeded random embedding."""
    from safetensors.numpy import save_file

    from bitnetlm import zoo
    from bitnetlm.zoo.assemble import assemble

    parts = Path(root) / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    src = zoo.models_dir() / NAME
    for p in src.iterdir():
        if p.is_file() and p.name not in ("embed_q8_0.safetensors", "sources.json"):
            shutil.copy(p, parts / p.name)
    cfg = json.loads((src / "config.json").read_text())
    shape = (cfg["vocab_size"], cfg["hidden_size"])
    meta = {
        "shape": json.dumps(list(shape)),
        "ggml_type": "Q8_0",
        "source": f"tests/zoo_parts.py, seed {seed}",
    }
    save_file({"embed_tokens.weight": random_q8_0(shape, seed)}, str(parts / "embed_q8_0.safetensors"), meta)
    return assemble(NAME, parts, Path(root) / "model")


def _copy_parts(name: str, parts: Path) -> Path:
    """The zoo's parts of `name` but the fetched ones, copied into `parts`; returns the zoo's parts directory."""
    from bitnetlm import zoo

    src = zoo.models_dir() / name
    for p in src.rglob("*"):
        if p.is_file() and p.name != "sources.json" and not p.name.startswith("embed_"):
            (parts / p.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(p, parts / p.relative_to(src))
    return src


def minilm_random_embedding(root: Path, seed: int = 7) -> tuple[Path, np.ndarray]:
    """An HF directory under `root` of minilm-l6-1.58's parts with a seeded random float32 word embedding
    (in the parts' embed_f32.safetensors, as the teacher's bytes are fetched); returns it and the embedding."""
    from safetensors.numpy import save_file

    from bitnetlm.zoo.assemble import assemble

    parts = Path(root) / "parts"
    src = _copy_parts(MINILM, parts)
    cfg = json.loads((src / "config.json").read_text())
    shape = (cfg["vocab_size"], cfg["hidden_size"])
    emb = np.random.default_rng(seed).normal(0.0, 0.05, shape).astype("<f4")
    meta = {
        "shape": json.dumps(list(shape)),
        "ggml_type": "F32",
        "source": f"tests/zoo_parts.py, seed {seed}",
    }
    tensor = "embeddings.word_embeddings.weight"
    save_file({tensor: emb.reshape(-1).view(np.uint8)}, str(parts / "embed_f32.safetensors"), meta)
    return assemble(MINILM, parts, Path(root) / "model"), emb


def teacher_forced(model, prompt: list[int], tokens: list[int] | torch.Tensor):
    """The model's logits [N, V] (float32) for each of the N tokens that follow `prompt`, fed prompt + tokens in
    one uncached forward, and each token's rank among them [N] (0 = the argmax)."""
    got = torch.as_tensor(tokens)
    with torch.inference_mode():
        logits = model(torch.cat([torch.tensor(prompt), got])[None])[
            0, len(prompt) - 1 : -1
        ].float()  # [N, V]
    return logits, (logits > logits.gather(1, got[:, None])).sum(1)
