"""Training data: text / JSONL / directories -> tokenized shards on disk -> shuffled packed batches.

On disk (one directory, written by `prepare_data`, read by `TokenShards`):
  meta.json                {"format": "bitnetlm-tokens", "version": 1, "dtype": "uint16"|"uint32",
                            "vocab_size", "eos_id", "splits": {"train": [{"file", "tokens"}...], "val": [...]}}
  train_00000.bin, ...     raw little-endian token ids (numpy memmap), documents joined by EOS
  val_00000.bin, ...       the held-out split
  tokenizer.json           a copy of the tokenizer used (so the data directory is self-describing)

Batches (`PackedBatches`): the token stream of a split is cut into non-overlapping windows of
seq_len + 1 tokens (inputs + shifted targets); every epoch visits the windows in a fresh permutation
seeded by (seed, epoch). The position (epoch, index) is the whole state, so resuming is exact and
costs nothing. For distributed runs each optimizer step consumes one *global* batch, and rank r
takes its slice of it: the same global batch whatever the number of processes.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bitnetlm.formats import atomic

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text", ".jsonl", ".json")
FORMAT = "bitnetlm-tokens"


# ---- tokenizers ---------------------------------------------------------------------------------
def load_tokenizer(path: str | os.PathLike):
    """A `tokenizers.Tokenizer` from tokenizer.json or a directory holding one."""
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(f"tokenizer: expected tokenizer.json at {p}")
    return Tokenizer.from_file(str(p))


def train_tokenizer(files: list[str | os.PathLike], vocab_size: int, out_dir: str | os.PathLike) -> Path:
    """Train a byte-level BPE tokenizer (GPT-2 style, `<|endoftext|>` = EOS) on text files.

    Writes tokenizer.json + tokenizer_config.json into out_dir and returns out_dir.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (doc for f in files for doc in iter_documents(f))
    tok.train_from_iterator(texts, trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write_text(out / "tokenizer.json", tok.to_str())
    cfg = {"bos_token": None, "eos_token": "<|endoftext|>", "model_max_length": 1 << 20}
    _atomic_write_text(out / "tokenizer_config.json", json.dumps(cfg, indent=2))
    return out


def _eos_id(tok) -> int | None:
    for name in ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>"):
        i = tok.token_to_id(name)
        if i is not None:
            return i
    return None


# ---- reading documents --------------------------------------------------------------------------
def iter_files(inputs: Iterable[str | os.PathLike]) -> list[Path]:
    """Expand inputs (files or directories, searched recursively for text/JSONL files) in a stable order."""
    out = []
    for inp in inputs:
        p = Path(inp)
        if p.is_dir():
            out.extend(sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES))
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"data input {p} does not exist")
    if not out:
        raise ValueError(f"no text/JSONL files found in {list(map(str, inputs))} (suffixes {TEXT_SUFFIXES})")
    return out


def iter_documents(path: str | os.PathLike, text_field: str = "text") -> Iterator[str]:
    """Documents of one file: a whole text file is one document; JSONL gives one per line (`text_field`)."""
    p = Path(path)
    if p.suffix.lower() in (".jsonl", ".json"):
        with open(p, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{p}:{lineno}: not valid JSON ({e})") from e
                if not isinstance(rec, dict) or not isinstance(rec.get(text_field), str):
                    raise ValueError(f"{p}:{lineno}: expected an object with a string field {text_field!r}")
                yield rec[text_field]
    else:
        yield p.read_text(encoding="utf-8", errors="replace")


# ---- writing shards -----------------------------------------------------------------------------
def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def _atomic_write_text(path: Path, text: str) -> None:
    with atomic.temp_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
        atomic.commit(tmp, path)


class _ShardWriter:
    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.out, self.split, self.dtype, self.shard_tokens = out, split, dtype, shard_tokens
        self.buf: list[np.ndarray] = []
        self.n = 0
        self.shards: list[dict] = []

    def add(self, ids: np.ndarray) -> None:
        while len(ids):
            take = min(len(ids), self.shard_tokens - self.n)
            self.buf.append(ids[:take].astype(self.dtype))
            self.n += take
            ids = ids[take:]
            if self.n >= self.shard_tokens:
                self.flush()

    def flush(self) -> None:
        if not self.n:
            return
        name = f"{self.split}_{len(self.shards):05d}.bin"
        tmp = self.out / (name + ".tmp")
        np.concatenate(self.buf).tofile(tmp)
        os.replace(tmp, self.out / name)
        self.shards.append({"file": name, "tokens": int(self.n)})
        self.buf, self.n = [], 0


@dataclass
class PrepareConfig:
    val_fraction: float = 0.01  # share of tokens held out
    shard_tokens: int = 1 << 28  # tokens per shard file
    text_field: str = "text"  # JSONL field holding the text
    append_eos: bool = True  # EOS between documents
    doc_split_min_docs: int = 100  # with at least this many documents hold out whole documents


def prepare_data(
    inputs: list[str | os.PathLike],
    tokenizer: str | os.PathLike,
    out_dir: str | os.PathLike,
    config: PrepareConfig | None = None,
    progress: bool = True,
) -> dict:
    """Tokenize `inputs` (text files, JSONL, directories) into memmap shards with a held-out split.

    Held-out split: with many documents (>= doc_split_min_docs) every document whose stable hash falls
    in the val_fraction bucket goes to "val"; with few long documents (novels) the last val_fraction of
    each document's tokens does. Returns the meta dict (also written to out_dir/meta.json).
    """
    cfg = config or PrepareConfig()
    if not 0 <= cfg.val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), found {cfg.val_fraction}")
    tok = load_tokenizer(tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos = _eos_id(tok)
    dtype = token_dtype(vocab)
    files = iter_files(inputs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_docs = 0
    for f in files:  # count documents first: decides the split policy (cheap next to tokenizing)
        if f.suffix.lower() in (".jsonl", ".json"):
            with open(f, encoding="utf-8", errors="replace") as fh:
                n_docs += sum(1 for line in fh if line.strip())
        else:
            n_docs += 1
    # shards go to a temporary directory first: a failure half way leaves an existing data set untouched
    with atomic.temp_dir(out / "prepare") as stage:
        return _prepare_into(files, tok, tokenizer, out, stage, cfg, n_docs, dtype, vocab, eos, progress)


def _write_batch(batch: list[str], tok, writers: dict, cfg, by_doc: bool, eos) -> None:
    """Tokenizes a batch of documents into the train and val writers (by document hash, or each document's
    tail to val), then empties the batch."""
    import zlib

    for text, enc in zip(batch, tok.encode_batch(batch, add_special_tokens=False), strict=True):
        ids = np.asarray(enc.ids, dtype=np.int64)
        if cfg.append_eos and eos is not None:
            ids = np.append(ids, eos)
        if by_doc:
            bucket = zlib.crc32(text.encode("utf-8", "replace")) / 2**32
            writers["val" if bucket < cfg.val_fraction else "train"].add(ids)
        else:
            n_val = int(round(len(ids) * cfg.val_fraction))
            writers["train"].add(ids[: len(ids) - n_val])
            writers["val"].add(ids[len(ids) - n_val :])
    batch.clear()


def _tokenize_files(files, tok, writers: dict, cfg, by_doc: bool, eos, progress: bool) -> None:
    """Every document of the files into the writers, in batches of 256, with a progress bar over their bytes."""
    from bitnetlm.progress import bar as progress_bar

    total_bytes = sum(f.stat().st_size for f in files)
    bar = progress_bar(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", show=progress)
    batch: list[str] = []
    for f in files:
        for doc in iter_documents(f, cfg.text_field):
            batch.append(doc)
            bar.update(len(doc.encode("utf-8", "replace")))
            if len(batch) >= 256:
                _write_batch(batch, tok, writers, cfg, by_doc, eos)
    _write_batch(batch, tok, writers, cfg, by_doc, eos)
    bar.close()


def _swap_in_shards(out: Path, stage: Path) -> None:
    """Replaces out's shards with the staged ones (meta.json removed first, so no half-swapped data set reads)."""
    (out / "meta.json").unlink(missing_ok=True)  # no meta.json = no data set while the shards are swapped
    for old in list(out.glob("train_*.bin")) + list(out.glob("val_*.bin")):
        old.unlink()
    for f in stage.glob("*.bin"):
        os.replace(f, out / f.name)


def _copy_tokenizer(tokenizer, out: Path) -> None:
    """Copies tokenizer.json (and a tokenizer_config.json beside it) into out, unless it is already there."""
    tok_src = Path(tokenizer)
    tok_src = tok_src / "tokenizer.json" if tok_src.is_dir() else tok_src
    if tok_src.resolve() != (out / "tokenizer.json").resolve():
        shutil.copy(tok_src, out / "tokenizer.json")
        cfg_src = tok_src.parent / "tokenizer_config.json"
        if cfg_src.is_file():
            shutil.copy(cfg_src, out / "tokenizer_config.json")


def _prepare_into(
    files, tok, tokenizer, out: Path, stage: Path, cfg, n_docs, dtype, vocab, eos, progress
) -> dict:
    """Tokenizes the files into shards in stage, swaps them into out with the tokenizer; writes and returns the
    meta dict."""
    by_doc = n_docs >= cfg.doc_split_min_docs
    writers = {s: _ShardWriter(stage, s, dtype, cfg.shard_tokens) for s in ("train", "val")}
    _tokenize_files(files, tok, writers, cfg, by_doc, eos, progress)
    for w in writers.values():
        w.flush()
    _swap_in_shards(out, stage)
    _copy_tokenizer(tokenizer, out)
    meta = {
        "format": FORMAT,
        "version": 1,
        "dtype": dtype.name,
        "vocab_size": vocab,
        "eos_id": eos,
        "documents": n_docs,
        "split": "documents" if by_doc else "tail",
        "val_fraction": cfg.val_fraction,
        "sources": [str(f) for f in files],
        "splits": {s: w.shards for s, w in writers.items()},
    }
    _atomic_write_text(out / "meta.json", json.dumps(meta, indent=2))
    return meta


# ---- reading shards -----------------------------------------------------------------------------
class TokenShards:
    """The token stream of one split of a prepared data directory (memory-mapped, never loaded whole)."""

    def __init__(self, data_dir: str | os.PathLike, split: str = "train"):
        self.dir = Path(data_dir)
        meta_path = self.dir / "meta.json"
        if not meta_path.is_file():
            raise FileNotFoundError(
                f"{meta_path} not found: prepare the data first (`bitnet data prepare INPUT -o {self.dir}`)"
            )
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"{meta_path}: format {self.meta.get('format')!r}, expected {FORMAT!r}")
        if split not in self.meta["splits"]:
            raise ValueError(f"{meta_path}: no split {split!r}; found {sorted(self.meta['splits'])}")
        dtype = np.dtype(self.meta["dtype"])
        self.arrays = []
        for s in self.meta["splits"][split]:
            p = self.dir / s["file"]
            n = p.stat().st_size // dtype.itemsize
            if n != s["tokens"]:
                raise ValueError(f"{p}: holds {n} tokens, meta.json says {s['tokens']}")
            self.arrays.append(np.memmap(p, dtype=dtype, mode="r"))
        self.vocab_size = int(self.meta["vocab_size"])

    @property
    def num_tokens(self) -> int:
        return sum(len(a) for a in self.arrays)

    def windows(self, length: int) -> np.ndarray:
        """(shard, offset) of every non-overlapping window of `length` tokens, as int64 [N, 2]."""
        out = []
        for i, a in enumerate(self.arrays):
            n = len(a) // length
            if n:
                out.append(np.stack([np.full(n, i), np.arange(n) * length], axis=1))
        if not out:
            raise ValueError(
                f"{self.dir}: split has {self.num_tokens} tokens, fewer than one window of {length}"
            )
        return np.concatenate(out).astype(np.int64)

    def read(self, shard: int, offset: int, length: int) -> np.ndarray:
        return np.asarray(self.arrays[shard][offset : offset + length], dtype=np.int64)


class PackedBatches:
    """Shuffled, resumable batches of packed sequences: yields (input_ids [b, T], labels [b, T]) int64.

    global_batch: sequences per optimizer step (all ranks, all micro-batches together);
    micro_batch: sequences per forward on this rank. Each step yields global_batch / (micro_batch *
    world_size) micro-batches for this rank; `state_dict()` / `load_state_dict()` capture the position.
    """

    def __init__(
        self,
        shards: TokenShards,
        seq_len: int,
        global_batch: int,
        micro_batch: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ):
        micro_batch = micro_batch or global_batch // world_size
        if global_batch % (micro_batch * world_size):
            raise ValueError(
                f"batch_size {global_batch} must be a multiple of micro_batch_size {micro_batch} x "
                f"world size {world_size}"
            )
        self.shards, self.seq_len = shards, seq_len
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.rank, self.world_size = rank, world_size
        self.accum = global_batch // (micro_batch * world_size)
        self.seed, self.shuffle = seed, shuffle
        self.win = shards.windows(seq_len + 1)
        self.epoch, self.index = 0, 0
        self._perm_epoch, self._perm = None, None

    def __len__(self) -> int:
        """Optimizer steps per epoch (a trailing partial global batch is skipped)."""
        return len(self.win) // self.global_batch

    def _order(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            n = len(self.win)
            self._perm = (
                np.random.default_rng([self.seed, self.epoch]).permutation(n)
                if self.shuffle
                else np.arange(n)
            )
            self._perm_epoch = self.epoch
        return self._perm

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The micro-batches of this rank for the next optimizer step."""
        if len(self) == 0:
            raise ValueError(
                f"data has {len(self.win)} windows of {self.seq_len + 1} tokens, fewer than one batch of "
                f"{self.global_batch}"
            )
        if self.index + self.global_batch > len(self.win):
            self.epoch, self.index = self.epoch + 1, 0
        order = self._order()
        rows = order[self.index : self.index + self.global_batch]
        self.index += self.global_batch
        out = []
        for m in range(self.accum):
            start = (m * self.world_size + self.rank) * self.micro_batch
            sel = rows[start : start + self.micro_batch]
            seqs = np.stack([self.shards.read(*self.win[i], self.seq_len + 1) for i in sel])  # [b, T+1]
            t = torch.from_numpy(seqs)
            out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
        return out

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("global_batch", self.global_batch) != self.global_batch:
            raise ValueError(
                f"resume: checkpoint used batch_size {state['global_batch']}, this run {self.global_batch}"
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def eval_batches(shards: TokenShards, seq_len: int, batch_size: int, max_tokens: int | None = None):
    """Deterministic held-out batches (in order, no shuffle), at most max_tokens predicted tokens."""
    win = shards.windows(seq_len + 1)
    if max_tokens:
        win = win[: max(1, max_tokens // seq_len)]
    for i in range(0, len(win), batch_size):
        seqs = np.stack([shards.read(*w, seq_len + 1) for w in win[i : i + batch_size]])  # [b, T+1]
        t = torch.from_numpy(seqs)
        yield t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _counts(shards: TokenShards) -> np.ndarray:
    counts = np.zeros(shards.vocab_size, dtype=np.int64)
    for a in shards.arrays:
        counts += np.bincount(np.asarray(a), minlength=shards.vocab_size)[: shards.vocab_size]
    return counts


def unigram_cross_entropy(fit: TokenShards, evaluate: TokenShards | None = None) -> float:
    """Cross-entropy (nats/token) of `evaluate` under the add-one unigram distribution of `fit`.

    The baseline a language model must beat: it knows token frequencies and nothing about context.
    """
    p = (_counts(fit) + 1.0) / (_counts(fit).sum() + fit.vocab_size)
    c = _counts(evaluate or fit)
    return float(-(c * np.log(p)).sum() / c.sum())
