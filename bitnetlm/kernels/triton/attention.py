"""The decode step's single-query attention over the KV cache [B, Hkv, S, D] (flash-decoding splits, GQA-grouped
tensor-core dots), one launch a layer; the RoPE + KV-cache write before it is `rope.py`'s. Its splits, blocks,
warps, short-context ranges, launch trigger and L2-prefetch programs follow the step's `DecodePlan` (`plan=`,
None: the default plan): `attn_launch` and `key_range` are the pure rules, `attn_decode` the launcher.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bitnetlm.kernels.triton.common import (
    INTERPRET,
    _kv_slot,
    _pdl_trigger,
    _pdl_wait,
    _prefetch_l2,
    pdl_kw,
    sm_count,
    table_block_size,
)
from bitnetlm.kernels.triton.plan import DecodePlan, resolve


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
    pf_ptr=None,
    pf_bytes=0,
    pf2_ptr=None,
    pf2_bytes=0,
    pf3_ptr=None,
    pf3_bytes=0,
    PF2: tl.constexpr = False,
    PF3: tl.constexpr = False,
    PFP: tl.constexpr = 0,
    PFB: tl.constexpr = 512,
    tbl_ptr=None,
    TBL_STRIDE=0,
    PBS: tl.constexpr = 0,
):
    """Flash-decoding over a GQA group: program (b, kv head, split) loads each K/V block of its keys once for
    all G query heads sharing it (scores and P@V on tensor cores, the G rows padded to GP >= 16). The row's live
    context 0..pos[b] (not the cache's capacity S) is cut into NSPLIT spans of a multiple of 16 keys, so a
    short context in a long cache still spreads over every split; the last split of (b, kv head) holding keys
    to finish (an atomic counter) merges the partial (max, sum, acc) and resets the counter for the next call
    (CUDA-graph replays need no memset). When one split holds every key (batch 64 runs one split a row; a short
    context) that program normalizes and stores its output itself: no partials, counter or merge.
    PFP > 0: PFP more programs a (row, kv head), past the NSPLIT splits, pull their share of pf_bytes of a later
    kernel's weights into L2 after the PDL wait and end; they take no part in the merge.
    PBS > 0: a paged cache, k / v pools [blocks, HKV, PBS, D] whose row b's key s lives in block tbl[b, s // PBS]
    (`_kv_slot`)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    base = (b * HKV + kvh) * S * D
    if PFP:
        if sp >= NSPLIT:
            _pdl_wait(PDL, TRIGGER=not LATE)
            part, nparts = (b * HKV + kvh) * PFP + sp - NSPLIT, tl.num_programs(0) * HKV * PFP
            _prefetch_part(pf_ptr, pf_bytes, part, nparts, PTX, PFB)
            if PF2:
                _prefetch_part(pf2_ptr, pf2_bytes, part, nparts, PTX, PFB)
            if PF3:
                _prefetch_part(pf3_ptr, pf3_bytes, part, nparts, PTX, PFB)
            return
    # pos is constant for the whole step: its first kernel (F.embedding or `ends.embed_int8`) lets the next one
    # launch only after the previous step's sampler has written it, so it is read before the wait
    n = tl.load(pos_ptr + b) + 1  # keys 0..pos[b] are this row's context
    span = _span(n, NSPLIT)
    # this program's first K/V block into L2 while waiting (a hint only: the rows past pos are still being written;
    # the real loads come later). A paged cache's blocks are looked up later.
    if PDL and PBS == 0:
        LP: tl.constexpr = D // 64 if D >= 64 else 1  # 128-byte lines of a bf16 row
        pos_early = n - 1
        span_e = _span(pos_early + 1, NSPLIT)
        pf_s = sp * span_e + tl.arange(0, BS)
        pf_kv = base + pf_s[:, None] * D + (tl.arange(0, LP) * 64)[None, :]
        pf_m = tl.broadcast_to(((pf_s <= pos_early) & (pf_s < (sp + 1) * span_e))[:, None], [BS, LP])
        _prefetch_l2(k_ptr + pf_kv, pf_m, True)
        _prefetch_l2(v_ptr + pf_kv, pf_m, True)
    # a split past the row's keys reads nothing: it ends without waiting. LATE: the next kernels launch at this
    # one's end (`late_launch`)
    if sp * span < n:
        _pdl_wait(PDL, TRIGGER=not LATE)
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
            if PBS:
                kr = _kv_slot(tbl_ptr, b, kvh, offs_s, ms, HKV, S, TBL_STRIDE, PBS) * D
                k = tl.load(k_ptr + kr[:, None] + offs_d[None, :], mask=ms[:, None], other=0.0)
                v = tl.load(v_ptr + kr[:, None] + offs_d[None, :], mask=ms[:, None], other=0.0)
            else:
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
                # [NS2, GM, D] tile in registers and no sum over it across warps (a step 2-6% faster at batch
                # 1-16 than that tile's merge, the same at 64)
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


def late_launch(b: int, plan: DecodePlan | None = None) -> bool:
    """Does batch b's decode attention let the next kernels launch only at its end (`DecodePlan.attn_late_*`)?"""
    plan = resolve(plan)
    return plan.attn_late_min_b <= b <= plan.attn_late_max_b


def prefetch_programs(b: int, kv8: bool, plan: DecodePlan | None = None) -> int:
    """How many programs batch b's decode attention (kv8: over a float8 cache) adds to pull a later kernel's
    weights into L2 (0: none), by the plan's tables (`attn_pf_programs` >= 0 overrides them up to batch 32); a GPU
    model's step table may hold other counts (`prefetch_candidates`)."""
    plan = resolve(plan)
    if plan.attn_pf_programs >= 0:
        return plan.attn_pf_programs if b <= 32 else 0
    table = plan.attn_pf_table if kv8 else plan.attn_pf_table_kv16
    return table[b - 1] if 1 <= b <= len(table) else 0


def prefetch_candidates(b: int, kv8: bool, plan: DecodePlan | None = None) -> list[dict]:
    """The prefetch counts of batch b as a step-only tuning key's candidates, `prefetch_programs`' first, then the
    plan's `attn_pf_counts`."""
    plan = resolve(plan)
    first = prefetch_programs(b, kv8, plan)
    if b > 32:
        return [{"programs": first}]
    return [{"programs": n} for n in (first, *(c for c in plan.attn_pf_counts if c != first))]


def _prefetch_count(b: int, hkv: int, kv8: bool, pfs: list[torch.Tensor], plan: DecodePlan) -> int:
    """The count of this launch: the override, else the step-tuned key's choice (a step table's, else the table's)."""
    if plan.attn_pf_programs >= 0 or INTERPRET:
        return prefetch_programs(b, kv8, plan)
    from bitnetlm.kernels.triton.tune import _tune

    key = ("attn_pf", b, hkv, kv8, tuple(t.numel() for t in pfs))
    return _tune(key, lambda: prefetch_candidates(b, kv8, plan), None, None)["programs"]


_attn_ws: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _range_bs(plan: DecodePlan, interpret: bool = INTERPRET) -> int:
    return 16 if interpret else plan.attn_range_bs  # the interpreter's small blocks


def key_ranges(plan: DecodePlan | None = None) -> list[int]:
    """Every key range `key_range` picks but 0 (a server captures a step for each)."""
    plan = resolve(plan)
    return [_range_bs(plan), plan.attn_small_max_keys]


def key_range(batch: int, max_keys: int, plan: DecodePlan | None = None) -> int:
    """The key range a captured decode step of `batch` rows, none past `max_keys` keys, is built for:
    `attn_small_max_keys` (the default splits over small blocks, up to `attn_small_max_b` rows), one range block
    (up to `attn_range_max_b` rows), or 0 (the default splits; also for max_keys 0, unknown)."""
    plan = resolve(plan)
    if batch <= plan.attn_small_max_b and 0 < max_keys <= plan.attn_small_max_keys:
        return plan.attn_small_max_keys
    if batch <= plan.attn_range_max_b and 0 < max_keys <= _range_bs(plan):
        return _range_bs(plan)
    return 0


def _narrow(b: int, plan: DecodePlan) -> bool:
    return plan.attn_narrow_min_b <= b <= plan.attn_narrow_max_b


def _attn_programs(b: int, kv8: bool, sms: int, plan: DecodePlan) -> int:
    if plan.attn_programs:
        return plan.attn_programs
    per_sm = plan.attn_narrow_programs_per_sm if _narrow(b, plan) and kv8 else plan.attn_programs_per_sm
    return per_sm * sms


def attn_launch(
    b: int,
    hkv: int,
    s: int,
    d: int,
    itemsize: int,
    kv8: bool,
    keys: int,
    sms: int,
    plan: DecodePlan | None = None,
    interpret: bool = INTERPRET,
) -> tuple[int, int, int, int, int]:
    """(splits a (row, kv head), keys a block, warps, pipeline stages (0: Triton's), register cap (0: none)) of
    the decode attention of b rows over a cache of hkv heads, s slots of d values of `itemsize` bytes (kv8: a
    float8 cache), at key range `keys` (`key_range`), on `sms` SMs. The splits are fixed by the batch when the
    step is captured, while the context they share grows step by step (each takes a 1/splits span of it, a
    multiple of 16 keys). interpret: Triton's interpreter (small blocks, one warp, 4 splits)."""
    plan = resolve(plan)
    if interpret:
        nsplit = 4
    else:
        want = plan.attn_splits or max(1, _attn_programs(b, kv8, sms, plan) // (b * hkv))
        nsplit = max(1, min(want, 32, triton.cdiv(s, 16)))
    narrow = _narrow(b, plan)
    if interpret:
        bs, warps, stages = 16, 1, 0
    else:
        bs, warps, stages = plan.attn_bs or 64, plan.attn_warps or (2 if narrow else 4), plan.attn_stages
    if keys > _range_bs(plan, interpret):  # the default splits over small blocks (attn_small_max_keys)
        bs = plan.attn_bs or (16 if interpret else plan.attn_small_bs)
        stages = plan.attn_stages or (0 if interpret else plan.attn_small_stages)
    # a range's block of K (and one of V) must fit 64 KB of shared memory: not so for float32 at 128 dims
    elif keys and plan.attn_range_bs * d * itemsize <= 65536:
        bs, stages = _range_bs(plan, interpret), 1
        nsplit, warps = 1, 1 if interpret else plan.attn_range_warps  # one program a (row, kv head): no merge
    maxnreg = plan.attn_maxnreg if plan.attn_maxnreg and not interpret else 0
    return nsplit, bs, warps, stages, maxnreg


def _split_workspace(device, b: int, hkv: int, nsplit: int, gp: int, d: int) -> tuple:
    """(partial accumulators, partial (max, sum), zeroed merge counters) of a launch's shape, kept: allocated before
    any graph capture (at the warm-up call)."""
    key = (str(device), b, hkv, nsplit, gp, d)
    if key not in _attn_ws:
        _attn_ws[key] = (
            torch.empty((b * hkv * nsplit * gp, d), dtype=torch.float32, device=device),
            torch.empty((b * hkv * nsplit * gp, 2), dtype=torch.float32, device=device),
            torch.zeros((b * hkv,), dtype=torch.int32, device=device),
        )
    return _attn_ws[key]


def _prefetch_args(prefetch, pf_programs: int | None, b: int, hkv: int, kv8: bool, plan: DecodePlan) -> tuple:
    """(prefetch programs a (row, kv head), up to three byte views of the tensors to prefetch or None) of a launch
    (see `attn_decode`)."""
    pfs = () if prefetch is None else prefetch if isinstance(prefetch, tuple) else (prefetch,)
    if len(pfs) > 3:
        raise ValueError(f"attn_decode: prefetch takes up to 3 tensors, got {len(pfs)}")
    if pf_programs is None:
        pf_programs = _prefetch_count(b, hkv, kv8, pfs, plan) if pfs else 0
    if INTERPRET:  # the prefetch is a no-op there: a few programs run its code path
        pf_programs = min(pf_programs, 2 * b * hkv)
    pfp = triton.cdiv(pf_programs, b * hkv) if pfs else 0
    pfs = [t.view(torch.uint8) for t in pfs] if pfp else []  # [N, K/4] bytes (views: no copy)
    return (pfp, *(pfs + [None, None, None])[:3])


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
    plan: DecodePlan | None = None,
    table: torch.Tensor | None = None,
) -> None:
    """One query per row: q [B, H, D] attends to cache slots 0..pos[b]; out [B, H, D]. GQA: the H // Hkv
    query heads of a KV head share one program's K/V loads. keys: `key_range`'s range (0: the default splits).
    prefetch: a later kernel's weight tensor, or a tuple of up to three, which about pf_programs more programs (None:
    this batch's tuned count, `prefetch_candidates`) pull into L2 (a hint: no result changes). plan: the step's
    `DecodePlan` (None: the default plan). table: int32 [B, blocks a row] of a paged cache, whose k_cache /
    v_cache are pools [blocks, Hkv, block size, D] (row b's slot s: offset s % block size of block table[b, s //
    block size])."""
    plan = resolve(plan)
    b, h, d = q.shape[0], q.shape[1], q.shape[-1]
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    pbs = table_block_size(table, b, k_cache, "attn_decode")
    if pbs:
        s = table.shape[1] * pbs  # (the splits' rule reads a row's capacity)
    g = h // hkv
    gp = max(16, triton.next_power_of_2(g))  # tl.dot needs >= 16 rows
    kv8 = k_cache.element_size() == 1
    sms = 0 if INTERPRET else sm_count(q.device, plan)
    nsplit, bs, warps, stages, maxnreg = attn_launch(b, hkv, s, d, q.element_size(), kv8, keys, sms, plan)
    pacc, pml, cnt = _split_workspace(q.device, b, hkv, nsplit, gp, d)
    pfp, pf, pf2, pf3 = _prefetch_args(prefetch, pf_programs, b, hkv, kv8, plan)
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
        **({"maxnreg": maxnreg} if maxnreg else {}),
        LATE=late_launch(b, plan),
        pf_ptr=pf,
        pf_bytes=pf.numel() if pf is not None else 0,
        pf2_ptr=pf2,
        pf2_bytes=pf2.numel() if pf2 is not None else 0,
        pf3_ptr=pf3,
        pf3_bytes=pf3.numel() if pf3 is not None else 0,
        PF2=pf2 is not None,
        PF3=pf3 is not None,
        PFP=pfp,
        PFB=plan.attn_pf_block,
        tbl_ptr=table,
        TBL_STRIDE=table.stride(0) if pbs else 0,
        PBS=pbs,
        **pdl_kw(plan),
    )
