"""The two ends of a captured decode step, one launch each instead of a chain of small PyTorch kernels.

- `embed_int8`: rows of the int8 (per-row scaled) embedding for the step's tokens, dequantized to the
  activation dtype (PyTorch: two gathers, a conversion, a multiply and a cast; five launches of 1-5 us);
- `greedy_step`: argmax of each row's logits (first index of the maximum, a NaN above every number, as
  `torch.argmax`), then the step's bookkeeping: the token into `tok` and `out[:, step]`, pos += 1, step += 1
  (PyTorch: nine launches). Each row's vocabulary is cut into chunks, one program each; the last program of a
  row to finish (an atomic counter) reduces the chunks' maxima, and the last row to finish advances `step`.
  Counters reset themselves, so graph replays need no memset. With `index=` it reduces the int8 head's tile
  maxima instead of logits (`head.w8a16_argmax`: the logits are never stored); their 2,004 tiles (128k
  vocabulary) fit one chunk a row, whose program writes the token with no counter or partials (nor a row counter
  at batch 1): the greedy step then ends about 6 us after the head instead of 9 (H200, docs/PERF_LOG.md, 2026-11-29). The
  engine's greedy step with the int8 head does not launch it: the head does the same inside its own launch
  (`head.w8a16_greedy`); the bf16 head's step does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bitnetlm.kernels.triton.common import INTERPRET, _argmax_chunks, _argmax_step, _pdl_wait, pdl_kw
from bitnetlm.kernels.triton.plan import DecodePlan


@triton.jit
def _embed_int8_kernel(tok_ptr, q_ptr, s_ptr, y_ptr, K, BK: tl.constexpr, PDL: tl.constexpr = False):
    r = tl.program_id(0)
    # the step's first kernel lets the next launch only once the previous step has finished (its sampler wrote
    # pos and tok): from here to the sampler pos is constant, which the attention relies on (reads it early)
    _pdl_wait(PDL, AFTER=True)
    t = tl.load(tok_ptr + r).to(tl.int64)
    offs = tl.arange(0, BK)
    mk = offs < K
    q = tl.load(q_ptr + t * K + offs, mask=mk, other=0).to(tl.float32)
    s = tl.load(s_ptr + t)
    tl.store(y_ptr + r * K + offs, (q * s).to(y_ptr.dtype.element_ty), mask=mk)  # fp32 product, one rounding


def embed_int8(
    tok: torch.Tensor, q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype, plan: DecodePlan | None = None
) -> torch.Tensor:
    """tok [N] -> (q[tok] * s[tok][:, None]) in `dtype` [N, K]: q int8 [V, K], s float32 [V]."""
    n, k = tok.numel(), q.shape[1]
    y = torch.empty((n, k), dtype=dtype, device=q.device)
    _embed_int8_kernel[(n,)](
        tok, q, s, y, k, BK=triton.next_power_of_2(k), num_warps=1 if INTERPRET else 4, **pdl_kw(plan)
    )
    return y


@triton.jit
def _greedy_step_kernel(
    x_ptr,
    V,
    stride_x,
    CH,
    NC,
    pmax_ptr,
    pidx_ptr,
    cnt_ptr,
    tok_ptr,
    out_ptr,
    stride_out,
    step_ptr,
    pos_ptr,
    B,
    map_ptr,
    BV: tl.constexpr,
    NCP: tl.constexpr,
    PDL: tl.constexpr = False,
    MAP: tl.constexpr = False,
    ONE_CHUNK: tl.constexpr = False,
    ONE_ROW: tl.constexpr = False,
):
    r = tl.program_id(0)
    c = tl.program_id(1)
    _pdl_wait(PDL)
    best = tl.full([], float("-inf"), tl.float32)
    best_nan = tl.full([], 0, tl.int1)
    bi = tl.full([], 0, tl.int32)
    lo = c * CH
    hi = tl.minimum(lo + CH, V)
    for v0 in range(lo, hi, BV):
        offs = v0 + tl.arange(0, BV)
        x = tl.load(x_ptr + r * stride_x + offs, mask=offs < hi, other=float("-inf"))
        best, best_nan, bi, _ = _argmax_step(best, best_nan, bi, x, offs, offs < hi, V)
    token = bi
    last = True  # one chunk a row (the int8 head's tile maxima at small batches): no counter, no partials
    if not ONE_CHUNK:
        tl.store(pmax_ptr + r * NC + c, tl.where(best_nan, float("nan"), best))
        tl.store(pidx_ptr + r * NC + c, bi)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + r, 1, sem="acq_rel")
        last = done == NC - 1
        if last:  # the row's last chunk: reduce the chunks
            tl.atomic_xchg(cnt_ptr + r, 0, sem="relaxed")
            token, _ = _argmax_chunks(pmax_ptr, pidx_ptr, r * NC, NC, NCP)
    if last:  # the row's winner -> its token (through the tiles' index when MAP), tok, out[:, step], pos += 1
        if MAP:  # x held tiles' maxima: the token is the winning tile's own index
            token = tl.load(map_ptr + r * stride_x + token)
        t64 = token.to(tl.int64)  # (a new name: a dynamic branch may not change a variable's type)
        step = tl.load(step_ptr)
        tl.store(out_ptr + r * stride_out + step, t64)
        tl.store(tok_ptr + r, t64)
        tl.store(pos_ptr + r, tl.load(pos_ptr + r) + 1)
        if ONE_ROW:  # no other row: no counter
            tl.store(step_ptr, step + 1)
        else:  # the last row to finish advances step
            rows = tl.atomic_add(cnt_ptr + B, 1, sem="acq_rel")  # every row has read `step` before its add
            if rows == B - 1:
                tl.atomic_xchg(cnt_ptr + B, 0, sem="relaxed")
                tl.store(step_ptr, step + 1)


_ws: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def vocab_chunks(b: int, v: int, chunks: int = 0) -> tuple[int, int, int]:
    """(entries a block, entries a chunk, chunks a row) of a reduction over b rows of v entries, one program a
    chunk: `chunks` a row, or by default about 256 programs in all; a chunk holds whole blocks."""
    bv = 256 if INTERPRET else 2048
    nc = chunks or max(1, 256 // b)
    ch = triton.cdiv(triton.cdiv(v, nc), bv) * bv
    return bv, ch, triton.cdiv(v, ch)


def greedy_step(
    logits,
    tok,
    out,
    step,
    pos,
    chunks: int = 0,
    index: torch.Tensor | None = None,
    plan: DecodePlan | None = None,
) -> None:
    """logits float32 [B, V] -> tok[:, 0] = out[:, step] = argmax (first index of the maximum), pos += 1,
    step += 1. tok int64 [B, 1], out int64 [B, S], step int64 [1], pos int32 [B]. chunks: programs a row
    (default: about 256 programs in all). index int32 [B, V] (the shape and strides of logits): logits hold
    the maxima of vocabulary tiles in order and index their first indices (`head.w8a16_argmax`); the token is
    index[b, argmax]."""
    b, v = logits.shape
    if index is not None and (index.shape != logits.shape or index.stride() != logits.stride()):
        raise ValueError(f"greedy_step: index {tuple(index.shape)} must have the shape and strides of logits")
    bv, ch, nc = vocab_chunks(b, v, chunks)
    key = (str(logits.device), b, nc)
    if key not in _ws:  # allocated before any graph capture (the warm-up call); counters start at zero
        _ws[key] = (
            torch.empty((b, nc), dtype=torch.float32, device=logits.device),
            torch.empty((b, nc), dtype=torch.int32, device=logits.device),
            torch.zeros((b + 1,), dtype=torch.int32, device=logits.device),
        )
    pmax, pidx, cnt = _ws[key]
    _greedy_step_kernel[(b, nc)](
        logits,
        v,
        logits.stride(0),
        ch,
        nc,
        pmax,
        pidx,
        cnt,
        tok,
        out,
        out.stride(0),
        step,
        pos,
        b,
        logits if index is None else index,
        BV=bv,
        NCP=triton.next_power_of_2(nc),
        MAP=index is not None,
        ONE_CHUNK=nc == 1,
        ONE_ROW=b == 1,
        num_warps=1 if INTERPRET else 4,
        **pdl_kw(plan),
    )
