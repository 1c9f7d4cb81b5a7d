"""The tuner: candidate block shapes of each kernel path, timed once per (path, shape class) inside CUDA graphs
with CUDA events; the winner is cached in memory and on disk.

Choices persist across processes (a later load skips the timing): one JSON file per user (`settings().cache`,
under the cache folder), keyed by the GPU, the Triton version, a hash of this package's sources and the tuning key
(an edited kernel is re-tuned); a stored choice is used only if it is still a candidate. `configure` sets the
timing mode, the files and whether the step tables count (`TuneSettings`), for the process.

Ahead of both come the step-tuned tables of the GPU model (step_tune.py): the user's (written by `bitnet tune`),
then the one shipped with the package (configs/<GPU name>.json): the tile of each key that made the whole
captured decode step fastest.
A chain of one projection's calls cannot see the kernel that runs before it in the step (whether that one lets
it launch early, how many SMs it leaves free); on an H200 its picks cost the step 1-5% at batch 2-64.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from bitnetlm.kernels.triton.common import INTERPRET

_choice: dict[tuple, dict] = {}
_candidates: dict[tuple, list[dict]] = {}  # each key's candidate list, as built (step_tune.py walks them)


def cache_root() -> Path:
    """The cache folder (`bitnetlm.paths.cache_root`): the tuner's disk cache and the user's step-tune tables live
    under it."""
    from bitnetlm.paths import cache_root as root

    return root()


MODES = ("chain", "graph", "bench", "off")


@dataclass(frozen=True)
class TuneSettings:
    """How `_tune` chooses, one setting for the process (`configure`).

    mode: "chain" = time calls back to back inside a CUDA graph, each over its own copy of the weights
    (`_chain_time`), as the captured decode step runs them; "graph" = single calls inside CUDA graphs with L2
    flushed between them; "bench" = triton's do_bench (charges each candidate its Python launch cost, which a CUDA
    graph does not pay: it favoured single-launch paths that are slower inside the graph); "off" = the first
    candidate, no timing (tests). cache: the disk cache of timed choices (None: none). user_tables: the folder of
    the user's step-tune tables, what `bitnet tune` writes (None: none). step_tables: consult the step-tune tables
    (False: the timing alone, as benchmarks/gpu_tune.py starts from). verbose: print every timing."""

    mode: str = "chain"
    cache: Path | None = None
    user_tables: Path | None = None
    step_tables: bool = True
    verbose: bool = False


_settings = TuneSettings(cache=cache_root() / "triton_tune.json", user_tables=cache_root() / "step_tune")


def settings() -> TuneSettings:
    return _settings


def configure(**changes) -> TuneSettings:
    """Change the tuner's settings (`TuneSettings` fields) for the rest of the process; returns the previous
    ones (`configure(**dataclasses.asdict(previous))` restores them)."""
    global _settings
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(TuneSettings)})
    if unknown:
        raise ValueError(f"tune.configure: unknown settings {unknown} (TuneSettings fields)")
    mode = changes.get("mode", _settings.mode)
    if mode not in MODES:
        raise ValueError(f"tune.configure: mode must be one of {', '.join(MODES)}, found {mode!r}")
    for name in ("cache", "user_tables"):
        if changes.get(name) is not None:
            changes[name] = Path(changes[name])
    previous, _settings = _settings, dataclasses.replace(_settings, **changes)
    _tables.cache_clear()
    if "cache" in changes:
        _disk.clear()  # (loaded again from the new file at the next timing)
    return previous


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


_flush: list[torch.Tensor] = []


def _replay_ms(g: torch.cuda.CUDAGraph, reps: int) -> float:
    """ms for `reps` replays of g after one warm replay, by CUDA events."""
    g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def _graph_time(fn, calls: int = 8, reps: int = 3) -> float:
    """ms per call as the decode step sees it: inside a CUDA graph (no Python launch cost), L2 flushed before
    each call (weights come from HBM, as they do when 30 layers take turns), flush time subtracted."""
    fn()  # compile outside capture
    if not _flush:
        _flush.append(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    buf = _flush[0]
    torch.cuda.synchronize()
    g_both, g_flush = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_both):
        for _ in range(calls):
            buf.zero_()
            fn()
    with torch.cuda.graph(g_flush):
        for _ in range(calls):
            buf.zero_()
    return (_replay_ms(g_both, reps) - _replay_ms(g_flush, reps)) / (reps * calls)


CHAIN_BYTES = 96 << 20  # weight copies a chain cycles through: about twice the 50 MB L2 of an H100


def _chain_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """Copies of the weights for `_chain_time`: together about CHAIN_BYTES (4 to 48 of them)."""
    nbytes = weight.numel() * weight.element_size()
    if nbytes >= CHAIN_BYTES:  # already larger than twice L2 (the int8 LM head): every call reads it from HBM
        return [weight] * 4
    n = max(4, min(48, -(-CHAIN_BYTES // max(1, nbytes))))
    return [weight.clone() for _ in range(n)]


def _chain_time(launch, copies: list[torch.Tensor], reps: int = 3) -> float:
    """ms per call as the decode step sees it: calls back to back inside one CUDA graph, call i over its own copy
    of the weights (`_chain_copies`: together about twice L2, so each comes from HBM, as when 30 layers take
    turns) and no flush kernel between them, so programmatic dependent launch overlaps each call's start with
    the previous one's end as it does in the step. Timing single calls with L2 flushed between them charged
    every call a cold start; it ranked split-K tiles ahead of unsplit ones that are faster in the step."""
    n = len(copies)
    launch(copies[0])  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in copies:
            launch(w)
    return _replay_ms(g, reps) / (reps * n)


CONFIG_DIR = Path(__file__).parent / "configs"  # shipped with the package


def config_file(device_name: str, directory: str | os.PathLike | None = None) -> Path:
    """A GPU model's table in `directory` (default: the shipped one): its name with every run of other
    characters as one underscore."""
    name = re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json"
    return Path(CONFIG_DIR if directory is None else directory) / name


def table_files(device_name: str) -> list[Path]:
    """This GPU model's step-tune tables, first taken first: the user's (if `settings().user_tables`), then the
    shipped one."""
    user = _settings.user_tables
    return [*([config_file(device_name, user)] if user is not None else []), config_file(device_name)]


def _read_table(path: Path) -> dict:
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


@functools.cache
def _tables(device_name: str, user_tables: Path | None) -> tuple[dict, ...]:
    """The user's table, then the shipped one, of this GPU model (missing or unreadable: empty)."""
    return tuple(_read_table(p) for p in table_files(device_name))


def table_choice(key: tuple, candidates: list[dict], device_name: str) -> dict | None:
    """The step-tuned tile of `key` on this GPU model, if a table holds one that is still a candidate."""
    for table in _tables(device_name, _settings.user_tables):
        cfg = table.get(str(key))
        if cfg in candidates:
            return cfg
    return None


_disk: dict[str, dict] = {}


@functools.cache
def _source_hash() -> str:
    """Hash of every module of this package (kernel sources, launchers, candidate lists), in name order."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def _disk_key(key: tuple) -> str:
    return f"{torch.cuda.get_device_name()}|triton {triton.__version__}|src {_source_hash()}|{_settings.mode}|{key}"


def _disk_load() -> None:
    if _disk or _settings.cache is None:
        return
    _disk["__loaded__"] = {}
    try:
        with open(_settings.cache) as f:
            _disk.update(json.load(f))
    except (OSError, ValueError):
        pass


def _disk_store(key: tuple, cfg: dict) -> None:
    if _settings.cache is None:
        return
    _disk[_disk_key(key)] = cfg
    try:
        write_json(_settings.cache, {k: v for k, v in _disk.items() if k != "__loaded__"})
    except OSError:
        pass


def write_json(path: str | os.PathLike, obj) -> None:
    """obj as indented JSON at path, its folder made: a temporary file, then a rename (a reader never sees half)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def _tune(key: tuple, make_candidates, launch, weight: torch.Tensor | None) -> dict:
    """The fastest of `make_candidates()` for `key` (the first one under the interpreter or during capture), each
    run as `launch(cfg, w)` over the weights w (`weight`, or in chain mode its copies). The list is built only
    for a key not chosen yet: building it costs about 0.5 ms on the host, every call. launch None: a step-only
    key, whose choice shows only in the whole step (`step_tune.tune_step` times it there): a step table's
    choice, else the first candidate, never timed alone."""
    if key in _choice:
        return _choice[key]
    candidates = _candidates[key] = make_candidates()
    mode = _settings.mode
    if INTERPRET or len(candidates) == 1 or mode == "off" or torch.cuda.is_current_stream_capturing():
        _choice[key] = candidates[0]
        return candidates[0]
    if (
        _settings.step_tables
        and (cfg := table_choice(key, candidates, torch.cuda.get_device_name())) is not None
    ):
        _choice[key] = cfg
        return cfg
    if launch is None:
        _choice[key] = candidates[0]
        return candidates[0]
    _disk_load()
    stored = _disk.get(_disk_key(key))
    if stored in candidates:
        _choice[key] = stored
        return stored
    best, best_t = candidates[0], float("inf")
    copies: list[torch.Tensor] = []  # chain mode: made once, shared by every candidate
    for cfg in candidates:
        try:
            if mode == "chain":
                copies = copies or _chain_copies(weight)
                t = _chain_time(lambda w, cfg=cfg: launch(cfg, w), copies)
            elif mode == "graph":
                t = _graph_time(lambda cfg=cfg: launch(cfg, weight))
            else:
                t = triton.testing.do_bench(
                    lambda cfg=cfg: launch(cfg, weight), warmup=5, rep=20, return_mode="median"
                )
        except Exception:  # a candidate that does not compile (registers, shared memory) is skipped
            continue
        if _settings.verbose:
            print(f"tune {key} {cfg}: {t * 1e3:.1f} us", flush=True)
        if t < best_t:
            best, best_t = cfg, t
    _choice[key] = best
    _disk_store(key, best)
    return best


def _gemv_candidates(bm: int, gated: bool, k: int = 4096) -> list[dict]:
    if INTERPRET:
        return [dict(BN=64, BKW=16, SBK=128, num_warps=1)]  # few programs: the interpreter pays per op
    out = []
    # decode is latency-bound: few loop trips (wide BKW / SBK) and many small programs keep loads in flight
    tiles = (
        (4, 256, 4),
        (8, 128, 4),
        (4, 128, 2),
        (16, 32, 4),
        (8, 64, 4),
        (4, 64, 2),
        (8, 32, 2),
        (8, 16, 4),
    )
    for bn, bkw, nw in tiles:
        # keep the int32 accumulators at <= 32 registers a thread, the stats tile at <= 64
        if bm * bn * bkw * (2 if gated else 1) <= 32 * 32 * nw:
            sbk = max(128, min(triton.next_power_of_2(k), 64 * 32 * nw // bm))
            out.append(dict(BN=bn, BKW=bkw, SBK=sbk, num_warps=nw))
    return out[:5]


def _gemm_candidates(m: int, gated: bool) -> list[dict]:
    if INTERPRET:
        c = dict(BM=32, BN=64, BKB=32, GROUP_M=4, num_warps=1, num_stages=1)
        return [c, dict(c, SWAP=True)] + ([dict(c, SWAP=True, PAIR=True)] if gated else [])
    if m <= 64:
        c = [(64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 32, 128, 4, 4)]
    else:  # 128-wide tiles leave SMs idle on the N = 2560 projections at 512 rows: smaller tiles too
        c = [
            (128, 128, 64, 8, 3),
            (128, 64, 128, 4, 3),
            (64, 128, 128, 4, 3),
            (64, 64, 128, 4, 3),
            (128, 64, 64, 4, 4),
            (64, 64, 256, 4, 3),
        ]
    out = []
    for bm, bn, bkb, nw, ns in c:
        if gated and bm * bn > 128 * 64:
            continue
        out.append(dict(BM=bm, BN=bn, BKB=bkb, GROUP_M=8, num_warps=nw, num_stages=ns))
    # swapped operands (codes = A from registers, activations = B): weight rows in the MMA's M
    swapped = (
        ((128, 128, 64, 8, 3), (64, 128, 128, 4, 3), (128, 64, 128, 4, 3))
        if m > 64
        else ((64, 64, 128, 4, 3),)
    )
    for bm, bn, bkb, nw, ns in swapped:
        if not (gated and bm * bn > 128 * 64):
            out.append(dict(BM=bm, BN=bn, BKB=bkb, GROUP_M=8, num_warps=nw, num_stages=ns, SWAP=True))
    if gated:  # gate and up rows of the same outputs in one full-width tile (one accumulator, one MMA)
        # maxnreg 128: two CTAs an SM (the epilogue's per-element s / a otherwise takes ~190 registers); measured
        # on an H100 at M=512: 55.0 -> 42.9 us (no gain for the ungated shapes)
        paired = (
            (
                (128, 128, 64, 8, 3, 128),
                (128, 128, 64, 8, 4, 128),
                (128, 128, 64, 8, 3, 0),
                (64, 128, 128, 4, 3, 0),
            )
            if m > 64
            else ((64, 128, 128, 4, 3, 0),)
        )
        pair = dict(GROUP_M=8, SWAP=True, PAIR=True)
        out = [
            dict(pair, BM=bm, BN=bn, BKB=bkb, num_warps=nw, num_stages=ns, **({"maxnreg": mr} if mr else {}))
            for bm, bn, bkb, nw, ns, mr in paired
        ] + out
    return out


def _gemv8_candidates(bm: int, gated: bool) -> list[dict]:
    if INTERPRET:
        return [dict(path="gemv8", BN=64, BKW=16, num_warps=1)]
    out = []
    for bn, bkw, nw in (
        (8, 128, 4),
        (4, 256, 4),
        (16, 64, 4),
        (4, 128, 2),
        (8, 64, 4),
        (4, 64, 2),
        (16, 32, 4),
        (4, 32, 4),  # the small tiles keep M = 16 within the register budget
        (2, 64, 4),
    ):
        if bm * bn * bkw * (2 if gated else 1) <= 32 * 32 * nw:
            out.append(dict(path="gemv8", BN=bn, BKW=bkw, num_warps=nw))
    return out[:5]


def _w8_candidates(m: int) -> list[dict]:
    """int8 LM head tiles (BM batch rows, BN vocabulary rows, BK a K step); the first is the old fixed choice.
    One BM tile covers every row up to M = 64, so the 0.3 GB of weights are read once. Measured on an H100
    (chain timing, us a call at M = 1 / 8 / 64): the old tiles 118 / 135 / 185, the best here 112 / 117 / 151.
    Swapped operands (converted weights as the MMA's A operand from registers) measured 126-255: not candidates."""
    if INTERPRET:
        return [dict(BM=16, BN=16, BK=32, num_warps=1)]
    if m <= 16:
        tiles = [(16, 64, 128, 4), (16, 64, 256, 4), (16, 32, 256, 4), (16, 128, 256, 8)]
    else:
        tiles = [(64, 128, 64, 4), (64, 128, 128, 4), (64, 256, 128, 8), (64, 128, 256, 8), (64, 128, 128, 8)]
    return [dict(BM=bm, BN=bn, BK=bk, num_warps=nw, num_stages=3) for bm, bn, bk, nw in tiles]


def _row_candidates(kw: int, gated: bool, path: str) -> list[dict]:
    """Row GEMV tiles: BN whole rows of KWP words a program (all its weight loads issued at once)."""
    if INTERPRET:
        return [dict(path=path, BN=16, num_warps=1)]
    kwp = _next_pow2(kw)
    out = []
    for bn, nw in ((8, 4), (16, 4), (4, 4), (16, 8), (32, 8), (8, 8), (2, 4)):
        words = bn * kwp * (2 if gated else 1)
        if words <= 64 * 32 * nw and words >= 8 * 32 * nw:  # weight registers a thread: 8..64
            out.append(dict(path=path, BN=bn, num_warps=nw))
    # tiny K (the small test shapes on a GPU): no tile fills the register window, so one default
    return out[:5] or [dict(path=path, BN=16, num_warps=4)]


def _splitk_cfg(m: int, n: int, kp: int, bm: int, bn: int, bkb: int, target: int, nw: int = 4, **kw) -> dict:
    """A split-K candidate: K split so that about `target` programs run (none empty)."""
    out_n = bn // 2 if kw.get("PAIR") else bn
    n_tiles = triton.cdiv(n, out_n) * triton.cdiv(m, bm)
    chunks = triton.cdiv(kp, bkb)
    split = max(1, min(chunks, round(target / n_tiles)))
    per = triton.cdiv(chunks, split)
    split = triton.cdiv(chunks, per)  # no empty splits
    return dict(
        path="splitk",
        BM=bm,
        BN=bn,
        BKB=bkb,
        SPLIT=split,
        CPS=per,
        num_warps=1 if INTERPRET else nw,
        num_stages=1 if INTERPRET else 3,
        **kw,
    )


def _splitk_candidates(m: int, n: int, kp: int, gated: bool) -> list[dict]:
    """Split-K tiles (BN weight rows, BKB bytes a K step, about `target` programs, warps, BM batch rows; 0 = 16
    rows up to M = 16, else 64): swapped operands first (weight rows fill the MMA's M, the batch its N >= 16),
    then unswapped; for gate|up weights the gate|up paired tiles (BN/2 outputs a tile, one accumulator) last.
    Measured on an H100 (graph timing, quantization included): BM 32 tiles (twice the programs, no K split) win
    for q|k|v and o at M = 64, paired BN 64 tiles for gate|up at M = 8 and 64; BKB 64/32 or 8-warp tiles (no
    register spills) and a 128-register cap on the paired tile were slower and are not candidates. BKB 256 tiles
    (half the K-loop trips) were fastest for q|k|v and o at M = 64 and for o and down at M = 8 (H200, chain
    timing); 8-warp 128-row tiles never won. The paired BN 64 tile without a K split (216 programs, no split-K
    tail) was gate|up's fastest at M = 2-16 in the whole step (H200, 2026-11-30: batch 4 -6.4%, 8 -2.0%)."""
    bm0 = 16 if m <= 16 else 64
    if INTERPRET:  # several splits even on small shapes: the atomics path is what CI checks
        swapped, unswapped, pairs = [(64, 32, 8, 1, 0)], [(64, 32, 8, 1, 0)], [(64, 32, 8, 1, 0)]
    else:
        swapped = [(64, 128, 0, 4, 0), (64, 128, 250, 4, 0), (64, 128, 500, 4, 0), (128, 128, 250, 4, 0)]
        swapped += [(64, 64, 500, 4, 0)]
        unswapped = [(64, 64, 400, 4, 0), (64, 128, 400, 4, 0), (32, 128, 400, 4, 0), (64, 64, 800, 4, 0)]
        unswapped += [(32, 64, 800, 4, 0), (32, 128, 1600, 4, 0)]
        if m <= 16:
            pairs = [(128, 128, 250, 4, 0), (128, 128, 500, 4, 0), (64, 128, 500, 4, 0), (64, 128, 0, 4, 0)]
            swapped += [(64, 256, 0, 4, 0), (64, 256, 250, 4, 0)]
        else:  # no split (no workspace round trip) and few splits: M = 64 tiles already fill the SMs
            swapped += [(64, 128, 0, 4, 32), (64, 128, 0, 4, 16), (64, 128, 250, 4, 32)]
            unswapped += [(64, 128, 0, 4, 0), (32, 128, 0, 4, 0), (64, 128, 150, 4, 0), (32, 128, 250, 4, 0)]
            pairs = [(128, 128, 0, 4, 0), (128, 128, 250, 4, 0), (64, 128, 250, 4, 0)]
            pairs += [(64, 128, 0, 4, 32), (64, 128, 0, 4, 16), (128, 128, 0, 4, 32)]
            swapped += [(64, 256, 0, 4, 32)]
    out = [
        _splitk_cfg(m, n, kp, bm or bm0, bn, bkb, t, nw, SWAP=swap)
        for tiles, swap in (
            ((unswapped, False), (swapped, True)) if INTERPRET else ((swapped, True), (unswapped, False))
        )
        for bn, bkb, t, nw, bm in tiles
        if not (gated and bn > 64)
    ]
    if gated:
        out += [
            _splitk_cfg(m, n, kp, bm or bm0, bn, bkb, t, nw, SWAP=True, PAIR=True)
            for bn, bkb, t, nw, bm in pairs
        ]
    # a small shape clamps several targets to one tile: list it once
    return [c for i, c in enumerate(out) if c not in out[:i]]
