"""Sentence-embedding quality and throughput of an encoder against its full-precision teacher. CPU; markdown tables.

    python benchmarks/embeddings.py --teacher TEACHER_DIR --model MINILM_1.58_DIR [--pairs 2000] [--threads 2]

- quality: on held-out Austen sentences (scripts/zoo_sentences.py: the last 10% of each novel, never trained on),
  the Spearman correlation of the model's cosine similarities of 2000 sentence pairs (half neighbours, half from
  two different novels) with the teacher's, and recall@10 of finding each held-out sentence's next sentence among
  all held-out next sentences, for teacher and model alike. Also the teacher's loader check
  cosine("A man is eating food.", "A man is eating a piece of bread.").
- throughput: sentences per second of `bitnetlm.embed` over the held-out sentences (batch --batch), for each model.
"""

from __future__ import annotations

import argparse
import sys
import time

import common

PAIR = ("A man is eating food.", "A man is eating a piece of bread.")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", required=True, help="full-precision model directory (all-MiniLM-L6-v2)")
    ap.add_argument("--model", required=True, help="model directory or GGUF to measure (minilm-l6-1.58)")
    ap.add_argument("--corpus", default=str(common.ASSETS / "austen"))
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    common.use_checkout()
    sys.path.insert(0, str(common.ROOT / "scripts"))
    import torch
    from zoo_sentences import austen_split, quality

    import bitnetlm
    from bitnetlm.embedding import embed

    torch.set_num_threads(args.threads)
    teacher, ttok = bitnetlm.load(args.teacher)
    model, mtok = bitnetlm.load(args.model)
    speed = {}

    def timed(name, m, tok):
        def fn(texts):
            t0 = time.perf_counter()
            out = embed(m, tok, texts, batch_size=args.batch)
            n, s = speed.get(name, (0, 0.0))
            speed[name] = (n + len(texts), s + time.perf_counter() - t0)
            return out

        return fn

    t_fn, m_fn = timed("teacher", teacher, ttok), timed("model", model, mtok)
    _, held = austen_split(args.corpus)
    q = quality(m_fn, t_fn, held, args.pairs)
    e = embed(teacher, ttok, list(PAIR))
    common.header(
        "Sentence embeddings: a ternary encoder against its full-precision teacher",
        details=f"teacher {args.teacher}; model {args.model}; held-out Austen sentences; "
        f"teacher cosine{PAIR} = {float(e[0] @ e[1]):.4f}",
    )
    rows = [
        [
            "teacher (fp32)",
            "1.0000",
            f"{q['recall10_teacher']:.3f}",
            f"{speed['teacher'][0] / speed['teacher'][1]:.1f}",
        ],
        [
            "model",
            f"{q['spearman_vs_teacher']:.4f}",
            f"{q['recall10_student']:.3f}",
            f"{speed['model'][0] / speed['model'][1]:.1f}",
        ],
    ]
    cols = [
        "encoder",
        f"Spearman vs teacher ({q['pairs']} pairs)",
        f"recall@10 ({q['retrieval_queries']} queries)",
        f"sentences/s (batch {args.batch}, {args.threads} threads)",
    ]
    print(common.table(cols, rows))


if __name__ == "__main__":
    main()
