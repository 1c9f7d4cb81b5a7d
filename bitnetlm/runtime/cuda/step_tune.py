"""Tiles tuned in the whole captured decode step (`bitnet tune`, `benchmarks/gpu_tune.py`).

The tuner (tune.py) times each projection's candidates in a chain of calls of that projection alone. In the step
each kernel starts (programmatic dependent launch) while a different one drains, and whether its programs find
room on the SMs depends on that neighbour. `tune_step` takes one captured step's tuning keys and, for each key in
turn (coordinate descent), recaptures the step with every candidate of that key and keeps the fastest if it beats
the current choice by `min_gain`. The choices go into a table per GPU model (`write_table`) that `tune._tune`
takes ahead of its own timing: the user's (`tune.settings().user_tables`, what `bitnet tune` writes) or the one
shipped in configs/. Keys depend on shapes only (rows, K, batch bucket, cache dtype), so random weights of a
model's shape tune it as well as its checkpoint would. A table may also hold a "plan" section, which
`DecodePlan.for_gpu` reads; `write_table` keeps it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from bitnetlm.kernels.triton import tune


@dataclass
class StepTune:
    batch: int
    chain: dict[tuple, dict]  # each key's choice before (the chain timing's, or a table's)
    step: dict[tuple, dict]  # after the descent

    def changed(self) -> list[tuple]:
        return [k for k in self.chain if self.chain[k] != self.step[k]]

    def table(self) -> dict[str, dict]:
        """The choices as table entries (`write_table`)."""
        return {str(k): v for k, v in self.step.items()}


SETTLE_GRAPHS = 3
_SETTLE: list = []  # the graphs settle_graphs captured (kept for the life of the process)


def settle_graphs() -> None:
    """Put this process, once, in the state a user's engine is in: several CUDA graphs captured.

    Seen on an H200 (docs/PERF_LOG.md, 2026-11-29): the first steps a process
    captures can replay up to 3% faster (a batch-8 step 1.107 against 1.140 ms) than those timed after a few
    more captures, whatever those capture, even one small kernel each; the slower speed then stays. An engine in
    use captures several graphs (prefill and decode steps), so the faster speed is not what a user gets, and in
    an A/B it favours whichever variant is timed first."""
    if _SETTLE:
        return
    _SETTLE.extend(small_graph() for _ in range(SETTLE_GRAPHS))
    for _ in range(3):
        for g in _SETTLE:
            g.replay()
    torch.cuda.synchronize()


def small_graph(device: str | torch.device = "cuda") -> torch.cuda.CUDAGraph:
    """A captured graph of one small kernel (settle_graphs)."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        # from the graph's own pool, so alive as long as g is, whoever replays it
        x = torch.empty(16, device=device)
        x.add_(1)  # the one kernel; its values do not matter
    return g


def replay_ms(st, context: int, reps: int) -> float:
    """ms per replay of the captured step `st` from `context` keys, over `reps` replays after three warm-up ones."""
    st.pos.fill_(context)
    st.step.fill_(1)
    for _ in range(3):
        st.graph.replay()
    st.pos.fill_(context)
    st.step.fill_(1)
    a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        st.graph.replay()
    e.record()
    e.synchronize()
    return a.elapsed_time(e) / reps


def step_ms(
    eng, batch: int, context: int, max_keys: int = 0, reps: int = 50, tries: int = 2, settle: bool = True
) -> float:
    """ms per replay of a freshly captured decode step from `context` keys: the best of `tries` timings of
    `reps` replays (a one-off stall is not a tile's fault). settle: in a process that has captured several
    graphs, as a user's has (settle_graphs)."""
    if settle:
        settle_graphs()
    eng._graphs.clear()
    st = eng.decode_state(batch, max_keys=max_keys)
    return min(replay_ms(st, context, reps) for _ in range(tries))


def tune_step(
    eng,
    batch: int,
    context: int = 512,
    max_keys: int = 0,
    reps: int = 50,
    min_gain: float = 0.005,
    passes: int = 1,
    log=None,
) -> StepTune:
    """Coordinate descent over the tuning keys of `eng`'s decode step at `batch` rows. The engine's KV cache must
    hold context + reps + 8 positions (every timing replays the step past the context). Leaves the step's
    choices in effect in this process; `log(line)` hears every key's timings."""
    need = context + reps + 8
    if eng.ecfg.max_seq_len < need or eng.ecfg.max_batch < batch:
        raise ValueError(
            f"tune_step: the engine holds {eng.ecfg.max_batch} rows of {eng.ecfg.max_seq_len} positions; "
            f"batch {batch} at context {context} with {reps} replays a timing needs {batch} rows of {need}"
        )
    tune._choice.clear()
    tune._candidates.clear()
    eng._graphs.clear()
    eng.decode_state(batch, max_keys=max_keys)  # tunes (or loads) every key of this step
    keys = [k for k, c in tune._candidates.items() if len(c) > 1]
    res = StepTune(batch, {k: tune._choice[k] for k in keys}, {})
    for _ in range(passes):
        for k in keys:
            cur, times = tune._choice[k], []
            for cfg in tune._candidates[k]:
                tune._choice[k] = cfg
                try:
                    times.append((step_ms(eng, batch, context, max_keys, reps), cfg))
                except Exception as exc:  # a candidate that does not compile on this GPU
                    if log:
                        log(f"  {k}: {cfg} failed: {type(exc).__name__}")
            t, cfg = min(times, key=lambda tc: tc[0])
            now = next((tc for tc, c in times if c == cur), float("inf"))
            tune._choice[k] = cfg if t < now * (1 - min_gain) else cur
            if log:
                log(f"- {k}")
                for tc, c in times:
                    mark = (" before" if c == res.chain[k] else "") + (
                        " <- chosen" if c == tune._choice[k] else ""
                    )
                    log(f"    {tc:.3f}  {_short(c)}{mark}")
    res.step = {k: tune._choice[k] for k in keys}
    eng._graphs.clear()
    return res


def compare(eng, res: StepTune, context: int = 512, max_keys: int = 0, reps: int = 50, rounds: int = 2):
    """[(ms/step with the choices before, with the step's)] for `rounds` alternating rounds."""
    out = []
    for _ in range(rounds):
        tune._choice.update(res.chain)
        before = step_ms(eng, res.batch, context, max_keys, reps)
        tune._choice.update(res.step)
        out.append((before, step_ms(eng, res.batch, context, max_keys, reps)))
    eng._graphs.clear()
    return out


def _short(cfg: dict) -> str:
    return "/".join(f"{k}={v}" for k, v in cfg.items())


def write_table(path: str | os.PathLike, choices: dict[str, dict]) -> Path:
    """Merge `choices` (key string -> tile) into the table at `path` (a temporary file, then a rename)."""
    path = Path(path)
    table = {}
    if path.exists():
        try:
            table = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(
                f"{path}: not a JSON table of tiles ({e}); move it away or pick another --out"
            ) from e
        if not isinstance(table, dict):
            raise ValueError(f"{path}: expected a JSON object of key -> tile, found {type(table).__name__}")
    table.update(choices)
    tune.write_json(path, dict(sorted(table.items())))
    tune._tables.cache_clear()
    return path


def tune_shape(
    cfg,
    batches=(1, 8, 64),
    context: int = 512,
    head: str = "fp",
    kv_dtype=None,
    reps: int = 50,
    min_gain: float = 0.005,
    rounds: int = 1,
    out: str | os.PathLike | None = None,
    log=None,
) -> list[dict]:
    """Step-tune a model shape (`ModelConfig`, random weights) at each batch size on this GPU and write the
    choices into the table `out` (default: the user's table of this GPU model). One dict a batch: keys, changed
    keys, and ms/step before / after for `rounds` alternating rounds."""
    from bitnetlm.runtime.cuda.engine import CudaEngine, EngineConfig

    user = tune.settings().user_tables
    if out is None and user is None:
        raise ValueError("tune_shape: no table to write (the tuner has no user table folder): pass out=")
    ecfg = EngineConfig(max_batch=max(batches), max_seq_len=context + reps + 8, head=head, kv_dtype=kv_dtype)
    eng = CudaEngine.random(cfg, ecfg)
    rows, choices = [], {}
    for b in batches:
        res = tune_step(eng, b, context, reps=reps, min_gain=min_gain, log=log)
        ab = compare(eng, res, context, reps=reps, rounds=rounds)
        rows.append(
            dict(
                batch=b,
                keys=len(res.step),
                changed=[str(k) for k in res.changed()],
                before_ms=[a for a, _ in ab],
                after_ms=[s for _, s in ab],
            )
        )
        choices.update(res.table())
    path = write_table(out or tune.config_file(torch.cuda.get_device_name(), user), choices)
    for r in rows:
        r["table"] = str(path)
    return rows
