"""Shared pieces of the zoo training scripts (train_tiny.py, train_smollm2.py): data, eval, export.

The training itself is the library's loop (`bitnetlm.train.Trainer`: optimizer, schedule, checkpoint / resume,
torchrun DDP); what is here feeds it and judges it. Token data: the text pack (scripts/zoo_pack.py) is tokenized
on the machine that trains, with the tokenizer the model uses, and cached as uint16 .npy files next to the pack.
"""

from __future__ import annotations

import json
import math
import os
import tarfile
import time

import numpy as np
import torch

SOURCES = ["austen", "shakespeare", "kjv", "fortunes", "python_docs", "wordnet_chat"]


# ---- data -----------------------------------------------------------------------------------------
def unpack_text(pack: str, dest: str) -> str:
    """Extract the text pack (tar.xz of split/) once; returns the split directory."""
    split = os.path.join(dest, "split")
    if not os.path.exists(os.path.join(split, "manifest.json")):
        with tarfile.open(pack) as t:
            t.extractall(dest, filter="data")
    return split


def _chats_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        chats = [json.loads(line)["messages"] for line in f]
    return "<|endoftext|>".join(
        "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in c) for c in chats
    )


def source_text(split: str, name: str) -> str:
    if name == "wordnet_chat":
        return _chats_text(os.path.join(split, "train", "wordnet_chat.jsonl"))
    with open(os.path.join(split, "train", f"{name}.txt"), encoding="utf-8") as f:
        return f.read()


def encode(tokenizer, text: str, chunk: int = 1 << 16) -> np.ndarray:
    """uint16/uint32 ids of `text`, encoded in line-aligned chunks in parallel (tokenizers' encode_batch)."""
    pieces, i = [], 0
    while i < len(text):
        j = min(len(text), i + chunk)
        if j < len(text):
            k = text.rfind("\n", i, j)
            j = k + 1 if k > i else j
        pieces.append(text[i:j])
        i = j
    ids = [
        np.asarray(e.ids, dtype=np.int64) for e in tokenizer.encode_batch(pieces, add_special_tokens=False)
    ]
    out = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    return out.astype(np.uint16 if tokenizer.get_vocab_size() <= 65535 else np.uint32)


def tokenize_sources(split: str, tokenizer_json: str, cache: str, tag: str) -> dict[str, np.ndarray]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    out = {}
    for name in SOURCES:
        p = os.path.join(cache, f"{tag}_{name}.npy")
        if not os.path.exists(p):
            os.makedirs(cache, exist_ok=True)
            np.save(p + ".tmp.npy", encode(tok, source_text(split, name)))
            os.replace(p + ".tmp.npy", p)
        out[name] = np.load(p, mmap_mode="r")
    return out


class Batches:
    """Random windows of seq_len+1 tokens, each source drawn with a fixed weight; deterministic from the seed.

    As a batch source of `bitnetlm.train.Trainer` (`next_step`, `state_dict`, `load_state_dict`): every rank
    draws the same global batch of `global_batch` rows and takes its share of it, `micro_batch` rows a forward
    (default: all of its share at once), so N processes see the rows of one."""

    def __init__(
        self,
        sources: dict[str, np.ndarray],
        weights: dict[str, float],
        seq_len: int,
        seed: int = 0,
        global_batch: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        micro_batch: int | None = None,
    ):
        self.names = [n for n in weights if weights[n] > 0]
        w = np.array([weights[n] for n in self.names], dtype=np.float64)
        self.p = w / w.sum()
        self.data = {n: torch.from_numpy(np.asarray(sources[n]).astype(np.int64)) for n in self.names}
        self.seq_len = seq_len
        self.rng = np.random.default_rng(seed)
        self.global_batch, self.rank, self.world_size = global_batch, rank, world_size
        if global_batch is not None:
            self.micro_batch = micro_batch or global_batch // world_size
            if global_batch % (self.micro_batch * world_size):
                raise ValueError(
                    f"batch_size {global_batch} must be a multiple of {self.micro_batch} x {world_size} processes"
                )

    def next(self, batch_size: int) -> torch.Tensor:
        which = self.rng.choice(len(self.names), size=batch_size, p=self.p)
        rows = []
        for i in which:
            d = self.data[self.names[i]]
            s = int(self.rng.integers(0, len(d) - self.seq_len - 1))
            rows.append(d[s : s + self.seq_len + 1])
        return torch.stack(rows)  # [B, T+1]

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches (input_ids, labels) of the next optimizer step."""
        rows = self.next(self.global_batch)
        out = []
        for m in range(self.global_batch // (self.micro_batch * self.world_size)):
            start = (m * self.world_size + self.rank) * self.micro_batch
            sel = rows[start : start + self.micro_batch]
            out.append((sel[:, :-1], sel[:, 1:]))
        return out

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        if state.get("global_batch") != self.global_batch:
            raise ValueError(
                f"resume: checkpoint used batch_size {state.get('global_batch')}, this run {self.global_batch}"
            )
        self.rng.bit_generator.state = state["rng"]


# ---- eval -----------------------------------------------------------------------------------------
@torch.no_grad()
def perplexity(model, ids: torch.Tensor, ctx: int, device, dtype=torch.bfloat16) -> tuple[float, int]:
    """exp(mean NLL) over `ids` [N] in consecutive non-overlapping windows of ctx tokens (first token of each
    window is context only). Returns (ppl, number of predicted tokens)."""
    model.eval()
    nll, n = 0.0, 0
    for s in range(0, len(ids) - 1, ctx):
        w = ids[s : s + ctx + 1].to(device)
        if len(w) < 2:
            break
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            logits = model(w[None, :-1])
        lp = torch.log_softmax(logits.float()[0], -1)
        nll += -lp.gather(-1, w[1:, None]).sum().item()
        n += len(w) - 1
    return math.exp(nll / n), n


def heldout_ids(split: str, tokenizer_json: str, n_tokens: int = 4096) -> dict[str, torch.Tensor]:
    """The held-out eval sets in a tokenizer: last n_tokens of each Austen novel's held-out tail, the whole play."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    out = {}
    hd = os.path.join(split, "heldout")
    for f in sorted(os.listdir(hd)):
        with open(os.path.join(hd, f), encoding="utf-8") as fh:
            ids = torch.tensor(tok.encode(fh.read(), add_special_tokens=False).ids, dtype=torch.long)
        if f.startswith("austen_"):
            if len(ids) < n_tokens:
                raise ValueError(f"{f}: held-out tail has {len(ids)} tokens < {n_tokens}")
            ids = ids[-n_tokens:]
        out[f[:-4]] = ids
    return out


def eval_heldout(model, sets: dict[str, torch.Tensor], ctx: int, device) -> dict:
    res, tot_nll, tot_n = {}, 0.0, 0
    austen_nll, austen_n = 0.0, 0
    for name, ids in sets.items():
        ppl, n = perplexity(model, ids, ctx, device)
        res[name] = round(ppl, 3)
        tot_nll += math.log(ppl) * n
        tot_n += n
        if name.startswith("austen_"):
            austen_nll += math.log(ppl) * n
            austen_n += n
    res["austen_all"] = round(math.exp(austen_nll / austen_n), 3)
    res["all"] = round(math.exp(tot_nll / tot_n), 3)
    return res


# ---- export ---------------------------------------------------------------------------------------
def export_state(model, skip: tuple[str, ...] = (), dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """A training-mode model as our inference state dict: projections ternarized and packed (HF 2-bit layout,
    uint8) with a float32 weight_scale, everything else in `dtype`; names as in CausalLM."""
    from bitnetlm.quant import BitLinear
    from bitnetlm.quant.packing import PackingFormat, pack
    from bitnetlm.quant.ternary import ternarize

    sd = {}
    for name, mod in model.named_modules():
        if isinstance(mod, BitLinear) and mod.training_mode:
            t, s = ternarize(mod.weight.detach().float())
            sd[name + ".packed"] = pack(t.to(torch.int8), PackingFormat.HF_2BIT).cpu().contiguous()
            sd[name + ".weight_scale"] = torch.as_tensor(s, dtype=torch.float32).reshape(1).cpu()
    for name, p in model.state_dict().items():
        mod_name = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and (mod_name + ".packed") in sd:
            continue
        if any(name.startswith(k) for k in skip):
            continue
        sd[name] = p.detach().to(dtype).cpu().contiguous()
    return sd


def save_sharded(sd: dict[str, torch.Tensor], prefix: str, max_bytes: int = 15_000_000) -> list[str]:
    """Write `sd` as prefix-00000.safetensors, ... each under max_bytes (the device call returns files <= 16 MiB)."""
    from safetensors.torch import save_file

    shards: list[dict] = [{}]
    size = 0
    for k in sorted(sd):
        nb = sd[k].numel() * sd[k].element_size()
        if size and size + nb > max_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = sd[k]
        size += nb
    paths = []
    for i, sh in enumerate(shards):
        p = f"{prefix}-{i:05d}.safetensors"
        save_file(sh, p + ".tmp", metadata={"format": "bitnetlm-state", "layout": "hf-2bit"})
        os.replace(p + ".tmp", p)
        paths.append(p)
    return paths


class Timer:
    def __init__(self):
        self.t0 = time.time()

    def __call__(self) -> float:
        return time.time() - self.t0
