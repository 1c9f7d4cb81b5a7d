"""The decode step's single-query attention over the KV cache [B, Hkv, S, D] (flash-decoding splits, GQA-grouped
tensor-core dots), one launch a layer; the RoPE + KV-cache write before it is `rope.py`'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bitnetlm.kernels.triton.common import (
    INTERPRET,
    _pdl_trigger,
    _pdl_wait,
    _prefetch_l2,
)
from bitnetlm.kernels.triton.launch import pdl_kw, sm_count


@triton.jit
def _span(n, NSPLIT):
    """Keys per split of an n-key context: 1/NSPLIT of it, rounded up to a multiple of 16."""
    return tl.cdiv(tl.cdiv(n, NSPLIT), 16) * 16


@triton.jit
def _merge_add(o, pml_ptr, pacc_ptr, row0, p, nact, mx, offs_h, offs_d, G, GP: tl.constexpr, D: tl.constexpr):
    """o [GM, D] + partial p's accumulator weighted by exp(its m - mx) (nothing for p >= nact or an m of -inf)."""
    rp = (row0 + p) * GP + offs_h  # [GM] partial rows
    mh = (offs_h < G) & (offs_h * 0 + p < nact)  # (a [GM] compare: the interpreter masks with no scalar bool)
    m_p = tl.load(pml_ptr + rp * 2, mask=mh, other=float("-inf"), cache_modifier=".cg")
    a_p = tl.load(
        pacc_ptr + rp[:, None] * D + offs_d[None, :], mask=mh[:, None], other=0.0, cache_modifier=".cg"
    )  # [GM, D]
    w_p = tl.where(m_p == float("-inf"), 0.0, tl.exp(m_p - mx))
    return o + a_p * w_p[:, None]


@triton.jit
def _prefetch_part(ptr, nbytes, part, nparts, PTX: tl.constexpr, PFB: tl.constexpr):
    """`_prefetch_l2` of part `part` of `nparts` of the nbytes at ptr (a uint8 tensor), 128-byte lines."""
    nl = tl.cdiv(nbytes, 128)
    per = tl.cdiv(nl, nparts)
    lo = part * per
    hi = tl.minimum(lo + per, nl)
    for c in range(lo, hi, PFB):
        ln = c + tl.arange(0, PFB)
        _prefetch_l2(ptr + ln.to(tl.int64) * 128, ln < hi, PTX)


@triton.jit
def _attn_gqa_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    o_ptr,
    pacc_ptr,
    pml_ptr,
    cnt_ptr,
    sm_scale,
    H,
    HKV,
    S,
    NSPLIT,
    G: tl.constexpr,
    GP: tl.constexpr,
    GM: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    NS2: tl.constexpr,
    IEEE: tl.constexpr,
    PTX: tl.constexpr,
    PDL: tl.constexpr = False,
    KV8: tl.constexpr = False,
    LATE: tl.constexpr = False,
    POS_EARLY: tl.constexpr = False,
    IDLE_EARLY: tl.constexpr = False,
    pf_ptr=None,
    pf_bytes=0,
    pf2_ptr=None,
    pf2_bytes=0,
    pf3_ptr=None,
    pf3_bytes=0,
    PF2: tl.constexpr = False,
    PF3: tl.constexpr = False,
    PFP: tl.constexpr = 0,
    PF_WAIT: tl.constexpr = True,
    PFB: tl.constexpr = 512,
):
    """Flash-decoding over a GQA group: program (b, kv head, split) loads each K/V block of its keys once for
    all G query heads sharing it (scores and P@V on tensor cores, the G rows padded to GP >= 16). The row's live
    context 0..pos[b] (not the cache's capacity S) is cut into NSPLIT spans of a multiple of 16 keys, so a
    short context in a long cache still spreads over every split; the last split of (b, kv head) holding keys
    to finish (an atomic counter) merges the partial (max, sum, acc) and resets the counter for the next call
    (CUDA-graph replays need no memset). When one split holds every key (batch 64 runs one split a row; a short
    context) that program normalizes and stores its output itself: no partials, counter or merge.
    PFP > 0: PFP more programs a (row, kv head), past the NSPLIT splits, pull their share of pf_bytes of a later
    kernel's weights into L2 (after the PDL wait with PF_WAIT) and end; they take no part in the merge."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    base = (b * HKV + kvh) * S * D
    if PFP:
        if sp >= NSPLIT:
            if PF_WAIT:
                _pdl_wait(PDL, TRIGGER=not LATE)
            part, nparts = (b * HKV + kvh) * PFP + sp - NSPLIT, tl.num_programs(0) * HKV * PFP
            _prefetch_part(pf_ptr, pf_bytes, part, nparts, PTX, PFB)
            if PF2:
                _prefetch_part(pf2_ptr, pf2_bytes, part, nparts, PTX, PFB)
            if PF3:
                _prefetch_part(pf3_ptr, pf3_bytes, part, nparts, PTX, PFB)
            return
    # pos is constant for the whole step: its first kernel (F.embedding or `ends.embed_int8`) lets the next one
    # launch only after the previous step's sampler has written it
    if POS_EARLY:
        n = tl.load(pos_ptr + b) + 1
        span = _span(n, NSPLIT)
    if PDL:  # this program's first K/V block into L2 while waiting (a hint only: the rows past pos are still
        # being written; the real loads come later)
        LP: tl.constexpr = D // 64 if D >= 64 else 1  # 128-byte lines of a bf16 row
        if POS_EARLY:
            pos_early = n - 1
        else:
            pos_early = tl.load(pos_ptr + b, cache_modifier=".cg")  # not into L1: the real load comes later
        span_e = _span(pos_early + 1, NSPLIT)
        pf_s = sp * span_e + tl.arange(0, BS)
        pf_kv = base + pf_s[:, None] * D + (tl.arange(0, LP) * 64)[None, :]
        pf_m = tl.broadcast_to(((pf_s <= pos_early) & (pf_s < (sp + 1) * span_e))[:, None], [BS, LP])
        _prefetch_l2(k_ptr + pf_kv, pf_m, True)
        _prefetch_l2(v_ptr + pf_kv, pf_m, True)
    if IDLE_EARLY and POS_EARLY:  # a split past the row's keys reads nothing: it ends without waiting
        if sp * span < n:
            _pdl_wait(PDL, TRIGGER=not LATE)
    else:
        _pdl_wait(PDL, TRIGGER=not LATE)  # LATE: the next kernels launch at this one's end (ATTN_LATE_MIN_B)
    if not POS_EARLY:
        n = tl.load(pos_ptr + b) + 1  # keys 0..pos[b] are this row's context
        span = _span(n, NSPLIT)
    nact = tl.cdiv(n, span)  # splits holding keys; the rest have nothing to do
    lo = sp * span
    if lo < n:
        offs_d = tl.arange(0, D)
        offs_g = tl.arange(0, GP)
        mg = offs_g < G
        heads = b * H + kvh * G + offs_g  # [GP] query rows
        q = tl.load(q_ptr + heads[:, None] * D + offs_d[None, :], mask=mg[:, None], other=0.0)  # [GP, D]
        if KV8 and not IEEE:
            q = q.to(tl.float16)  # a float8 cache: float16 operands (float8 -> float16: one conversion per 2)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        hi = tl.minimum(lo + span, n)
        for s0 in range(lo, hi, BS):
            offs_s = s0 + tl.arange(0, BS)
            ms = offs_s < hi
            k = tl.load(k_ptr + base + offs_s[:, None] * D + offs_d[None, :], mask=ms[:, None], other=0.0)
            v = tl.load(v_ptr + base + offs_s[:, None] * D + offs_d[None, :], mask=ms[:, None], other=0.0)
            if KV8:
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            if IEEE:
                sc = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                sc = tl.dot(q, tl.trans(k))
            sc = tl.where(ms[None, :], sc * sm_scale, float("-inf"))  # [GP, BS]
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            p = tl.exp(sc - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        if nact == 1:  # this program holds every key: no partials, no merge (what the merge of one gives)
            o1 = (acc / l_i[:, None]).to(o_ptr.dtype.element_ty)
            tl.store(o_ptr + heads[:, None] * D + offs_d[None, :], o1, mask=mg[:, None])
        else:
            row = (b * HKV + kvh) * NSPLIT + sp
            pr = row * GP + offs_g  # partial rows [GP]: the G real ones stored (the merge reads no others)
            tl.store(pacc_ptr + pr[:, None] * D + offs_d[None, :], acc, mask=mg[:, None])
            tl.store(pml_ptr + pr * 2, m_i, mask=mg)
            tl.store(pml_ptr + pr * 2 + 1, l_i, mask=mg)
            tl.debug_barrier()
            done = tl.atomic_add(cnt_ptr + b * HKV + kvh, 1, sem="acq_rel")
            if done == nact - 1:
                tl.debug_barrier()
                tl.atomic_xchg(cnt_ptr + b * HKV + kvh, 0, sem="relaxed")
                offs_p = tl.arange(0, NS2)
                offs_h = tl.arange(0, GM)
                mp = (offs_p < nact)[:, None] & (offs_h < G)[None, :]  # [NS2, GM]
                rows = ((b * HKV + kvh) * NSPLIT + offs_p)[:, None] * GP + offs_h[None, :]
                # .cg: read the other programs' partials from L2, never from a stale L1 line of an earlier replay
                m_all = tl.load(pml_ptr + rows * 2, mask=mp, other=float("-inf"), cache_modifier=".cg")
                l_all = tl.load(pml_ptr + rows * 2 + 1, mask=mp, other=0.0, cache_modifier=".cg")
                mx = tl.max(m_all, axis=0)  # [GM]
                w = tl.where(m_all == float("-inf"), 0.0, tl.exp(m_all - mx[None, :]))
                # the accumulators one partial at a time, unrolled over NS2 (every load issued at once): no
                # [NS2, GM, D] tile in registers and no sum over it across warps (stop 35: a step 2-6% faster
                # at batch 1-16 than that tile's merge, the same at 64)
                o = tl.zeros([GM, D], tl.float32)
                row0 = (b * HKV + kvh) * NSPLIT
                for p in tl.static_range(NS2):
                    o = _merge_add(o, pml_ptr, pacc_ptr, row0, p, nact, mx, offs_h, offs_d, G, GP, D)
                o = o / tl.sum(l_all * w, axis=0)[:, None]  # [GM, D]
                oh = b * H + kvh * G + offs_h
                tl.store(
                    o_ptr + oh[:, None] * D + offs_d[None, :],
                    o.to(o_ptr.dtype.element_ty),
                    mask=(offs_h < G)[:, None],
                )
    _pdl_trigger(PDL and LATE)


# Overrides for the --attn sweeps of benchmarks/gpu_profile.py and gpu_attention.py (0 = the launcher's choice):
ATTN_SPLITS = 0  # splits of each row's context (default: ATTN_PROGRAMS_PER_SM programs per SM, at most 32)
ATTN_BS = 0  # keys per K/V block (default 64)
ATTN_STAGES = 0  # software-pipeline stages of the block loop (default: Triton's)
ATTN_WARPS = 0  # default 4 (2 at batch ATTN_NARROW_MIN_B..ATTN_NARROW_MAX_B)
ATTN_MAXNREG = 0  # registers per thread cap (default: the compiler's choice)
ATTN_PROGRAMS = 0  # programs per launch to aim the splits at (default: ATTN_PROGRAMS_PER_SM x the SMs)
# An SM holds 3 of the attention's programs (its registers and shared memory: Nsight Compute, stop 22), so 3 per SM
# is one wave. Together with ATTN_LATE_MIN_B = 8 it is 9% / 2% / 11% faster a step at batch 8 / 16 / 32 than the
# earlier 528 programs with the late launch from 64, on an H200 (benchmarks/gpu_profile.py --variants,
# docs/PERF_LOG.md stop 29); batch 1, 2 and 64 are unchanged.
ATTN_PROGRAMS_PER_SM = 3
# From this batch on the attention lets the next kernels launch (PDL) only at its end, so its programs have the
# SMs to themselves and its K/V reads no longer compete with the next projections' early weight loads. Measured
# faster from batch 8 on an H200 (stop 29; 64 on an H100 at stop 17, whose batch-8 step then measured slower);
# at batch 1 and 2 the early launch stays faster.
ATTN_LATE_MIN_B = 8
# Above this batch the attention lets them launch early again, and the engine has the quantization launch before o
# let o launch only after its own wait (so o's programs still start at the attention's end, and the quantization's
# launch latency leaves the chain). On an H200 a step took 1.1-3.0% / 2.8% / 2.3% / 3.4% less time at batch 33 / 36
# / 40 / 64 this way, and 2.2% more at batch 32 (docs/PERF_LOG.md stop 42).
ATTN_LATE_MAX_B = 32


def late_launch(b: int) -> bool:
    """Does batch b's decode attention let the next kernels launch only at its end (ATTN_LATE_MIN_B..MAX_B)?"""
    return ATTN_LATE_MIN_B <= b <= ATTN_LATE_MAX_B


# A captured step told that its rows stay within 256 keys (`key_range`) runs one split of one 256-key block, at 8
# warps in one stage, up to batch ATTN_RANGE_MAX_B: a small grid and no merge. On an H200 a step took 5-10% less time
# at batch 1-8 within 256 keys (benchmarks/gpu_profile.py --max-keys, docs/PERF_LOG.md stop 30); since the
# unrolled merge (stop 35) it ties with the default splits there (batch 3 / 4 / 8: +0.3% / -0.8% / +0.1%), and two
# such blocks within 512 keys took 5% more than the default splits, so there are no two-block ranges any more.
# Batches 1-2 take small blocks instead (ATTN_SMALL_MAX_B). Any context stays exact: a range outgrown only makes the
# split loop over more blocks. Since the prefetch programs (stop 47) the default splits win again from batch 5: at
# contexts of 0 / 150 keys (int8 head, float8 cache, H200, stop 50) a step took 0.966 / 1.044 against 1.042 / 1.044
# ms at batch 5, 0.973 / 1.038 against 1.047 / 1.054 at 6, 0.985 / 1.037 against 1.062 / 1.065 at 7 and 0.971-0.978
# / 1.008 against 1.045-1.050 / 1.051 at 8, while batch 3 and 4 keep the range block (0.908 / 0.907 against 0.924 /
# 0.936; 0.928 against 0.957 at 0 keys).
ATTN_RANGE_MAX_B = 4
# The attention reads pos before its PDL wait (constant for a step: its first kernel lets the next launch only
# after the previous step's sampler wrote it), so that only q and the K/V loads wait for q|k|v.
ATTN_POS_EARLY = 1
# With pos read early, a split holding none of its row's keys (a short context in a grid sized for the key range:
# 12-15 of batch 1's 32 splits a KV head at 513-612 keys) ends before the PDL wait instead of waiting for q|k|v.
# On an H200 a batch-1 step took 0.6% less time (0.700 against 0.704 ms); batch 8, whose splits all hold keys,
# the same (docs/PERF_LOG.md stop 46).
ATTN_IDLE_EARLY = 1
# The decode attention is latency-bound, with DRAM mostly idle; at the batches in ATTN_PF_TABLE it also runs about
# that many more programs (rounded up to a multiple of rows x kv heads), which pull the layer's gate|up weights into
# L2 after the PDL wait and end, so that gate|up, two kernels later, reads them from L2. On an H200 (int8 head,
# float8 cache, context 512; docs/PERF_LOG.md stop 47) a step took 2.3 / 3.5 / 1.6 / 1.0 / 2.1 / 2.7 / 2.4 / 1.2%
# less time at batch 1-8 (at 900 keys batch 1 / 2 / 8: 1.5 / 4.2 / 1.0%). Counts are per batch: at batch 1 1,536
# and 3,072 gained nothing and 4,096 lost 5%; at batch 4 over 512 lost; batch 16 gained nothing, 64 lost 3%. The
# prefetch runs in programs of its own: issued by the splits themselves it cost 1-12% (their merge waits behind it).
# ATTN_PF_PROGRAMS overrides the table for benchmarks (-1: the table, 0: none, n: n programs up to batch 32);
# ATTN_PF_WAIT = 0 has them prefetch without waiting, ATTN_PF_BLOCK sets the lines a vector.
ATTN_PF_TABLE = {1: 2048, 2: 2048, 3: 1024, 4: 512, 5: 2048, 6: 2048, 7: 2048, 8: 2048}
# Over a bf16 cache (twice the K/V bytes and shared memory a program) batch 1 differs: timed against none (H200,
# int8 head, one round each, stop 48) it lost at every count (2,048: +1.7%; bf16 head +1.8%), while 2,048 took 1.0 /
# 2.1 / 2.1 / 2.0 / 2.0 / 0.8% less time at batch 2 / 3 / 5 / 6 / 7 / 8 (bf16 head, batch 8: 0.7%) and 512-1,024
# 1.4% less at batch 4.
ATTN_PF_TABLE_KV16 = {2: 2048, 3: 2048, 4: 1024, 5: 2048, 6: 2048, 7: 2048, 8: 2048}
ATTN_PF_PROGRAMS = -1
ATTN_PF_WAIT = 1
ATTN_PF_BLOCK = 512
# Up to this batch they also pull the next layer's q|k|v weights in: a batch-1 step 0.675 / 0.676 ms against 0.685
# (H200, stop 47); batch 8 1.038 against 1.036. down's weights instead: batch 1 0.681, batch 8 1.053-1.055.
ATTN_PF_QKV_MAX_B = 1
# At these batches they also pull the layer's down weights in (after gate|up's): a batch-2 step 0.983 / 0.983 ms
# against 0.994 / 0.993 (H200, stop 48); batch 1 0.682 / 0.682 against 0.675 / 0.675, at 2,560 / 3,072 programs
# 0.691 / 0.707; with q|k|v's at batch 2 as well 0.991 (q|k|v's alone 0.987-0.988).
ATTN_PF_DOWN_BATCHES = (2,)


def prefetch_programs(b: int, kv8: bool) -> int:
    """How many programs batch b's decode attention (kv8: over a float8 cache) adds to pull a later kernel's
    weights into L2 (0: none), by the tables above; a GPU model's step table may hold other counts
    (`prefetch_candidates`)."""
    if ATTN_PF_PROGRAMS >= 0:
        return ATTN_PF_PROGRAMS if b <= 32 else 0
    return (ATTN_PF_TABLE if kv8 else ATTN_PF_TABLE_KV16).get(b, 0)


# The counts the step tuner tries besides the table's: batch 1's optimum on the H200 is narrow (2,048 gained, 1,536
# and 3,072 nothing), so another GPU model may well want others (`bitnet tune` times them in the whole step).
ATTN_PF_COUNTS = (0, 512, 1024, 2048, 3072)


def prefetch_candidates(b: int, kv8: bool) -> list[dict]:
    """The prefetch counts of batch b as a step-only tuning key's candidates, `prefetch_programs`' first."""
    first = prefetch_programs(b, kv8)
    if b > 32:
        return [{"programs": first}]
    return [{"programs": n} for n in (first, *(c for c in ATTN_PF_COUNTS if c != first))]


def _prefetch_count(b: int, hkv: int, kv8: bool, pfs: list[torch.Tensor]) -> int:
    """The count of this launch: the override, else the step-tuned key's choice (a step table's, else the table's)."""
    if ATTN_PF_PROGRAMS >= 0 or INTERPRET:
        return prefetch_programs(b, kv8)
    from bitnetlm.kernels.triton.tune import _tune

    key = ("attn_pf", b, hkv, kv8, tuple(t.numel() for t in pfs))
    return _tune(key, lambda: prefetch_candidates(b, kv8), None, None)["programs"]


ATTN_RANGE_BS = 256
ATTN_RANGE_WARPS = 8
# Up to batch ATTN_SMALL_MAX_B, a captured step told that its rows stay within ATTN_SMALL_MAX_KEYS keys runs the
# default splits over ATTN_SMALL_BS-key blocks (ahead of the range blocks): 32 splits cut up to 1,024 keys into
# spans of at most 32, which 64-key blocks compute half masked. On an H200 (int8 head, float8 cache; stop 34,
# benchmarks/gpu_profile.py --max-keys) a batch-1 step took 1.5-2.5% less time than over 64-key blocks at contexts
# of 512-600 keys and 1.5% / 8% less than the range blocks within 256 / 512 keys (batch 2: 0.3% / 0.2% / 5%);
# with 1,500 keys and more than 32 a span it took 0.8% more, and at batch 8 5-16% more.
ATTN_SMALL_BS = 32
ATTN_SMALL_MAX_B = 2
ATTN_SMALL_MAX_KEYS = 1024
# Their block loop in 2 stages (Triton's default is 3; within the bound a split holds one block): a batch-1 step
# 0.779 / 0.782 ms against 0.794 / 0.791, batch 2 1.133 / 1.132 against 1.141 / 1.143 (H200, stop 35, --attn 0/0/2)
ATTN_SMALL_STAGES = 2
# The default splits run 2 warps a program instead of 4 at these batches: on an H200 (int8 head, float8 cache,
# stop 35) a batch-8 step took 2.6% / 1.9% less time at contexts of 512 / 1,000 keys and the same at 2,048; batch 4
# took 13% more and batch 16 4% more (benchmarks/gpu_profile.py --attn 0,0/0/0/2)
ATTN_NARROW_MIN_B = 8
ATTN_NARROW_MAX_B = 8
# ... and, over a float8 cache, aim at 4 programs per SM (2-warp programs with 1-byte K/V blocks leave room for a
# fourth): batch 8 gets 13 splits, not 9. On an H200 (stop 36, --attn 0,13) a batch-8 step took 2.0% / 4.2% / 3.1%
# less time at contexts of 512 / 700 / 2,000 keys, and the same at 384 and 1,000; over a bf16 cache (twice the
# shared memory a block) 4.6% / 6.2% more at 512 / 2,000, so it keeps 3 per SM (9 splits).
ATTN_NARROW_PROGRAMS_PER_SM = 4
_attn_ws: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _range_bs() -> int:
    return 16 if INTERPRET else ATTN_RANGE_BS  # the interpreter's small blocks


def _small_bs() -> int:
    return 16 if INTERPRET else ATTN_SMALL_BS


def key_ranges() -> list[int]:
    """Every key range `key_range` picks but 0 (a server captures a step for each)."""
    return [_range_bs(), ATTN_SMALL_MAX_KEYS]


def key_range(batch: int, max_keys: int) -> int:
    """The key range a captured decode step of `batch` rows, none past `max_keys` keys, is built for:
    ATTN_SMALL_MAX_KEYS (the default splits over small blocks, up to ATTN_SMALL_MAX_B rows), one range block (up
    to ATTN_RANGE_MAX_B rows), or 0 (the default splits; also for max_keys 0, unknown)."""
    if batch <= ATTN_SMALL_MAX_B and 0 < max_keys <= ATTN_SMALL_MAX_KEYS:
        return ATTN_SMALL_MAX_KEYS
    if batch <= ATTN_RANGE_MAX_B and 0 < max_keys <= _range_bs():
        return _range_bs()
    return 0


def set_overrides(spec: str = "0") -> None:
    """Benchmarks' attention variants: "SPLITS[/BS[/STAGES[/WARPS[/MAXNREG]]]]", 0 = the launcher's choice."""
    global ATTN_SPLITS, ATTN_BS, ATTN_STAGES, ATTN_WARPS, ATTN_MAXNREG
    ATTN_SPLITS, ATTN_BS, ATTN_STAGES, ATTN_WARPS, ATTN_MAXNREG = (
        [int(v) for v in spec.split("/")] + [0] * 4
    )[:5]


def _narrow(b: int) -> bool:
    return ATTN_NARROW_MIN_B <= b <= ATTN_NARROW_MAX_B


def _attn_programs(b: int, kv8: bool, device: torch.device) -> int:
    if ATTN_PROGRAMS:
        return ATTN_PROGRAMS
    per_sm = ATTN_NARROW_PROGRAMS_PER_SM if _narrow(b) and kv8 else ATTN_PROGRAMS_PER_SM
    return per_sm * sm_count(device)  # (runs only when a step is launched eagerly or captured)


def _attn_splits(b: int, hkv: int, s: int, kv8: bool, device: torch.device) -> int:
    """Programs per (row, kv head): fixed by the batch when the step is captured, while the context they share
    grows step by step (each takes a 1/NSPLIT span of it, a multiple of 16 keys)."""
    if INTERPRET:
        return 4
    want = ATTN_SPLITS or max(1, _attn_programs(b, kv8, device) // (b * hkv))
    return max(1, min(want, 32, triton.cdiv(s, 16)))


def attn_decode(
    q,
    k_cache,
    v_cache,
    pos,
    out,
    sm_scale: float,
    keys: int = 0,
    prefetch=None,
    pf_programs: int | None = None,
) -> None:
    """One query per row: q [B, H, D] attends to cache slots 0..pos[b]; out [B, H, D]. GQA: the H // Hkv
    query heads of a KV head share one program's K/V loads. keys: `key_range`'s range (0: the default splits).
    prefetch: a later kernel's weight tensor, or a tuple of up to three, which about pf_programs more programs (None:
    this batch's tuned count, `prefetch_candidates`) pull into L2 (a hint: no result changes)."""
    b, h, d = q.shape[0], q.shape[1], q.shape[-1]
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    g = h // hkv
    gp = max(16, triton.next_power_of_2(g))  # tl.dot needs >= 16 rows
    kv8 = k_cache.element_size() == 1
    nsplit = _attn_splits(b, hkv, s, kv8, q.device)
    narrow = _narrow(b)
    bs, warps, stages = (
        (16, 1, 0) if INTERPRET else (ATTN_BS or 64, ATTN_WARPS or (2 if narrow else 4), ATTN_STAGES)
    )
    if keys > _range_bs():  # the default splits over small blocks (ATTN_SMALL_MAX_KEYS)
        bs, stages = ATTN_BS or _small_bs(), ATTN_STAGES or (0 if INTERPRET else ATTN_SMALL_STAGES)
    # a range's block of K (and one of V) must fit 64 KB of shared memory: not so for float32 at 128 dims
    elif keys and ATTN_RANGE_BS * d * q.element_size() <= 65536:
        bs, stages = _range_bs(), 1
        nsplit, warps = 1, 1 if INTERPRET else ATTN_RANGE_WARPS  # one program a (row, kv head): no merge
    key = (str(q.device), b, hkv, nsplit, gp, d)
    if key not in _attn_ws:  # partials + zeroed counters, allocated before any graph capture (warm-up call)
        _attn_ws[key] = (
            torch.empty((b * hkv * nsplit * gp, d), dtype=torch.float32, device=q.device),
            torch.empty((b * hkv * nsplit * gp, 2), dtype=torch.float32, device=q.device),
            torch.zeros((b * hkv,), dtype=torch.int32, device=q.device),
        )
    pacc, pml, cnt = _attn_ws[key]
    pfs = () if prefetch is None else prefetch if isinstance(prefetch, tuple) else (prefetch,)
    if len(pfs) > 3:
        raise ValueError(f"attn_decode: prefetch takes up to 3 tensors, got {len(pfs)}")
    if pf_programs is None:
        pf_programs = _prefetch_count(b, hkv, kv8, pfs) if pfs else 0
    if INTERPRET:  # the prefetch is a no-op there: a few programs run its code path
        pf_programs = min(pf_programs, 2 * b * hkv)
    pfp = triton.cdiv(pf_programs, b * hkv) if pfs else 0
    pfs = [t.view(torch.uint8) for t in pfs] if pfp else []  # [N, K/4] bytes (views: no copy)
    pf, pf2, pf3 = (pfs + [None, None, None])[:3]
    _attn_gqa_kernel[(b, hkv, nsplit + pfp)](
        q,
        k_cache,
        v_cache,
        pos,
        out,
        pacc,
        pml,
        cnt,
        sm_scale,
        h,
        hkv,
        s,
        nsplit,
        G=g,
        GP=gp,
        GM=triton.next_power_of_2(g),
        D=d,
        BS=bs,
        NS2=triton.next_power_of_2(nsplit),
        IEEE=q.dtype == torch.float32,
        PTX=not INTERPRET,
        KV8=kv8,
        num_warps=warps,
        **({"num_stages": stages} if stages else {}),
        **({"maxnreg": ATTN_MAXNREG} if ATTN_MAXNREG and not INTERPRET else {}),
        LATE=late_launch(b),
        POS_EARLY=bool(ATTN_POS_EARLY),
        IDLE_EARLY=bool(ATTN_IDLE_EARLY),
        pf_ptr=pf,
        pf_bytes=pf.numel() if pf is not None else 0,
        pf2_ptr=pf2,
        pf2_bytes=pf2.numel() if pf2 is not None else 0,
        pf3_ptr=pf3,
        pf3_bytes=pf3.numel() if pf3 is not None else 0,
        PF2=pf2 is not None,
        PF3=pf3 is not None,
        PFP=pfp,
        PF_WAIT=bool(ATTN_PF_WAIT),
        PFB=ATTN_PF_BLOCK,
        **pdl_kw(),
    )
