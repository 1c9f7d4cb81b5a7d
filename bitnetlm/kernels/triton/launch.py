"""Python launchers for the Triton kernels: shape checks, path choice (GEMV vs GEMM), programmatic dependent
launch; the candidate configurations and their timing are in tune.py.

Call the ops once outside CUDA-graph capture (a warm-up) so no tuning happens while capturing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

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


@dataclass
class _Linear:
    """One `ternary_linear` call's operands and options, as each of its launches reads them."""

    x: torch.Tensor  # the input (a deferred input's output rows)
    x2: torch.Tensor  # x as [M, K] rows of unit stride
    src: SplitKSums | None  # a deferred input: the final launch consumes it
    packed: torch.Tensor
    scale: torch.Tensor  # float32 [1] or [R]
    per_row: bool
    out_features: int
    out: torch.Tensor  # the output (`out`, or a new tensor)
    y: torch.Tensor  # out as rows [M, N]
    r: torch.Tensor  # the residual rows (y without a residual)
    nw: torch.Tensor  # the norm weights (scale without a norm)
    norm_weight: torch.Tensor | None
    residual: torch.Tensor | None
    gated: bool
    actc: int
    eps: float
    quant_late: bool
    defer: bool
    plan: DecodePlan
    final: bool = False  # the launch after tuning: it consumes src, and it may defer

    @property
    def m(self) -> int:
        return self.x2.shape[0]

    @property
    def k(self) -> int:
        return self.x.shape[-1]

    @property
    def lead(self) -> torch.Size:
        return self.x.shape[:-1]

    @property
    def kp(self) -> int:
        return self.packed.shape[1]

    @property
    def bm(self) -> int:
        return _next_pow2(self.m)

    @property
    def rows(self) -> int:
        return self.out_features * (2 if self.gated else 1)


def _unit_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x as [M, K] rows whose last dimension has unit stride (a copy only where it has not)."""
    x2 = x.reshape(-1, k)  # [M, K]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def _checked_scale(scale: torch.Tensor, rows: int) -> tuple[torch.Tensor, bool]:
    """The weight scales as float32 [1] or [rows], and whether there is one per row."""
    scale = scale.reshape(-1)
    per_row = scale.numel() != 1
    if per_row and scale.numel() != rows:
        raise ValueError(f"ternary_linear: scale has {scale.numel()} values, expected 1 or {rows}")
    if scale.dtype != torch.float32:
        scale = scale.float()
    return scale, per_row


def _prepare(
    x, packed, scale, out_features, norm_weight, residual, gated, act, eps, out, quant_late, defer, plan
) -> _Linear:
    """A call's checked operands: the input as unit-stride rows, float32 scales, the output and residual rows."""
    src = x if isinstance(x, SplitKSums) else None  # consumed by the final launch (the tuner's read src.out)
    if src is not None:
        x = src.out
    k = x.shape[-1]
    rows = out_features * (2 if gated else 1)
    check_packed(packed, rows, k, "ternary_linear")
    x2 = _unit_rows(x, k)
    m = x2.shape[0]
    scale, per_row = _checked_scale(scale, rows)
    if out is None:
        out = torch.empty((m, out_features), dtype=x.dtype, device=x.device)
    y = out.reshape(m, out_features)
    r = residual.reshape(m, out_features) if residual is not None else y
    return _Linear(
        x=x,
        x2=x2,
        src=src,
        packed=packed,
        scale=scale,
        per_row=per_row,
        out_features=out_features,
        out=out,
        y=y,
        r=r,
        nw=norm_weight if norm_weight is not None else scale,
        norm_weight=norm_weight,
        residual=residual,
        gated=gated,
        actc=ACT_CODES[act],
        eps=eps,
        quant_late=quant_late,
        defer=defer,
        plan=plan,
    )


def _quant(c: _Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The quantization launch over the input rows (in the final launch, a deferred input's): (q, a, rowsum)."""
    q = torch.empty((c.m, 4 * c.kp), dtype=torch.int8, device=c.x.device)
    a = torch.empty((c.m,), dtype=torch.float32, device=c.x.device)
    rs = torch.empty((c.m,), dtype=torch.int32, device=c.x.device)
    xs = c.src if c.final and c.src is not None else c.x2
    launch_quant(xs, c.norm_weight, q, a, rs, c.eps, late=c.quant_late, plan=c.plan)
    return q, a, rs


def _launch_dp4a(c: _Linear, kernel, cfg: dict, w: torch.Tensor, **kw) -> None:
    """The dp4a GEMVs: quantization fused into each program, or a `_quant_kernel` launch first (PREQ)."""
    if cfg["path"] in ("gemv8", "rowq"):
        q, a, rs = _quant(c)
        qw, sq = q.view(torch.int32), q.stride(0) // 4
    else:
        if c.final and c.src is not None:  # these programs read x itself
            c.src.finish(c.plan)
        qw = a = rs = c.scale  # unused pointers
        sq = 0
    rows = cfg["BN"] + kw.get("BN2", 0)  # a program's output rows
    kernel[(triton.cdiv(c.out_features, rows),)](
        c.x2,
        c.nw,
        qw,
        a,
        rs,
        w.view(torch.int32),
        c.scale,
        c.r,
        c.y,
        c.m,
        c.out_features,
        c.k,
        c.kp // 4,
        c.x2.stride(0),
        sq,
        c.r.stride(0),
        c.y.stride(0),
        c.eps,
        PREQ=cfg["path"] in ("gemv8", "rowq"),
        HAS_NORM=c.norm_weight is not None,
        HAS_RES=c.residual is not None,
        GATED=c.gated,
        ACT=c.actc,
        PER_ROW=c.per_row,
        PTX=PTX,
        **{k2: v for k2, v in cfg.items() if k2 != "path"},
        **kw,
    )


def _launch_row(c: _Linear, cfg: dict, w: torch.Tensor) -> None:
    """The row GEMVs (fused quantization, or pre-quantized rows: rowq), a row in one or two parts and a program's
    rows in one or two tiles (`_row_parts`, `_row_tiles`)."""
    early = cfg["path"] == "row" and c.norm_weight is not None and c.k <= c.plan.early_norm_max_k
    kwa, kwb = _row_parts(c.kp // 4) if cfg["path"] == "rowq" else (_next_pow2(c.kp // 4), 0)
    plain = not c.gated and not kwb and c.k > c.plan.row_tiles_min_k
    bn, bn2 = _row_tiles(c.out_features, cfg["BN"], sm_count(c.x.device, c.plan)) if plain else (cfg["BN"], 0)
    rc = dict(cfg, BN=bn)
    kwr = dict(KWP=kwa, KWB=kwb, BN2=bn2, EARLY_NORM=early)
    _launch_dp4a(c, _gemv_row_kernel, rc, w, **kwr, **pdl_kw(c.plan))


def _launch_mma(c: _Linear, grid: tuple, ws, cnt, cps: int, w: torch.Tensor, **kw):
    """The quantization launch, then the tensor-core GEMM; returns the GEMM's input scales and row sums."""
    q, a, rs = _quant(c)
    _gemm_kernel[grid](
        q,
        a,
        rs,
        w,
        c.scale,
        c.r,
        c.y,
        ws,
        cnt,
        c.m,
        c.out_features,
        c.kp,
        cps,
        q.stride(0),
        c.r.stride(0),
        c.y.stride(0),
        HAS_RES=c.residual is not None,
        GATED=c.gated,
        ACT=c.actc,
        PER_ROW=c.per_row,
        PTX=PTX,
        **kw,
    )
    return a, rs


def _launch_splitk(c: _Linear, cfg: dict, w: torch.Tensor) -> SplitKSums | None:
    """The split-K GEMM; the unfinished `SplitKSums` where the final launch defers (several splits), else None."""
    dfr = c.defer and c.final and cfg["SPLIT"] > 1
    if dfr:
        ws = cnt = sums_buffer(c.x.device, c.m, c.rows)  # no counters: no program waits for the others
    else:
        ws, cnt = _workspace(c.x.device, c.m, c.rows, cfg["SPLIT"])
    out_n = cfg["BN"] // 2 if cfg.get("PAIR") else cfg["BN"]
    grid = (triton.cdiv(c.out_features, out_n), cfg["SPLIT"], triton.cdiv(c.m, cfg["BM"]))
    kw = {k2: v for k2, v in cfg.items() if k2 not in ("path", "CPS")}
    kw.update(LATE=c.m >= c.plan.gemm_late_min_m, DEFER=dfr, **pdl_kw(c.plan))
    a, rs = _launch_mma(c, grid, ws, cnt, cfg["CPS"], w, **kw)
    if not dfr:
        return None
    return SplitKSums(ws, a, rs, c.scale, c.y, c.r if c.residual is not None else None, c.gated, c.actc)


def _launch_gemm(c: _Linear, cfg: dict, w: torch.Tensor) -> None:
    """The tiled tensor-core GEMM (no workspace: the weights stand in for its pointers)."""
    kw = {k2: v for k2, v in cfg.items() if k2 != "path"}
    out_n = cfg["BN"] // 2 if cfg.get("PAIR") else cfg["BN"]
    grid = (triton.cdiv(c.m, cfg["BM"]) * triton.cdiv(c.out_features, out_n),)
    _launch_mma(c, grid, w, w, 0, w, **kw)


def _launch(c: _Linear, cfg: dict, w: torch.Tensor) -> SplitKSums | None:
    """One launch (two with a quantization launch first) of candidate cfg over weights w (packed, or the tuner's
    copy of it); a deferred split-K projection's SplitKSums, else None."""
    if cfg["path"] in ("gemv", "gemv8"):
        _launch_dp4a(c, _gemv_kernel, cfg, w, BM=c.bm)
    elif cfg["path"] in ("row", "rowq"):
        _launch_row(c, cfg, w)
    elif cfg["path"] == "splitk":
        return _launch_splitk(c, cfg, w)
    else:
        _launch_gemm(c, cfg, w)


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
    c = _prepare(
        x, packed, scale, out_features, norm_weight, residual, gated, act, eps, out, quant_late, defer, plan
    )
    if c.m == 0:
        return c.out.reshape(*c.lead, out_features)
    mb = min(c.bm, 1024)  # tune per power-of-two bucket of M
    flags = (gated, norm_weight is not None, residual is not None, c.per_row)
    key = (path or "auto", out_features, c.k, mb, *flags)
    cfg = _tune(
        key, lambda: linear_candidates(c.m, out_features, c.k, gated, path, plan), partial(_launch, c), packed
    )
    c.final = True
    deferred = _launch(c, cfg, packed)
    return deferred if deferred is not None else c.out.reshape(*c.lead, out_features)


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
