#!/usr/bin/env python3
"""Pack what a zoo training run needs into .assets/carry/ (small enough to travel to the GPU machine).

  corpus.tar.xz   the corpus split (train + held-out text) from scripts/fetch_corpora.py, xz-compressed
  teacher_tok/    the SmolLM2 tokenizer (tokenizer.json, tokenizer_config.json, chat_template.jinja)

Text compresses far better than token ids, so tokenization happens on the machine that trains.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tarfile


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", default=".assets/corpora/split")
    ap.add_argument("--teacher", default=".assets/teacher/smollm2-135m-instruct")
    ap.add_argument("--out", default=".assets/carry")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    dst = os.path.join(a.out, "corpus.tar.xz")
    with tarfile.open(dst + ".tmp", "w:xz", preset=6) as t:
        t.add(a.split, arcname="split")
    os.replace(dst + ".tmp", dst)
    tt = os.path.join(a.out, "teacher_tok")
    os.makedirs(tt, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(a.teacher, f), os.path.join(tt, f))
    for root, _, files in os.walk(a.out):
        for f in files:
            p = os.path.join(root, f)
            print(f"{os.path.getsize(p):>10}  {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
