"""Kernels of the samplers that run after a decode step (generate/reductions.py dispatches to them on CUDA).

- `logit_stats`: each row's argmax (`ends.greedy_step`'s rules) and logsumexp in one pass over its logits, cut
  into chunks over the whole GPU; PyTorch's argmax and log_softmax run one block a row, 27-29 us each over a 128k
  vocabulary at batch 1 on an H200 (of a greedy sampler graph's 65 us). `greedy_sample`: the same pass ending a
  greedy sampler's step too (token, log-probability, the next step's input, the draw index), one launch for the
  nine of PyTorch's ops that did it.
- `candidate_draw`: a sampled row's token from its top-k candidates (temperature, top-k, top-p, min-p, then the
  draw at its uniform: `sampling._candidate_probs` and `_draw_sorted`), one program a row instead of some twenty
  small PyTorch launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bitnetlm.kernels.triton.common import INTERPRET, _argmax_chunks, _argmax_step, _pdl_wait, pdl_kw
from bitnetlm.kernels.triton.ends import vocab_chunks


# The chunk count follows the batch; not specializing on it leaves one compile per merge width (NCP) for batches
# 1..32 (4 with SAMPLE and 4 without, not 6 and 6), as fast (H200, docs/PERF_LOG.md).
@triton.jit(do_not_specialize=["NC"])
def _logit_stats_kernel(
    x_ptr,
    V,
    stride_x,
    CH,
    NC,
    pmax_ptr,
    pidx_ptr,
    plm_ptr,
    pls_ptr,
    cnt_ptr,
    idx_ptr,
    lse_ptr,
    BV: tl.constexpr,
    NCP: tl.constexpr,
    PDL: tl.constexpr = False,
    ONE_CHUNK: tl.constexpr = False,
    SAMPLE: tl.constexpr = False,
    lp_ptr=None,
    nt_ptr=None,
    stride_nt=0,
    step_ptr=None,
):
    """Program (row, chunk): the chunk's argmax (greedy_step's rules) and its (max, sum of exp(x - max)) over the
    non-NaN entries; the row's last chunk to finish (an atomic counter, reset for the next call) combines them.
    SAMPLE: that program also ends a greedy sampler's step (`greedy_sample`)."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    _pdl_wait(PDL)
    best = tl.full([], float("-inf"), tl.float32)
    best_nan = tl.full([], 0, tl.int1)
    bi = tl.full([], 0, tl.int32)
    lm = tl.full([], float("-inf"), tl.float32)  # running max of the numbers
    ls = tl.full([], 0.0, tl.float32)  # sum of exp(x - lm) over them
    lo = c * CH
    hi = tl.minimum(lo + CH, V)
    for v0 in range(lo, hi, BV):
        offs = v0 + tl.arange(0, BV)
        live = offs < hi
        x = tl.load(x_ptr + r * stride_x + offs, mask=live, other=float("-inf")).to(tl.float32)
        best, best_nan, bi, m = _argmax_step(best, best_nan, bi, x, offs, live, V)
        lm, ls = _lse_add(lm, ls, tl.where(x != x, float("-inf"), x), m)
    if ONE_CHUNK:
        lse = _lse_end(lm, ls, best_nan)
        tl.store(idx_ptr + r, bi.to(tl.int64))
        tl.store(lse_ptr + r, lse)
        if SAMPLE:
            _sample_end(x_ptr, stride_x, r, bi, lse, lp_ptr, nt_ptr, stride_nt, step_ptr)
    else:
        tl.store(pmax_ptr + r * NC + c, tl.where(best_nan, float("nan"), best))
        tl.store(pidx_ptr + r * NC + c, bi)
        tl.store(plm_ptr + r * NC + c, lm)
        tl.store(pls_ptr + r * NC + c, ls)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + r, 1, sem="acq_rel")
        if done == NC - 1:  # the row's last chunk: combine the chunks
            tl.atomic_xchg(cnt_ptr + r, 0, sem="relaxed")
            token, any_nan = _argmax_chunks(pmax_ptr, pidx_ptr, r * NC, NC, NCP)
            offs_c = tl.arange(0, NCP)
            mc = offs_c < NC
            cm = tl.load(plm_ptr + r * NC + offs_c, mask=mc, other=float("-inf"), cache_modifier=".cg")
            cs = tl.load(pls_ptr + r * NC + offs_c, mask=mc, other=0.0, cache_modifier=".cg")
            mx = tl.max(cm, axis=0)
            w = tl.where(cm == float("-inf"), 0.0, tl.exp(cm - tl.where(_inf(mx), 0.0, mx)))
            lse = _lse_end(mx, tl.sum(cs * w, axis=0), any_nan)
            tl.store(idx_ptr + r, token.to(tl.int64))
            tl.store(lse_ptr + r, lse)
            if SAMPLE:
                _sample_end(x_ptr, stride_x, r, token, lse, lp_ptr, nt_ptr, stride_nt, step_ptr)


@triton.jit
def _sample_end(x_ptr, stride_x, r, token, lse, lp_ptr, nt_ptr, stride_nt, step_ptr):
    """Row r's greedy token: its log-probability x[r, token] - lse (raw_logprobs' float32 difference), the token
    into the next step's input, and the row's draw index advanced (as GraphSampler's ops do)."""
    lp = tl.load(x_ptr + r * stride_x + token).to(tl.float32) - lse
    tl.store(lp_ptr + r, lp)
    tl.store(nt_ptr + r * stride_nt, token.to(tl.int64))
    tl.store(step_ptr + r, tl.load(step_ptr + r) + 1)


@triton.jit
def _inf(m):
    return (m == float("inf")) | (m == float("-inf"))


@triton.jit
def _lse_add(lm, ls, x, bm):
    """(max, sum of exp(x - max)) of the numbers so far, then a block x (NaNs as -inf; bm: its largest number)."""
    new = tl.maximum(lm, bm)
    safe = tl.where(_inf(new), 0.0, new)  # (an infinite max: the sum is never used)
    ls = tl.where(lm == float("-inf"), 0.0, ls * tl.exp(lm - safe))
    return new, ls + tl.sum(tl.where(x == float("-inf"), 0.0, tl.exp(x - safe)), axis=0)


@triton.jit
def _lse_end(m, s, has_nan):
    """torch.logsumexp's value from (max, sum): NaN with a NaN in the row, +-inf for an infinite max."""
    return tl.where(has_nan, float("nan"), tl.where(_inf(m), m, m + tl.log(s)))


_stats_ws: dict[tuple, tuple[torch.Tensor, ...]] = {}


def logit_stats(x: torch.Tensor, chunks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, V] (any float dtype; rows may be strided) -> (argmax [B] int64: the first index of the maximum, a NaN
    above every number, as `torch.argmax`; logsumexp [B] float32, as `torch.logsumexp` of x in float32). chunks:
    programs a row (default: about 256 programs in all)."""
    return _stats(x, chunks, torch.empty((x.shape[0],), dtype=torch.long, device=x.device))


def _stats(x: torch.Tensor, chunks: int, idx: torch.Tensor, **ends) -> tuple[torch.Tensor, torch.Tensor]:
    """logit_stats into idx; ends: the kernel's SAMPLE epilogue's arguments (greedy_sample)."""
    b, v = x.shape
    if x.stride(1) != 1:
        raise ValueError(f"logit_stats: logits need unit stride along the vocabulary, got {x.stride()}")
    bv, ch, nc = vocab_chunks(b, v, chunks)
    key = (str(x.device), b, nc)
    if key not in _stats_ws:  # allocated before any graph capture (the warm-up call); counters start at zero
        f = dict(dtype=torch.float32, device=x.device)
        _stats_ws[key] = (
            torch.empty((b, nc), **f),
            torch.empty((b, nc), dtype=torch.int32, device=x.device),
            torch.empty((b, nc), **f),
            torch.empty((b, nc), **f),
            torch.zeros((b,), dtype=torch.int32, device=x.device),
        )
    pmax, pidx, plm, pls, cnt = _stats_ws[key]
    lse = torch.empty((b,), dtype=torch.float32, device=x.device)
    _logit_stats_kernel[(b, nc)](
        x,
        v,
        x.stride(0),
        ch,
        nc,
        pmax,
        pidx,
        plm,
        pls,
        cnt,
        idx,
        lse,
        BV=bv,
        NCP=triton.next_power_of_2(nc),
        ONE_CHUNK=nc == 1,
        num_warps=1 if INTERPRET else 4,
        **ends,
        **pdl_kw(),
    )
    return idx, lse


def greedy_sample(
    x: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor, next_tok: torch.Tensor, step: torch.Tensor
):
    """A greedy sampler's step in one launch (`GraphSampler` of all-greedy rows): over logits x [B, V], tok [B]
    int64 = the argmax (`logit_stats`'), lp [B] float32 = its raw log-probability (`sampling.raw_logprobs`'),
    next_tok [B, 1] int64 (any row stride) = the token, step [B] int64 += 1."""
    b = x.shape[0]
    for name, t, dt in (("tok", tok, torch.long), ("lp", lp, torch.float32), ("step", step, torch.long)):
        if t.shape != (b,) or t.dtype != dt or t.stride(0) != 1:
            raise ValueError(
                f"greedy_sample: {name} must be [{b}] contiguous {dt}, got {tuple(t.shape)} {t.dtype}"
            )
    if next_tok.shape != (b, 1) or next_tok.dtype != torch.long:
        raise ValueError(f"greedy_sample: next_tok must be [{b}, 1] int64, got {tuple(next_tok.shape)}")
    _stats(x, 0, tok, SAMPLE=True, lp_ptr=lp, nt_ptr=next_tok, stride_nt=next_tok.stride(0), step_ptr=step)


# One program, 64 rows at a time: a sampler's outputs are a few hundred bytes. Nothing is specialized on B or N: one
# compile serves every batch (and one more each power of 2 of top log-probabilities).
@triton.jit(do_not_specialize=["B", "N"])
def _export_kernel(
    tok_ptr,
    lp_ptr,
    tv_ptr,
    ti_ptr,
    seq_ptr,
    otok_ptr,
    olp_ptr,
    otv_ptr,
    oti_ptr,
    oseq_ptr,
    B,
    N,
    BR: tl.constexpr,
    BN: tl.constexpr,
    TOP: tl.constexpr,
):
    """Rows 0..B-1 of tok, lp (and top_v / top_i [B, N]) into slot seq % 2 of the outputs, then seq += 1, also
    into oseq."""
    s = tl.load(seq_ptr)
    slot = s % 2
    for r0 in range(0, B, BR):
        r = r0 + tl.arange(0, BR)
        m = r < B
        tl.store(otok_ptr + slot * B + r, tl.load(tok_ptr + r, mask=m), mask=m)
        tl.store(olp_ptr + slot * B + r, tl.load(lp_ptr + r, mask=m), mask=m)
        if TOP:
            c = tl.arange(0, BN)
            o = r[:, None] * N + c[None, :]  # [BR, BN] offsets into a [B, N] tensor
            mm = m[:, None] & (c[None, :] < N)
            tl.store(otv_ptr + slot * B * N + o, tl.load(tv_ptr + o, mask=mm), mask=mm)
            tl.store(oti_ptr + slot * B * N + o, tl.load(ti_ptr + o, mask=mm), mask=mm)
    tl.store(seq_ptr, s + 1)
    tl.store(oseq_ptr, s + 1)


def export_rows(tok, lp, top_v, top_i, seq, out_tok, out_lp, out_top_v, out_top_i, out_seq) -> None:
    """A sampler's outputs (tok [B] int64, lp [B] float32, top_v [B, N] float32, top_i [B, N] int64; N may be 0)
    into slot seq % 2 of out_tok [2, B], out_lp [2, B], out_top_v / out_top_i [2, B, N], then seq [1] int64 += 1
    and out_seq [1] = seq: one launch. The outputs may be pinned host memory, which the stores reach directly: a
    captured graph hands its tokens to the host without a copy of its own (`graph_sampler.HostRing`)."""
    b, n = top_v.shape
    want = (
        ("tok", tok, (b,), torch.long),
        ("lp", lp, (b,), torch.float32),
        ("top_v", top_v, (b, n), torch.float32),
        ("top_i", top_i, (b, n), torch.long),
        ("seq", seq, (1,), torch.long),
        ("out_tok", out_tok, (2, b), torch.long),
        ("out_lp", out_lp, (2, b), torch.float32),
        ("out_top_v", out_top_v, (2, b, n), torch.float32),
        ("out_top_i", out_top_i, (2, b, n), torch.long),
        ("out_seq", out_seq, (1,), torch.long),
    )
    for name, t, shape, dt in want:
        if tuple(t.shape) != shape or t.dtype != dt or not t.is_contiguous():
            raise ValueError(
                f"export_rows: {name} must be {list(shape)} contiguous {dt}, got {tuple(t.shape)} {t.dtype}"
            )
    bn = triton.next_power_of_2(max(n, 1))
    _export_kernel[(1,)](
        tok, lp, top_v, top_i, seq, out_tok, out_lp, out_top_v, out_top_i, out_seq, b, n,
        BR=64, BN=bn, TOP=n > 0, num_warps=1,
    )  # fmt: skip


# The rows' parameters are rows of `sampling.row_tensors`' packed [n, B] tensors, 16-byte aligned for some B only,
# and the top-k's size varies by request: neither is specialized on, so that one compile per BK and flags serves
# every batch (`reductions.warm` compiles them once for a server).
@triton.jit(
    do_not_specialize=["KMAX", "stride_v", "stride_o"],
    do_not_specialize_on_alignment=["temps_ptr", "k_ptr", "top_p_ptr", "min_p_ptr", "u_ptr"],
)
def _candidate_draw_kernel(
    vals_ptr,
    order_ptr,
    temps_ptr,
    k_ptr,
    top_p_ptr,
    min_p_ptr,
    u_ptr,
    tok_ptr,
    KMAX,
    stride_v,
    stride_o,
    BK: tl.constexpr,
    SCALE: tl.constexpr,
    NEED_P: tl.constexpr,
):
    """Program r: row r's kmax candidates (logits descending, their token ids) -> its token, as
    `sampling._candidate_probs` then `_draw_sorted` compute it."""
    r = tl.program_id(0)
    offs = tl.arange(0, BK)
    live = offs < KMAX
    v = tl.load(vals_ptr + r * stride_v + offs, mask=live, other=float("-inf"))
    if SCALE:
        v = v / tl.load(temps_ptr + r)
    remove = (offs >= tl.load(k_ptr + r)) | ~live
    if NEED_P:  # top-p and min-p over the probabilities of the row's top-k
        masked = tl.where(remove, float("-inf"), v)
        m = tl.max(masked, axis=0)
        probs = tl.exp(masked - (m + tl.log(tl.sum(tl.exp(masked - m), axis=0))))
        remove |= (tl.cumsum(probs, axis=0) - probs) >= tl.load(top_p_ptr + r)
        best = tl.sum(tl.where(offs == 0, probs, 0.0), axis=0)
        remove |= probs < tl.load(min_p_ptr + r) * best
        remove &= offs != 0  # always keep the most likely token
    kept = tl.where(remove, float("-inf"), v)
    e = tl.exp(kept - tl.max(kept, axis=0))
    p = e / tl.sum(e, axis=0)  # softmax over the kept candidates
    cum = tl.cumsum(tl.where(live, p, 0.0).to(tl.float64), axis=0)
    target = tl.load(u_ptr + r) * tl.max(cum, axis=0)  # u times the row's total (float64)
    j = tl.sum((cum <= target).to(tl.int32), axis=0)  # the first whose cumulative sum passes the target
    last = tl.max(tl.where(live & (p > 0), offs, -1), axis=0)  # never a candidate of probability 0
    j = tl.minimum(j, last)
    tok = tl.sum(tl.where(offs == j, tl.load(order_ptr + r * stride_o + offs, mask=live, other=0), 0), axis=0)
    tl.store(tok_ptr + r, tok.to(tl.int64))


def candidate_draw(vals, order, temps, k, top_p, min_p, u, scale: bool, need_p: bool) -> torch.Tensor:
    """Tokens [B] drawn among each row's candidates: vals [B, kmax] float32 logits descending, order [B, kmax]
    their ids; per row [B]: temperature (with scale), top-k, top-p and min-p (with need_p; top_p 2.0 = off), and
    u float64, the row's uniform. As `sampling._candidate_probs` + `_draw_sorted` + the gather of the id."""
    b, kmax = vals.shape
    if vals.stride(1) != 1 or order.stride(1) != 1:
        raise ValueError(
            f"candidate_draw: candidates need unit stride, got {vals.stride()} / {order.stride()}"
        )
    tok = torch.empty((b,), dtype=torch.long, device=vals.device)
    _candidate_draw_kernel[(b,)](
        vals,
        order,
        temps.contiguous(),
        k.contiguous(),
        top_p.contiguous(),
        min_p.contiguous(),
        u.contiguous(),
        tok,
        kmax,
        vals.stride(0),
        order.stride(0),
        BK=max(16, triton.next_power_of_2(kmax)),
        SCALE=scale,
        NEED_P=need_p,
        num_warps=1 if INTERPRET else 4,
    )
    return tok
