"""A split-K projection left for the next kernel to finish (`ternary_linear(defer=True)`; the engine's decode
steps defer o and down up to `DecodePlan.defer_max_b` rows).

A split-K GEMM's last program per tile used to take a counter, read the other splits' partial sums back and run
the epilogue (scales, activation, residual) before the next kernel could start. Deferred, every program adds its
int32 partial into zeroed sums and stops (integer adds in any order are exact), and the quantization launch that
follows, which reads the whole row anyway, runs the epilogue on the summed row, stores the output rows, zeroes the
sums for the next replay and quantizes (`quant._finish_quant_kernel`). The outputs are the same bits.

A `SplitKSums` must be consumed exactly once: by `launch.launch_quant` (hence `ternary_linear`,
`decode.quantize_into`), or by `finish()`; its sums buffer is shared by every deferred projection of its shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from bitnetlm.kernels.triton.common import PTX
from bitnetlm.kernels.triton.plan import DecodePlan
from bitnetlm.kernels.triton.quant import _finish_quant_kernel, quant_launch_kw

_sums: dict[tuple, torch.Tensor] = {}


def sums_buffer(device, m: int, cols: int) -> torch.Tensor:
    """Zeroed int32 sums [m, cols], one per shape and device; every consumer leaves it zeroed. Created by the
    first (eager) call of a shape, never while a CUDA graph is being captured."""
    key = (str(device), m, cols)
    if key not in _sums:
        _sums[key] = torch.zeros((m, cols), dtype=torch.int32, device=device)
    return _sums[key]


@dataclass
class SplitKSums:
    """An unfinished projection y = [residual +] f((X @ C^T - rowsum) * s / a) of M rows."""

    sums: (
        torch.Tensor
    )  # int32 [S, M, R]: X @ C^T in S parts, R = N weight rows (2N when gated: gate, then up)
    a: torch.Tensor  # float32 [>= M]: the input rows' activation scales
    rs: torch.Tensor  # int32 [>= M]: the input rows' code sums
    scale: torch.Tensor  # float32 [1] or [R]: the weight scale(s)
    out: torch.Tensor  # [M, N]: the output rows, written by the finishing launch
    residual: torch.Tensor | None  # [M, N]
    gated: bool
    act: int  # common.ACT_CODES

    @property
    def shape(self) -> torch.Size:
        return self.out.shape

    def finish(self, plan: DecodePlan | None = None) -> torch.Tensor:
        """Run the epilogue alone (no quantization after it): the output rows [M, N]."""
        launch_finish(self, None, None, None, None, 0.0, plan=plan)
        return self.out


def launch_finish(
    src: SplitKSums,
    norm_weight: torch.Tensor | None,
    q: torch.Tensor | None,
    a: torch.Tensor | None,
    rs: torch.Tensor | None,
    eps: float,
    late: bool = False,
    plan: DecodePlan | None = None,
) -> None:
    """`src`'s epilogue into src.out, then (q given) `launch.launch_quant`'s work on those rows into q, a, rs."""
    m, n = src.out.shape
    quant = q is not None
    nw = norm_weight if norm_weight is not None else src.a
    _finish_quant_kernel[(m,)](
        src.sums,
        src.a,
        src.rs,
        src.scale,
        src.residual if src.residual is not None else src.out,
        src.out,
        nw,
        q if quant else src.sums,
        a if quant else src.a,
        rs if quant else src.rs,
        n,
        q.shape[1] if quant else n,
        src.sums.stride(0),
        src.residual.stride(0) if src.residual is not None else 0,
        src.out.stride(0),
        q.stride(0) if quant else 0,
        eps,
        GATED=src.gated,
        ACT=src.act,
        PER_ROW=src.scale.numel() != 1,
        HAS_RES=src.residual is not None,
        HAS_NORM=quant and norm_weight is not None,
        QUANT=quant,
        PTX=PTX,
        BK=triton.next_power_of_2(q.shape[1] if quant else n),
        **quant_launch_kw(m, n, late, plan),
    )
