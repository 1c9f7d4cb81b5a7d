"""Python launchers for the Triton kernels: shape checks, path choice (GEMV vs GEMM), programmatic dependent
launch; the candidate configurations and their timing are in tune.py.

Call the ops once outside CUDA-graph capture (a warm-up) so no tuning happens while capturing.
"""

from __future__ import annotations

import torch
import triton

from bitnetlm.kernels.triton.common import ACT_CODES, PTX, pdl_kw, sm_count
from bitnetlm.kernels.triton.deferred import SplitKSums, launch_finish, sums_buffer
from bitnetlm.kernels.triton.gemm import _gemm_kernel
from bitnetlm.kernels.triton.gemv import _gemv_kernel, _gemv_row_kernel
from bitnetlm.kernels.triton.layout import packed_row_bytes
from bitnetlm.kernels.triton.plan import DecodePlan, resolve
from bitnetlm.kernels.triton.quant import _quant_kernel, quant_launch_kw
from bitnetlm.kernels.triton.tune import (
    _gemm_candidates,
    _gemv8_candidates,
    _gemv_candidates,
    _next_pow2,
    _row_candidates,
    _splitk_candidates,
    _tune,
)

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


def linear_candidates(
    m: int, out_features: int, k: int, gated: bool, path: str | None = None, plan: DecodePlan | None = None
) -> list[dict]:
    """`ternary_linear`'s candidate tiles for M rows (path None: every path its M allows, by the plan's row
    bounds; the first is the untuned default)."""
    plan = resolve(plan)
    bm, kp = _next_pow2(m), packed_row_bytes(k)
    gemv = [dict(path="gemv", **c) for c in _gemv_candidates(bm, gated, k)]
    splitk = (
        _splitk_candidates(m, out_features, kp, gated)
        if m <= plan.splitk_prefill_max_m or path in ("splitk", "splitk_t", "splitk_pair")
        else []
    )
    gemm = [dict(path="gemm", **c) for c in _gemm_candidates(m, gated)]
    gemv8 = _gemv8_candidates(bm, gated)
    row = _row_candidates(kp // 4, gated, "row")
    rowq = _row_candidates(kp // 4, gated, "rowq")
    swapped = [c for c in splitk if c["SWAP"] and not c.get("PAIR")]
    unswapped = [c for c in splitk if not c["SWAP"]]
    pair = [c for c in splitk if c.get("PAIR")]
    if path is None:
        if m <= plan.row_max_m:  # (gate|up's unsplit pairs: batch 2's choice on the H200)
            return row + rowq[:3] + swapped[:2] + gemv8[:1] + [c for c in pair if c["SPLIT"] == 1]
        if m <= plan.gemv_max_m:
            return swapped + unswapped[:1] + pair + rowq[:2] + gemv8[:2] + gemv[:1]
        if m <= plan.splitk_max_m:
            return splitk
        return gemm + swapped  # (empty above plan.splitk_prefill_max_m)
    return {
        "gemv": gemv,
        "gemv8": gemv8,
        "splitk": unswapped,
        "splitk_t": swapped,
        "splitk_pair": pair,
        "gemm": [c for c in gemm if not c.get("SWAP")],
        "gemm_t": [c for c in gemm if c.get("SWAP") and not c.get("PAIR")],
        "gemm_pair": [c for c in gemm if c.get("PAIR")],
        "row": row,
        "rowq": rowq,
    }[path]


def _row_parts(kw: int) -> tuple[int, int]:
    """A row of kw words as the pre-quantized row GEMV's two power-of-two parts (first, second; second 0: one
    part): 160 words (K = 2560) as 128 + 32 lanes instead of 256, where the split saves a quarter (no lanes work
    on padding: fewer instructions after the PDL wait and fewer registers)."""
    whole = _next_pow2(kw)
    first = whole // 2
    second = _next_pow2(kw - first) if kw > first else 0
    if second == 0 or first + second > whole * 3 // 4:
        return whole, 0
    return first, second


def _row_tiles(n: int, bn: int, sms: int) -> tuple[int, int]:
    """Rows a row-GEMV program runs for n output rows in tiles of bn (first, second; second 0: one part): bn when
    its grid fills three quarters of the SMs, else bn / 2 plus the smallest power of two that fits one program an
    SM (2,560 rows, bn 32, 132 SMs: 16 + 4, not 80 programs of 32, which spilled registers)."""
    if triton.cdiv(n, bn) * 4 > sms * 3:
        return bn, 0
    first = bn // 2
    second = 1
    while second < first and triton.cdiv(n, first + second) > sms:
        second *= 2
    return (first, second) if second < first else (bn, 0)


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
    quant_late: bool = False,
    defer: bool = False,
    plan: DecodePlan | None = None,
) -> torch.Tensor | SplitKSums:
    """y = [residual +] f((X @ T^T) * s / a) with X = int8(rmsnorm?(x)); f = act(gate) * up when `gated`.

    x [..., K] (or a deferred projection's `SplitKSums`, which this call's quantization finishes); packed uint8
    [R, Kp] with R = out_features (2*out_features when gated: gate rows then up rows); scale float32 [1] or [R]
    (per output row). Output dtype = x.dtype (or `out`'s).
    quant_late: a quantization launch in front lets the GEMM launch only after its own wait (`launch_quant`).
    defer: when the tuned path is split-K over several splits, return the unfinished `SplitKSums` [M rows]
    instead, for the next quantization launch to finish (deferred.py); else the output as usual.
    plan: the `DecodePlan` whose rules pick the paths and launch options (None: the default plan).
    """
    plan = resolve(plan)
    src = x if isinstance(x, SplitKSums) else None  # consumed by the final launch (the tuner's read src.out)
    if src is not None:
        x = src.out
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
    actc = ACT_CODES[act]
    if m == 0:
        return out.reshape(*lead, out_features)
    flags = (gated, norm_weight is not None, residual is not None, per_row)
    kp = packed.shape[1]
    bm = _next_pow2(m)
    final = [False]  # the launch after tuning: it consumes src, and it may defer

    def quant():
        q = torch.empty((m, 4 * kp), dtype=torch.int8, device=x.device)
        a = torch.empty((m,), dtype=torch.float32, device=x.device)
        rs = torch.empty((m,), dtype=torch.int32, device=x.device)
        xs = src if final[0] and src is not None else x2
        launch_quant(xs, norm_weight, q, a, rs, eps, late=quant_late, plan=plan)
        return q, a, rs

    def launch_dp4a(kernel, cfg, w, **kw):
        """The dp4a GEMVs: quantization fused into each program, or a `_quant_kernel` launch first (PREQ)."""
        if cfg["path"] in ("gemv8", "rowq"):
            q, a, rs = quant()
            qw, sq = q.view(torch.int32), q.stride(0) // 4
        else:
            if final[0] and src is not None:  # these programs read x itself
                src.finish(plan)
            qw = a = rs = scale  # unused pointers
            sq = 0
        rows = cfg["BN"] + kw.get("BN2", 0)  # a program's output rows
        kernel[(triton.cdiv(out_features, rows),)](
            x2,
            nw,
            qw,
            a,
            rs,
            w.view(torch.int32),
            scale,
            r,
            y,
            m,
            out_features,
            k,
            kp // 4,
            x2.stride(0),
            sq,
            r.stride(0),
            y.stride(0),
            eps,
            PREQ=cfg["path"] in ("gemv8", "rowq"),
            HAS_NORM=norm_weight is not None,
            HAS_RES=residual is not None,
            GATED=gated,
            ACT=actc,
            PER_ROW=per_row,
            PTX=PTX,
            **{k2: v for k2, v in cfg.items() if k2 != "path"},
            **kw,
        )

    def launch_mma(grid, ws, cnt, cps, w, **kw):
        """The quantization launch, then the tensor-core GEMM; returns the GEMM's input scales and row sums."""
        q, a, rs = quant()
        _gemm_kernel[grid](
            q,
            a,
            rs,
            w,
            scale,
            r,
            y,
            ws,
            cnt,
            m,
            out_features,
            kp,
            cps,
            q.stride(0),
            r.stride(0),
            y.stride(0),
            HAS_RES=residual is not None,
            GATED=gated,
            ACT=actc,
            PER_ROW=per_row,
            PTX=PTX,
            **kw,
        )
        return a, rs

    def launch_splitk(cfg, w):
        dfr = defer and final[0] and cfg["SPLIT"] > 1
        if dfr:
            ws = cnt = sums_buffer(x.device, m, rows)  # no counters: no program waits for the others
        else:
            ws, cnt = _workspace(x.device, m, rows, cfg["SPLIT"])
        out_n = cfg["BN"] // 2 if cfg.get("PAIR") else cfg["BN"]
        grid = (triton.cdiv(out_features, out_n), cfg["SPLIT"], triton.cdiv(m, cfg["BM"]))
        kw = {k2: v for k2, v in cfg.items() if k2 not in ("path", "CPS")}
        kw.update(LATE=m >= plan.gemm_late_min_m, DEFER=dfr, **pdl_kw(plan))
        a, rs = launch_mma(grid, ws, cnt, cfg["CPS"], w, **kw)
        return (
            SplitKSums(ws, a, rs, scale, y, r if residual is not None else None, gated, actc) if dfr else None
        )

    def launch_gemm(cfg, w):
        kw = {k2: v for k2, v in cfg.items() if k2 != "path"}
        out_n = cfg["BN"] // 2 if cfg.get("PAIR") else cfg["BN"]
        grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(out_features, out_n),)
        launch_mma(grid, w, w, 0, w, **kw)  # no workspace: the weights stand in for its pointers

    def launch(cfg, w=packed):
        """One launch (two with a quantization launch first) of candidate cfg over weights w (packed, or the
        tuner's copy of it); a deferred split-K projection's SplitKSums, else None."""
        if cfg["path"] in ("gemv", "gemv8"):
            launch_dp4a(_gemv_kernel, cfg, w, BM=bm)
        elif cfg["path"] in ("row", "rowq"):
            early = cfg["path"] == "row" and norm_weight is not None and k <= plan.early_norm_max_k
            kwa, kwb = _row_parts(kp // 4) if cfg["path"] == "rowq" else (_next_pow2(kp // 4), 0)
            plain = not gated and not kwb and k > plan.row_tiles_min_k
            bn, bn2 = (
                _row_tiles(out_features, cfg["BN"], sm_count(x.device, plan)) if plain else (cfg["BN"], 0)
            )
            c = dict(cfg, BN=bn)
            kwr = dict(KWP=kwa, KWB=kwb, BN2=bn2, EARLY_NORM=early)
            launch_dp4a(_gemv_row_kernel, c, w, **kwr, **pdl_kw(plan))
        elif cfg["path"] == "splitk":
            return launch_splitk(cfg, w)
        else:
            launch_gemm(cfg, w)

    mb = min(bm, 1024)  # tune per power-of-two bucket of M
    key = (path or "auto", out_features, k, mb, *flags)
    cfg = _tune(key, lambda: linear_candidates(m, out_features, k, gated, path, plan), launch, packed)
    final[0] = True
    deferred = launch(cfg)
    return deferred if deferred is not None else out.reshape(*lead, out_features)


def launch_quant(
    x: torch.Tensor | SplitKSums,
    norm_weight: torch.Tensor | None,
    q: torch.Tensor,
    a: torch.Tensor,
    rs: torch.Tensor,
    eps: float,
    late: bool = False,
    plan: DecodePlan | None = None,
) -> None:
    """rmsnorm? + per-row int8 quantization of x [M, K] (unit stride) into q int8 [>= M, 4*Kp] (zero padded),
    a float32 [>= M], rowsum int32 [>= M]: the `_quant_kernel` launch in front of the GEMMs and pre-quantized
    GEMVs. late: the next kernel launches only after this one's PDL wait (as the plan has it for some row
    counts, `quant.quant_launch_kw`). x a deferred projection: that projection's epilogue runs first, in the same
    launch (deferred.py)."""
    if isinstance(x, SplitKSums):
        return launch_finish(x, norm_weight, q, a, rs, eps, late, plan)
    m, k = x.shape
    _quant_kernel[(m,)](
        x,
        norm_weight if norm_weight is not None else a,
        q,
        a,
        rs,
        k,
        q.shape[1],
        x.stride(0),
        q.stride(0),
        eps,
        HAS_NORM=norm_weight is not None,
        PTX=PTX,
        BK=_next_pow2(q.shape[1]),
        **quant_launch_kw(m, k, late, plan),
    )


def quantize_rows(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-5,
    plan: DecodePlan | None = None,
):
    """The GEMM path's quantization alone: (xq int8 [M, K], a float32 [M], rowsum int32 [M]) for tests."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    kpad = 4 * packed_row_bytes(k)
    q = torch.empty((m, kpad), dtype=torch.int8, device=x.device)
    a = torch.empty((m,), dtype=torch.float32, device=x.device)
    rs = torch.empty((m,), dtype=torch.int32, device=x.device)
    launch_quant(x2, norm_weight, q, a, rs, eps, plan=plan)
    return q[:, :k], a, rs
