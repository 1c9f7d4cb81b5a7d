"""The tensor-parallel runner: the eager runner over a sharded model (`bitnetlm.parallel`), led by rank 0.

Rank 0 runs the engine (generation, the server) as on one process; each call of its runner that touches the
model or the KV cache is first sent to the other ranks (`TPGroup.send`: JSON of the call's integers), which
`follow` and make the same call on their shards, so every collective inside the model's forward meets its
partners. Logits come back whole on every rank (the head all-gathers them) and rank 0 samples them alone, on
the host sampler: its tokens reach the other ranks as the next call's inputs.

The fused C step and the CUDA-graph engine take the single-process shapes and hold no collectives, so a sharded
model runs the model's own forward here (NCCL inside CUDA graphs is not done yet).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from bitnetlm.parallel import group_of
from bitnetlm.runtime.base import Pending, SampleSpec
from bitnetlm.runtime.config import RuntimeConfig
from bitnetlm.runtime.eager import EagerRunner

_current: dict[int, int] = {}  # id(TPGroup) -> the number of the runner its ranks follow now
_MIRRORED = ("prefill", "prefill_many", "verify", "truncate", "copy_prefix", "reset", "shift", "decode")


def _ints(xs) -> list[int]:
    return [int(x) for x in xs]


class TPRunner(EagerRunner):
    """EagerRunner for a sharded model: on rank 0 each call is mirrored to the other ranks first."""

    def __init__(self, model, config: RuntimeConfig, rows: int, max_seq_len: int):
        self.tp = group_of(model)
        if self.tp is None:
            raise ValueError("TPRunner: the model is not sharded (bitnetlm.parallel.shard_)")
        if self.tp.lead:
            self.number = _current.get(id(self.tp), 0) + 1
            _current[id(self.tp)] = self.number
            self.tp.send(["init", rows, max_seq_len])
        super().__init__(model, config, rows, max_seq_len)

    def _mirror(self, *message) -> None:
        if not self.tp.lead:
            return
        if _current.get(id(self.tp)) != self.number:
            raise RuntimeError("a tensor-parallel model runs one runner at a time; this one was replaced")
        self.tp.send(list(message))

    def prefill(self, row: int, tokens: Sequence[int], start: int = 0):
        self._mirror("prefill", int(row), _ints(tokens), int(start))
        return super().prefill(row, tokens, start)

    def prefill_many(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]):
        self._mirror("prefill_many", _ints(rows), [_ints(p) for p in prompts])
        return super().prefill_many(rows, prompts)

    def verify(self, row: int, tokens: Sequence[int], start: int):
        self._mirror("verify", int(row), _ints(tokens), int(start))
        return super().verify(row, tokens, start)

    def truncate(self, row: int, n: int) -> None:
        self._mirror("truncate", int(row), int(n))
        super().truncate(row, n)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self._mirror("copy_prefix", int(src), int(dst), int(n))
        super().copy_prefix(src, dst, n)

    def reset(self, row: int, keep: int = 0) -> None:
        self._mirror("reset", int(row), int(keep))
        super().reset(row, keep)

    def shift(self, row: int, keep: int, drop: int) -> None:
        self._mirror("shift", int(row), int(keep), int(drop))
        super().shift(row, keep, drop)

    def decode(self, rows: Sequence[int], tokens: Sequence[int | None], positions: Sequence[int]):
        # a carried token (None) is rank 0's own sample: the other ranks get it as a plain token
        tokens = [self.carry[r] if t is None else int(t) for r, t in zip(rows, tokens, strict=True)]
        self._mirror("decode", _ints(rows), tokens, _ints(positions))
        return super().decode(rows, tokens, positions)

    def decode_sample(
        self, rows, tokens, positions, specs: Sequence[SampleSpec], carry: bool = False
    ) -> Pending:
        self.decode(rows, tokens, positions)
        return self.sample(specs, carry=carry)


def follow(model, config: RuntimeConfig) -> None:
    """Ranks other than 0: make rank 0's runner calls on this rank's shard until rank 0 calls `stop`."""
    tp = group_of(model)
    runner = None
    while True:
        op, *args = tp.recv()
        if op == "stop":
            return
        if op == "init":
            runner = None  # (the previous runner's KV cache goes before the next one's is allocated)
            runner = TPRunner(model, config, *args)
        elif op in _MIRRORED and runner is not None:
            try:
                getattr(EagerRunner, op)(runner, *args)
            except ValueError:  # a bad call fails its checks on rank 0 too, before any collective
                pass
        else:
            raise RuntimeError(f"tensor parallelism: rank {tp.rank} got an unknown call {op!r} from rank 0")


def stop(model) -> None:
    """Rank 0: release the other ranks from `follow`."""
    tp = group_of(model)
    if tp is not None and tp.lead and tp.size > 1:
        tp.send(["stop"])


def lead(model, config: RuntimeConfig, work: Callable[[], object]):
    """`work()` on rank 0 (then the other ranks are released) while the other ranks follow; its result on rank
    0, None elsewhere. A model that is not sharded just runs `work()`."""
    tp = group_of(model)
    if tp is None or tp.size == 1:
        return work()
    if not tp.lead:
        follow(model, config)
        return None
    try:
        return work()
    finally:
        stop(model)
