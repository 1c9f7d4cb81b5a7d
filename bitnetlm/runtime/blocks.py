"""The block allocator of a paged KV cache: fixed-size blocks of positions, reference counts, a free list, and a
cache of the blocks that hold a prompt prefix (automatic prefix caching, as vLLM's).

Pure bookkeeping (no tensors): block ids index a runner's KV pool. A row's block table lists the blocks that hold
its positions in order (position p lives in block table[p // block_size] at offset p % block_size). A full block
written by a prompt's prefill may be *cached*: keyed by its tokens and the cached block before it (that block's
id and allocation generation, so the key names the whole prefix exactly, with no hash collisions), so that a
later prompt that starts with the same tokens maps the same blocks into its table (reference count + 1) instead
of computing them again. A cached block that no row references stays cached until a new block is needed and
no free one is left: then the least recently released one is evicted (LRU).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

ROOT = (-1, 0)  # the parent of a prompt's first block


class OutOfBlocks(ValueError):
    """No free or evictable block is left in the pool."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"KV block pool: expected >= 1 blocks of >= 1 positions, found {num_blocks} of {block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free = list(
            range(num_blocks)
        )  # a heap: the lowest id first (the pool's memory is touched in order)
        self.refs = [0] * num_blocks
        self.gen = [
            0
        ] * num_blocks  # times each block was allocated: a cache key names its parent's generation
        self.key_of: dict[int, tuple] = {}  # cached block -> its key
        self.by_key: dict[tuple, int] = {}
        self.lru: OrderedDict[int, None] = (
            OrderedDict()
        )  # cached blocks no row references, least recent first
        self.hits = self.queries = 0  # blocks found / looked up by `match`

    # ---- counts -------------------------------------------------------------------------------------
    def available(self) -> int:
        """Blocks that `allocate` can hand out: free, or cached and unreferenced (evictable)."""
        return len(self.free) + len(self.lru)

    def in_use(self) -> int:
        """Blocks referenced by at least one row."""
        return self.num_blocks - self.available()

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    # ---- allocation and references ------------------------------------------------------------------
    def allocate(self) -> int:
        """A block with one reference: a free one, else the least recently released cached one (evicted)."""
        if self.free:
            b = heapq.heappop(self.free)
        elif self.lru:
            b, _ = self.lru.popitem(last=False)
            self._uncache(b)
        else:
            raise OutOfBlocks(
                f"KV cache: all {self.num_blocks} blocks of {self.block_size} positions are in use "
                "(raise --kv-tokens, or lower --max-batch)"
            )
        self.refs[b] = 1
        self.gen[b] += 1
        return b

    def incref(self, b: int) -> None:
        if self.refs[b] == 0:
            self.lru.pop(b)
        self.refs[b] += 1

    def decref(self, b: int) -> None:
        if self.refs[b] <= 0:
            raise ValueError(f"KV block {b}: released more often than referenced")
        self.refs[b] -= 1
        if self.refs[b] == 0:
            if b in self.key_of:
                self.lru[b] = None
            else:
                heapq.heappush(self.free, b)

    # ---- the prefix cache ---------------------------------------------------------------------------
    def key(self, parent: int | None, tokens: Sequence[int]) -> tuple:
        """The cache key of a full block of `tokens` that follows block `parent` (None: the prompt's start)."""
        return (ROOT if parent is None else (parent, self.gen[parent]), tuple(tokens))

    def cache(self, b: int, parent: int | None, tokens: Sequence[int]) -> None:
        """Block b (full, referenced) holds `tokens` after block `parent`: later prompts may find it. An equal
        block cached already keeps its place (b stays a private copy)."""
        k = self.key(parent, tokens)
        if k not in self.by_key and b not in self.key_of:
            self.by_key[k] = b
            self.key_of[b] = k

    def cached(self, b: int) -> bool:
        return b in self.key_of

    def uncache(self, b: int) -> None:
        """b's contents are about to change (its one row writes it): it no longer holds its key's tokens."""
        if self.refs[b] != 1:
            raise ValueError(f"KV block {b}: uncached while {self.refs[b]} rows reference it")
        self._uncache(b)

    def _uncache(self, b: int) -> None:
        self.gen[b] += 1  # blocks cached after b (keyed by its generation) no longer follow it
        k = self.key_of.pop(b, None)
        if k is not None and self.by_key.get(k) == b:
            del self.by_key[k]

    def match(self, tokens: Sequence[int], count: bool = True) -> list[int]:
        """The cached blocks holding `tokens`' leading full blocks, in order, as far as they go (no references
        taken). count: the lookup counts toward `hits` / `queries`."""
        bs, out, parent = self.block_size, [], None
        for i in range(len(tokens) // bs):
            b = self.by_key.get(self.key(parent, tokens[i * bs : (i + 1) * bs]))
            if b is None:
                break
            out.append(b)
            parent = b
        if count:
            self.queries += len(tokens) // bs
            self.hits += len(out)
        return out
