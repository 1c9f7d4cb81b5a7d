"""Python launchers for the Triton kernels: shape checks, path choice (GEMV vs GEMM) and a small tuner.

The tuner times a few candidate block shapes once per (kernel, shape class) with CUDA events and caches the
winner; call the ops once outside CUDA-graph capture (a warm-up) so no tuning happens while capturing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import torch
import triton

from bitnetlm.kernels.triton import kernels as K
from bitnetlm.kernels.triton.layout import packed_row_bytes

ROW_MAX_M = 2  # rows up to this try the row GEMV first (dp4a work grows with M; tensor cores take over)
GEMV_MAX_M = 16  # rows up to this may use the fused dp4a GEMV (the tuner decides against split-K)
SPLITK_MAX_M = 64  # rows up to this use split-K tensor-core GEMM; above it, the plain tiled GEMM
PTX = not K.INTERPRET
_choice: dict[tuple, dict] = {}
# BITNETLM_TRITON_TUNE: 0 = first candidate, no timing (tests); graph (default) = time inside CUDA graphs with L2
# flushed, as the captured decode step runs them; 1 = triton's do_bench (charges each candidate its Python launch
# cost, which a CUDA graph does not pay: it favoured single-launch paths that are slower inside the graph)
TUNE_MODE = os.environ.get("BITNETLM_TRITON_TUNE", "graph")
TUNE = TUNE_MODE != "0"
TUNE_VERBOSE = os.environ.get("BITNETLM_TRITON_TUNE_VERBOSE", "") not in ("", "0")  # print every timing


_PDL: list[bool] = []


def pdl_kw() -> dict:
    """Launch options for the decode kernels: programmatic dependent launch (sm_90+) lets a kernel start (and
    load its weights) while the previous one drains; each such kernel waits (`_pdl_wait`) before touching
    anything an earlier kernel wrote. BITNETLM_TRITON_PDL=0 turns it off."""
    if not _PDL:
        on = (
            K.HAS_GDC
            and os.environ.get("BITNETLM_TRITON_PDL", "1") != "0"
            and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] >= 9
        )
        _PDL.append(bool(on))
    return dict(PDL=True, launch_pdl=True) if _PDL[0] else {}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


_flush: list[torch.Tensor] = []


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

    def timed(g):
        g.replay()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / (reps * calls)

    return timed(g_both) - timed(g_flush)


# tuned choices persist across processes (a later load skips the timing): one JSON file per user, keyed by the
# GPU, the Triton version, a hash of the kernel sources and the tuning key (an edited kernel is re-tuned); a
# stored choice is used only if it is still a candidate
TUNE_CACHE = os.environ.get(
    "BITNETLM_TRITON_TUNE_CACHE",
    os.path.join(os.path.expanduser("~"), ".cache", "bitnetlm", "triton_tune.json"),
)
_disk: dict[str, dict] = {}


@functools.cache
def _source_hash() -> str:
    h = hashlib.sha256()
    for mod in ("kernels.py", "attention.py", "launch.py", "decode.py"):
        h.update(Path(__file__).with_name(mod).read_bytes())
    return h.hexdigest()[:12]


def _disk_key(key: tuple) -> str:
    return (
        f"{torch.cuda.get_device_name()}|triton {triton.__version__}|src {_source_hash()}|{TUNE_MODE}|{key}"
    )


def _disk_load() -> None:
    if _disk or not TUNE_CACHE:
        return
    _disk["__loaded__"] = {}
    try:
        with open(TUNE_CACHE) as f:
            _disk.update(json.load(f))
    except (OSError, ValueError):
        pass


def _disk_store(key: tuple, cfg: dict) -> None:
    if not TUNE_CACHE:
        return
    _disk[_disk_key(key)] = cfg
    try:
        os.makedirs(os.path.dirname(TUNE_CACHE) or ".", exist_ok=True)
        tmp = f"{TUNE_CACHE}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({k: v for k, v in _disk.items() if k != "__loaded__"}, f, indent=1)
        os.replace(tmp, TUNE_CACHE)
    except OSError:
        pass


def _tune(key: tuple, candidates: list[dict], launch) -> dict:
    """The fastest candidate for `key` (first candidate under the interpreter or during capture)."""
    if key in _choice:
        return _choice[key]
    if K.INTERPRET or len(candidates) == 1 or not TUNE or torch.cuda.is_current_stream_capturing():
        _choice[key] = candidates[0]
        return candidates[0]
    _disk_load()
    stored = _disk.get(_disk_key(key))
    if stored in candidates:
        _choice[key] = stored
        return stored
    best, best_t = candidates[0], float("inf")
    for cfg in candidates:
        try:
            if TUNE_MODE == "graph":
                t = _graph_time(lambda cfg=cfg: launch(cfg))
            else:
                t = triton.testing.do_bench(
                    lambda cfg=cfg: launch(cfg), warmup=5, rep=20, return_mode="median"
                )
        except Exception:  # a candidate that does not compile (registers, shared memory) is skipped
            continue
        if TUNE_VERBOSE:
            print(f"tune {key} {cfg}: {t * 1e3:.1f} us", flush=True)
        if t < best_t:
            best, best_t = cfg, t
    _choice[key] = best
    _disk_store(key, best)
    return best


def _gemv_candidates(bm: int, gated: bool, k: int = 4096) -> list[dict]:
    if K.INTERPRET:
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
    if K.INTERPRET:
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
    if K.INTERPRET:
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


def _row_candidates(kw: int, gated: bool, path: str) -> list[dict]:
    """Row GEMV tiles: BN whole rows of KWP words a program (all its weight loads issued at once)."""
    if K.INTERPRET:
        return [dict(path=path, BN=16, num_warps=1)]
    kwp = _next_pow2(kw)
    out = []
    for bn, nw in ((8, 4), (16, 4), (4, 4), (16, 8), (32, 8), (8, 8), (2, 4)):
        words = bn * kwp * (2 if gated else 1)
        if words <= 64 * 32 * nw and words >= 8 * 32 * nw:  # weight registers a thread: 8..64
            out.append(dict(path=path, BN=bn, num_warps=nw))
    return out[:5]


def _splitk_candidates(m: int, n: int, kp: int, gated: bool) -> list[dict]:
    bm = 16 if m <= 16 else 64
    if K.INTERPRET:
        tiles = [(64, 32, 8)]  # several splits even on small shapes: the atomics path is what CI checks
    else:
        tiles = [(64, 64, 400), (64, 128, 400), (32, 128, 400), (64, 64, 800), (32, 64, 800), (32, 128, 1600)]
        if m > 16:  # no split (no workspace round trip) and few splits: M = 64 tiles already fill the SMs
            tiles += [(64, 128, 0), (32, 128, 0), (64, 128, 150), (32, 128, 250)]
    out = []
    if not K.INTERPRET:  # swapped operands first: weight rows fill the MMA's M (64), the batch its N (>= 16)
        tiles = [(64, 128, 0, True), (64, 128, 250, True), (64, 128, 500, True), (128, 128, 250, True)] + [
            (*t, False) for t in tiles
        ]
    else:
        tiles = [(*t, False) for t in tiles] + [(*t, True) for t in tiles]
    for bn, bkb, target, swap in tiles:
        if gated and bn > 64:
            continue
        n_tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
        chunks = triton.cdiv(kp, bkb)
        split = max(1, min(chunks, round(target / n_tiles)))
        per = triton.cdiv(chunks, split)
        split = triton.cdiv(chunks, per)  # no empty splits
        out.append(
            dict(
                path="splitk",
                BM=bm,
                BN=bn,
                BKB=bkb,
                SPLIT=split,
                CPS=per,
                num_warps=4,
                num_stages=1 if K.INTERPRET else 3,
                SWAP=swap,
            )
        )
    return out


_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device, m: int, cols: int, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 partial sums [split, M, cols] and zeroed per-tile counters; every call leaves the counters zeroed.
    Created by the first (eager) call of a shape, never while a CUDA graph is being captured."""
    key = (str(device), m, cols, split)
    if key not in _workspaces:
        _workspaces[key] = (
            torch.empty((split, m, cols), dtype=torch.int32, device=device),
            torch.zeros((8192,), dtype=torch.int32, device=device),
        )
    return _workspaces[key]


def check_packed(packed: torch.Tensor, rows: int, k: int, where: str) -> None:
    kp = packed_row_bytes(k)
    if packed.dtype != torch.uint8 or packed.dim() != 2 or tuple(packed.shape) != (rows, kp):
        raise ValueError(
            f"{where}: expected packed triton-2bit-v1 weights uint8 [{rows}, {kp}] for K={k}, "
            f"found {packed.dtype} {tuple(packed.shape)}"
        )
    if not packed.is_contiguous():
        raise ValueError(f"{where}: packed weights must be contiguous")


def ternary_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    out_features: int,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    gated: bool = False,
    act: str = "relu2",
    eps: float = 1e-5,
    out: torch.Tensor | None = None,
    path: str | None = None,
) -> torch.Tensor:
    """y = [residual +] f((X @ T^T) * s / a) with X = int8(rmsnorm?(x)); f = act(gate) * up when `gated`.

    x [..., K]; packed uint8 [R, Kp] with R = out_features (2*out_features when gated: gate rows then up rows);
    scale float32 [1] or [R] (per output row). Output dtype = x.dtype (or `out`'s).
    """
    k = x.shape[-1]
    lead = x.shape[:-1]
    rows = out_features * (2 if gated else 1)
    check_packed(packed, rows, k, "ternary_linear")
    x2 = x.reshape(-1, k)  # [M, K]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    scale = scale.reshape(-1)
    per_row = scale.numel() != 1
    if per_row and scale.numel() != rows:
        raise ValueError(f"ternary_linear: scale has {scale.numel()} values, expected 1 or {rows}")
    if scale.dtype != torch.float32:
        scale = scale.float()
    if out is None:
        out = torch.empty((m, out_features), dtype=x.dtype, device=x.device)
    y = out.reshape(m, out_features)
    r = residual.reshape(m, out_features) if residual is not None else y
    nw = norm_weight if norm_weight is not None else scale
    actc = K.ACT_CODES[act]
    if m == 0:
        return out.reshape(*lead, out_features)
    flags = (gated, norm_weight is not None, residual is not None, per_row)
    kp = packed.shape[1]
    bm = _next_pow2(m)

    def launch_gemv(cfg):
        cfg = {k2: v for k2, v in cfg.items() if k2 != "path"}
        grid = (triton.cdiv(out_features, cfg["BN"]),)
        K._gemv_kernel[grid](
            x2,
            nw,
            packed.view(torch.int32),
            scale,
            r,
            y,
            m,
            out_features,
            k,
            kp // 4,
            x2.stride(0),
            r.stride(0),
            y.stride(0),
            eps,
            HAS_NORM=norm_weight is not None,
            HAS_RES=residual is not None,
            GATED=gated,
            ACT=actc,
            PER_ROW=per_row,
            PTX=PTX,
            BM=bm,
            **cfg,
        )

    def quant():
        q = torch.empty((m, 4 * kp), dtype=torch.int8, device=x.device)
        a = torch.empty((m,), dtype=torch.float32, device=x.device)
        rs = torch.empty((m,), dtype=torch.int32, device=x.device)
        K._quant_kernel[(m,)](
            x2,
            nw,
            q,
            a,
            rs,
            k,
            4 * kp,
            x2.stride(0),
            q.stride(0),
            eps,
            HAS_NORM=norm_weight is not None,
            PTX=PTX,
            BK=_next_pow2(4 * kp),
            num_warps=1 if K.INTERPRET else (8 if k > 4096 else 4),
            **pdl_kw(),
        )
        return q, a, rs

    def launch_gemv8(cfg):
        q, a, rs = quant()
        grid = (triton.cdiv(out_features, cfg["BN"]),)
        K._gemv8_kernel[grid](
            q.view(torch.int32),
            a,
            rs,
            packed.view(torch.int32),
            scale,
            r,
            y,
            m,
            out_features,
            kp // 4,
            q.stride(0) // 4,
            r.stride(0),
            y.stride(0),
            HAS_RES=residual is not None,
            GATED=gated,
            ACT=actc,
            PER_ROW=per_row,
            PTX=PTX,
            BM=bm,
            BN=cfg["BN"],
            BKW=cfg["BKW"],
            num_warps=cfg["num_warps"],
        )

    def launch_splitk(cfg):
        q, a, rs = quant()
        ws, cnt = _workspace(x.device, m, rows, cfg["SPLIT"])
        grid = (triton.cdiv(out_features, cfg["BN"]), cfg["SPLIT"], triton.cdiv(m, cfg["BM"]))
        K._splitk_kernel[grid](
            q,
            a,
            rs,
            packed,
            scale,
            r,
            y,
            ws,
            cnt,
            m,
            out_features,
            kp,
            cfg["CPS"],
            cfg["SPLIT"],
            q.stride(0),
            r.stride(0),
            y.stride(0),
            HAS_RES=residual is not None,
            GATED=gated,
            ACT=actc,
            PER_ROW=per_row,
            PTX=PTX,
            USE_SPLIT=cfg["SPLIT"] > 1,
            SWAP=cfg.get("SWAP", False),
            BM=cfg["BM"],
            BN=cfg["BN"],
            BKB=cfg["BKB"],
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
            **pdl_kw(),
        )

    def launch_gemm(cfg):
        q, a, rs = quant()
        cfg = {k2: v for k2, v in cfg.items() if k2 != "path"}
        out_n = cfg["BN"] // 2 if cfg.get("PAIR") else cfg["BN"]
        grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(out_features, out_n),)
        K._gemm_kernel[grid](
            q,
            a,
            rs,
            packed,
            scale,
            r,
            y,
            m,
            out_features,
            kp,
            q.stride(0),
            r.stride(0),
            y.stride(0),
            HAS_RES=residual is not None,
            GATED=gated,
            ACT=actc,
            PER_ROW=per_row,
            PTX=PTX,
            **cfg,
        )

    def launch_row(cfg):
        kw = kp // 4
        if cfg["path"] == "rowq":
            q, a, rs = quant()
            qw, sq = q.view(torch.int32), q.stride(0) // 4
        else:
            q = a = rs = qw = scale  # unused pointers
            sq = 0
        K._gemv_row_kernel[(triton.cdiv(out_features, cfg["BN"]),)](
            x2,
            nw,
            qw,
            a,
            rs,
            packed.view(torch.int32),
            scale,
            r,
            y,
            m,
            out_features,
            k,
            kw,
            x2.stride(0),
            sq,
            r.stride(0),
            y.stride(0),
            eps,
            PREQ=cfg["path"] == "rowq",
            HAS_NORM=norm_weight is not None,
            HAS_RES=residual is not None,
            GATED=gated,
            ACT=actc,
            PER_ROW=per_row,
            PTX=PTX,
            BN=cfg["BN"],
            KWP=_next_pow2(kw),
            num_warps=cfg["num_warps"],
            **pdl_kw(),
        )

    def launch(cfg):
        {
            "gemv": launch_gemv,
            "gemv8": launch_gemv8,
            "splitk": launch_splitk,
            "gemm": launch_gemm,
            "row": launch_row,
            "rowq": launch_row,
        }[cfg["path"]](cfg)

    gemv = [dict(path="gemv", **c) for c in _gemv_candidates(bm, gated, k)]
    splitk = (
        _splitk_candidates(m, out_features, kp, gated)
        if m <= SPLITK_MAX_M or path in ("splitk", "splitk_t")
        else []
    )
    gemm = [dict(path="gemm", **c) for c in _gemm_candidates(m, gated)]
    gemv8 = _gemv8_candidates(bm, gated)
    row = _row_candidates(kp // 4, gated, "row")
    rowq = _row_candidates(kp // 4, gated, "rowq")
    if path is None:  # the first candidate is the untuned default
        if m <= ROW_MAX_M:
            cands = row + rowq[:3] + splitk[:2] + gemv8[:1]
        elif m <= GEMV_MAX_M:
            cands = splitk[:4] + rowq[:2] + gemv8[:2] + gemv[:1]
        else:
            cands = splitk if m <= SPLITK_MAX_M else gemm
    else:
        cands = {
            "gemv": gemv,
            "gemv8": gemv8,
            "splitk": [c for c in splitk if not c["SWAP"]],
            "splitk_t": [c for c in splitk if c["SWAP"]],
            "gemm": [c for c in gemm if not c.get("SWAP")],
            "gemm_t": [c for c in gemm if c.get("SWAP") and not c.get("PAIR")],
            "gemm_pair": [c for c in gemm if c.get("PAIR")],
            "row": row,
            "rowq": rowq,
        }[path]
    mb = min(bm, 1024)  # tune per power-of-two bucket of M
    key = (path or "auto", out_features, k, mb, *flags)
    launch(_tune(key, cands, launch))
    return out.reshape(*lead, out_features)


def quantize_rows(x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-5):
    """The GEMM path's quantization alone: (xq int8 [M, K], a float32 [M], rowsum int32 [M]) for tests."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    kpad = 4 * packed_row_bytes(k)
    q = torch.empty((m, kpad), dtype=torch.int8, device=x.device)
    a = torch.empty((m,), dtype=torch.float32, device=x.device)
    rs = torch.empty((m,), dtype=torch.int32, device=x.device)
    nw = norm_weight if norm_weight is not None else a
    K._quant_kernel[(m,)](
        x2,
        nw,
        q,
        a,
        rs,
        k,
        kpad,
        x2.stride(0),
        q.stride(0),
        eps,
        HAS_NORM=norm_weight is not None,
        PTX=PTX,
        BK=_next_pow2(kpad),
        num_warps=1 if K.INTERPRET else 4,
    )
    return q[:, :k], a, rs


def w8_linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """float32 [..., N] = (x in bf16) @ (int8 w [N, K])^T * s[N]: the int8 LM head."""
    k = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], w.shape[0]
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if K.INTERPRET:
        cfg = dict(BM=16, BN=16, BK=32, num_warps=1)
    else:
        cfg = dict(
            BM=16 if m <= 16 else 64, BN=64 if m <= 16 else 128, BK=128 if m <= 16 else 64, num_warps=4
        )
    grid = (triton.cdiv(n, cfg["BN"]), triton.cdiv(m, cfg["BM"]))
    K._w8_kernel[grid](x2, w, s, y, m, n, k, x2.stride(0), y.stride(0), PTX=PTX, **cfg, **pdl_kw())
    return y.reshape(*lead, n)
