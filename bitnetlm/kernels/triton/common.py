"""@triton.jit pieces shared by the W2A8 kernels (gemv.py, gemm.py, quant.py, decode.py, attention.py).

- platform: `INTERPRET` (TRITON_INTERPRET=1, the CPU), programmatic dependent launch (`_pdl_wait`, `pdl_kw`), the
  SMs a grid plans for (`sm_count`), L2 prefetch;
- exact arithmetic: correctly rounded reciprocal / division, round-half-even, signed `dp4a`, 2-bit code unpack;
- the float epilogue: (int32 X@C^T - rowsum(X)) * (s / a), the gated activation act(gate) * up, the gate|up
  paired tile's split, the residual add and the store;
- `torch.argmax`'s rule (the first maximum, a NaN above every number) for the int8 head's tiles and `greedy_step`.

Under TRITON_INTERPRET=1 the PTX pieces (dp4a, cvt.rni, div.rn, the packed shift) fall back to plain Triton ops
with the same integer results.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.language.extra import libdevice

try:  # grid dependency control (programmatic dependent launch, sm_90+)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: kernels run with PDL=False
    gdc_launch_dependents = gdc_wait = None

INTERPRET = bool(knobs.runtime.interpret)
HAS_GDC = gdc_wait is not None and not INTERPRET
PTX = not INTERPRET  # inline PTX (dp4a, cvt.rni, div.rn, prefetch); the interpreter runs plain Triton ops
ACT_CODES = {"relu2": 0, "silu": 1}
_PDL: list[bool] = []


def pdl_kw(plan=None) -> dict:
    """Launch options for the decode kernels: programmatic dependent launch (sm_90+) lets a kernel start (and
    load its weights) while the previous one drains; each such kernel waits (`_pdl_wait`) before touching
    anything an earlier kernel wrote. Off where the GPU lacks it, or where `plan.pdl` is False (a `DecodePlan`;
    None: on)."""
    if plan is not None and not plan.pdl:
        return {}
    if not _PDL:
        on = HAS_GDC and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
        _PDL.append(bool(on))
    return dict(PDL=True, launch_pdl=True) if _PDL[0] else {}


def sm_count(device: torch.device, plan=None) -> int:
    """The SMs a grid on `device` can fill: `plan.sms` when set; on the interpreter's CPU no limit. (torch caches
    the device's properties, so this is cheap at every launch.)"""
    if plan is not None and plan.sms:
        return plan.sms
    if device.type != "cuda":
        return 1 << 30
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _pdl_wait(PDL: tl.constexpr, TRIGGER: tl.constexpr = True, AFTER: tl.constexpr = False):
    """Programmatic dependent launch: let the next kernel start its prologue now (TRIGGER; else the kernel calls
    `_pdl_trigger` later itself), then wait until the previous kernel has finished and its writes are visible;
    AFTER: trigger after the wait instead, once the previous kernel has ended.
    Everything a kernel reads that an earlier kernel wrote, and every store, comes after this; only constant data
    (weights, scales) may be read before it."""
    if PDL:
        if TRIGGER and not AFTER:
            gdc_launch_dependents()
        gdc_wait()
        if TRIGGER and AFTER:
            gdc_launch_dependents()


@triton.jit
def _pdl_trigger(PDL: tl.constexpr):
    """Let the next kernel launch now (it still waits for this one to finish before reading its results)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def _prefetch_l2(ptrs, mask, PTX: tl.constexpr):
    """Hint: fetch the lines holding ptrs (where mask) into L2. No data comes back and nothing waits for it, so it
    is harmless on data that a running kernel may still write: kernels use it before `_pdl_wait` to pull their
    weights (or KV-cache rows) in while the previous kernel drains. A no-op in the interpreter."""
    if PTX:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r",
            [ptrs, mask.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _prefetch_scales(s_ptr, cols, mask, PER_ROW: tl.constexpr, PTX: tl.constexpr):
    """`_prefetch_l2` of the weight scales of rows cols [N] (without PER_ROW, the one per-tensor scale): an
    epilogue's only constant read, which would otherwise miss L2 after the wait (a step streams far more than L2
    holds, so nothing of the previous step's stays there)."""
    if PER_ROW:
        _prefetch_l2(s_ptr + cols, mask, PTX)
    else:
        _prefetch_l2(s_ptr + cols * 0, mask, PTX)


@triton.jit
def _rcp_rn(x, PTX: tl.constexpr):
    if PTX:
        return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), x)
    else:
        return 1.0 / x


@triton.jit
def _div_rn(a, b, PTX: tl.constexpr):
    if PTX:
        return tl.math.div_rn(a, b)
    else:
        return a / b


@triton.jit
def _add_rn(a, b, PTX: tl.constexpr):
    """a + b rounded on its own (add.rn): the compiler may not contract it with the multiply that produced a into
    one FMA. Which kernels it contracted in depended on their layouts, so a residual output differed in the last
    bit between GEMM variants; now every path rounds (acc * s / a) and then the sum, as torch does."""
    if PTX:
        return tl.inline_asm_elementwise(
            "add.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a + b


def table_block_size(table: torch.Tensor | None, b: int, k_cache: torch.Tensor, who: str) -> int:
    """The block size of a paged cache's launch (0: a static cache), after checking its block table."""
    if table is None:
        return 0
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] < b or table.stride(1) != 1:
        raise ValueError(
            f"{who}: the block table must be int32 [>= {b}, blocks] with unit column stride, found "
            f"{table.dtype} {tuple(table.shape)} strides {table.stride()}"
        )
    return k_cache.shape[2]


@triton.jit
def _kv_slot(tbl_ptr, m, kvh, pos, mask, HKV, S, TBL_STRIDE, PBS: tl.constexpr):
    """The cache row (in units of D) of kv head kvh at position pos of batch row m: slot pos of row m of a static
    cache [B, HKV, S, D]; PBS > 0: offset pos % PBS of block tbl[m, pos // PBS] of a paged pool [blocks, HKV,
    PBS, D] (mask: the positions whose block may be looked up)."""
    if PBS:
        blk = tl.load(tbl_ptr + m * TBL_STRIDE + pos // PBS, mask=mask, other=0)
        return (blk * HKV + kvh) * PBS + pos % PBS
    return (m * HKV + kvh) * S + pos


@triton.jit
def _rotate(f1, f2, c, s, PTX: tl.constexpr):
    """RoPE of the halves (f1, f2) by (cos, sin): (f1*c - f2*s, f2*c + f1*s), each product and the sum rounded on
    its own as torch's eager rotate-half does; left to the compiler, which products it contracted into an FMA
    depended on the kernel, and the fused q|k|v kernels differed from `rope_cache` in the last bit."""
    return _add_rn(f1 * c, -(f2 * s), PTX), _add_rn(f2 * c, f1 * s, PTX)


@triton.jit
def _rne(x, PTX: tl.constexpr):
    """Round half to even (torch.round), |x| < 2**22."""
    if PTX:
        return libdevice.rint(x)
    else:
        return (x + 12582912.0) - 12582912.0


@triton.jit
def _dp4a(a, b, c, PTX: tl.constexpr):
    """c + dot(bytes(a), bytes(b)) with signed bytes (PTX dp4a.s32.s32)."""
    if PTX:
        return tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        r = c
        for j in tl.static_range(4):
            r += ((a << (24 - 8 * j)) >> 24) * ((b << (24 - 8 * j)) >> 24)
        return r


@triton.jit
def _codes8(wb, I: tl.constexpr, PTX: tl.constexpr):
    """uint8 tile of packed bytes -> int8 codes (0..2) of slab I; PTX path works on 4 bytes per instruction."""
    if PTX:
        if I == 0:
            return tl.inline_asm_elementwise(
                "and.b32 $0, $1, 0x03030303;", "=r,r", [wb], dtype=tl.int8, is_pure=True, pack=4
            )
        elif I == 1:
            return tl.inline_asm_elementwise(
                "{.reg .b32 t; shr.b32 t, $1, 2; and.b32 $0, t, 0x03030303;}",
                "=r,r",
                [wb],
                dtype=tl.int8,
                is_pure=True,
                pack=4,
            )
        elif I == 2:
            return tl.inline_asm_elementwise(
                "{.reg .b32 t; shr.b32 t, $1, 4; and.b32 $0, t, 0x03030303;}",
                "=r,r",
                [wb],
                dtype=tl.int8,
                is_pure=True,
                pack=4,
            )
        else:
            return tl.inline_asm_elementwise(
                "{.reg .b32 t; shr.b32 t, $1, 6; and.b32 $0, t, 0x03030303;}",
                "=r,r",
                [wb],
                dtype=tl.int8,
                is_pure=True,
                pack=4,
            )
    else:
        return ((wb >> (2 * I)) & 3).to(tl.int8)


@triton.jit
def _epilogue(acc, rs, a, s_ptr, offs_n, mask_n, PER_ROW: tl.constexpr, PTX: tl.constexpr):
    """(int32 X@C^T - rowsum(X)) * (s / a) in float32; acc [BM, BN], rs/a [BM]."""
    return _epilogue_s(acc, rs, a, _scales(s_ptr, offs_n, mask_n, PER_ROW), PER_ROW, PTX)


@triton.jit
def _scales(s_ptr, offs_n, mask_n, PER_ROW: tl.constexpr):
    """The weight scales `_epilogue_s` takes: s [BN] of the columns offs_n (PER_ROW), else the one scale."""
    if PER_ROW:
        s = tl.load(s_ptr + offs_n, mask=mask_n, other=1.0)
    else:
        s = tl.load(s_ptr)
    return s


@triton.jit
def _epilogue_s(acc, rs, a, s, PER_ROW: tl.constexpr, PTX: tl.constexpr):
    """`_epilogue` over the loaded scales s (`_scales`): constant data a kernel may load before its PDL wait."""
    if PER_ROW:
        # s / a correctly rounded without a div.rn per element (MUFU-bound, and its registers cost the GEMM its
        # second CTA an SM): one reciprocal r = RN(1/a) per row, then two corrections q + (s - a*q) * r with exact
        # FMA residuals; the second starts within an ulp, so it rounds correctly (Markstein)
        if PTX:
            r = _rcp_rn(a, PTX)[:, None]
            sb = s[None, :]
            ab = a[:, None]
            q = sb * r
            q = tl.fma(tl.fma(-q, ab, sb), r, q)
            f = tl.fma(tl.fma(-q, ab, sb), r, q)
        else:
            f = s[None, :] / a[:, None]
    else:
        f = _div_rn(s + tl.zeros_like(a), a, PTX)[:, None]
    return (acc - rs[:, None]).to(tl.float32) * f


@triton.jit
def _activate(g, ACT: tl.constexpr):
    if ACT == 0:
        r = tl.maximum(g, 0.0)
        return r * r
    else:
        return g / (1.0 + tl.exp(-g))


@triton.jit
def _gated_epilogue(
    acc,
    acc2,
    rs,
    a,
    s_ptr,
    offs_n,
    mask_n,
    N,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    PER_ROW: tl.constexpr,
    PTX: tl.constexpr,
):
    """`_epilogue` of the output columns offs_n; GATED: acc2 holds the up rows (offs_n + N), act(gate) * up."""
    s = _scales(s_ptr, offs_n, mask_n, PER_ROW)
    s2 = s
    if GATED:
        s2 = _scales(s_ptr, offs_n + N, mask_n, PER_ROW)
    return _gated_epilogue_s(acc, acc2, rs, a, s, s2, GATED, ACT, PER_ROW, PTX)


@triton.jit
def _gated_epilogue_s(
    acc, acc2, rs, a, s, s2, GATED: tl.constexpr, ACT: tl.constexpr, PER_ROW: tl.constexpr, PTX: tl.constexpr
):
    """`_gated_epilogue` over the loaded scales (`_scales`): s of the gate (or only) rows, s2 of the up rows."""
    y = _epilogue_s(acc, rs, a, s, PER_ROW, PTX)
    if GATED:
        y = _activate(y, ACT) * _epilogue_s(acc2, rs, a, s2, PER_ROW, PTX)
    return y


@triton.jit
def _store_out(
    y,
    r_ptr,
    y_ptr,
    offs_m,
    offs_n,
    mask_m,
    mask_n,
    stride_rm,
    stride_ym,
    HAS_RES: tl.constexpr,
    PTX: tl.constexpr,
):
    """y [BM, BN] (+ the residual rows) -> the output rows, in the output dtype."""
    mask_y = mask_m[:, None] & mask_n[None, :]
    if HAS_RES:
        r = tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask_y, other=0.0)
        y = _add_rn(y, r.to(tl.float32), PTX)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty), mask=mask_y)


@triton.jit
def _argmax_parts(x, idx, live, NONE, AXIS: tl.constexpr):
    """Along AXIS, over the live entries of x (idx: their indices, ascending along AXIS; broadcast like x): the
    largest number, the first index holding it, and the first index of a NaN (NONE where there is none).
    `torch.argmax` takes the NaN index when there is one, else the maximum's."""
    nan = (x != x) & live
    xm = tl.where(live & ~nan, x, float("-inf"))
    m = tl.max(xm, axis=AXIS)
    first = tl.min(tl.where(live & (xm == tl.expand_dims(m, AXIS)), idx, NONE), axis=AXIS)
    first_nan = tl.min(tl.where(nan, idx, NONE), axis=AXIS)
    return m, first, first_nan


@triton.jit
def _argmax_step(best, best_nan, bi, x, offs, live, V):
    """A block x (its indices offs, live entries) into a row's running argmax (best, best_nan, bi) by
    `torch.argmax`'s rules: a NaN beats every number and the first NaN wins; strictly greater, so an earlier block
    keeps a tie. Also returns the block's largest number."""
    m, i, i_nan = _argmax_parts(x, offs, live, V, 0)
    has_nan = i_nan < V
    take = (has_nan & ~best_nan) | (~has_nan & ~best_nan & (m > best))
    bi = tl.where(take, tl.where(has_nan, i_nan, i), bi)
    best = tl.where(take, m, best)
    return best, best_nan | has_nan, bi, m


@triton.jit
def _argmax_chunks(pmax_ptr, pidx_ptr, base, NC, NCP: tl.constexpr):
    """A row's argmax from its NC chunks' partials at base (each chunk's maximum, NaN for a NaN, and its index, in
    vocabulary order): (the index, whether a chunk held a NaN)."""
    offs_c = tl.arange(0, NCP)
    mc = offs_c < NC
    # .cg: the other programs' partials from L2, never a stale L1 line of an earlier replay
    pm = tl.load(pmax_ptr + base + offs_c, mask=mc, other=float("-inf"), cache_modifier=".cg")
    pi = tl.load(pidx_ptr + base + offs_c, mask=mc, other=0, cache_modifier=".cg")
    _, first, first_nan = _argmax_parts(pm, offs_c, mc, NCP, 0)
    any_nan = first_nan < NCP
    first = tl.where(any_nan, first_nan, first)
    return tl.sum(tl.where(offs_c == first, pi, 0), axis=0), any_nan


@triton.jit
def _argmax_key(m, idx, has_nan):
    """A row's (maximum, its first index) as one uint64 whose unsigned order is `torch.argmax`'s ranking: a NaN
    above every number, then the larger number, then the smaller index (the top 32 bits hold the float's bits
    made monotone, the low 32 the index's complement), so one atomic max over a row's tiles picks its argmax."""
    m = tl.where(m == 0.0, 0.0, m)  # -0.0 ties +0.0, as in a float comparison
    u = m.to(tl.uint32, bitcast=True)
    # negatives reversed below the positives (u ^ 0xFFFFFFFF is ~u, both uint32: Triton 3.8's interpreter cannot
    # invert an unsigned tensor)
    hi = tl.where((u >> 31) != 0, u ^ 0xFFFFFFFF, u | 0x80000000)
    hi = tl.where(has_nan, 0xFFFFFFFF, hi)
    return (hi.to(tl.uint64) << 32) | (0xFFFFFFFF - idx.to(tl.uint32)).to(tl.uint64)


@triton.jit
def _greedy_fold(
    key,
    offs_m,
    mask_m,
    M,
    best_ptr,
    cnt_ptr,
    tok_ptr,
    out_ptr,
    stride_out,
    step_ptr,
    pos_ptr,
    BMR: tl.constexpr,
):
    """The greedy step folded into the int8 head (`head.w8a16_greedy`): each program's rows' keys (`_argmax_key`)
    into best [M] by an atomic max; the last program to finish (a counter over the whole grid) takes each row's
    winner, resets best and the counter for the next replay, and does `ends.greedy_step`'s bookkeeping: the
    token into tok and out[:, step], pos += 1, step += 1."""
    tl.atomic_max(best_ptr + offs_m, key, mask=mask_m, sem="relaxed")
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")  # after every thread's max (the barrier)
    if done == tl.num_programs(0) * tl.num_programs(1) - 1:
        tl.debug_barrier()
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed")
        step = tl.load(step_ptr)
        for r0 in range(0, M, BMR):
            rows = r0 + tl.arange(0, BMR)
            mr = rows < M
            zero = tl.zeros([BMR], tl.uint64)
            k = tl.atomic_xchg(best_ptr + rows, zero, mask=mr, sem="relaxed")  # read the winner and reset
            token = (0xFFFFFFFF - (k & 0xFFFFFFFF).to(tl.uint32)).to(tl.int64)
            tl.store(out_ptr + rows * stride_out + step, token, mask=mr)
            tl.store(tok_ptr + rows, token, mask=mr)
            tl.store(pos_ptr + rows, tl.load(pos_ptr + rows, mask=mr) + 1, mask=mr)
        tl.store(step_ptr, step + 1)
