"""The CUDA engine over a paged KV cache (EngineConfig.kv_blocks) computes what it computes over a static cache:
prefills from position 0 and continuing a cached prompt, decode steps (each q|k|v path), a captured verify's
chunk (keys > 0), and the keys land in the blocks the table names. Without a GPU the engine's forward runs its
Triton kernels under the interpreter (the captured graphs are the `gpu` tests').
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from triton_interp import DEV, triton_modules

triton_modules("attention")  # (the interpreter, before the engine imports its kernels)

S, BS = 32, 8


def _engines(model, blocks: int = 40, **kw):
    from bitnetlm.runtime.cuda.engine import CudaEngine, EngineConfig

    ecfg = EngineConfig(max_batch=3, max_seq_len=S, dtype=torch.float32, **kw)
    static = CudaEngine.from_model(model, ecfg, device=DEV)
    paged = CudaEngine.from_model(
        model, dataclasses.replace(ecfg, kv_blocks=blocks, kv_block_size=BS), device=DEV
    )
    g = torch.Generator().manual_seed(1)  # every row's blocks, scattered over the pool
    ids = torch.randperm(blocks, generator=g)[: 3 * (S // BS)].view(3, S // BS)
    paged.table[:3] = ids.to(torch.int32).to(DEV)
    return static, paged


def _rows_of(eng, li: int, rows: int, n: int):
    """Layer li's keys and values of positions 0..n-1 of rows 0..rows-1, as [rows, Hkv, n, D]."""
    from bitnetlm.runtime.paged_rows import gather_blocks

    if eng.table is None:
        return eng.k_cache[li][:rows, :, :n], eng.v_cache[li][:rows, :, :n]
    tab = eng.table[:rows]
    return gather_blocks(eng.k_cache[li], tab, n), gather_blocks(eng.v_cache[li], tab, n)


def _same(static, paged, rows: int, n: int):
    for li in range(len(static.layers)):
        for a, b in zip(_rows_of(static, li, rows, n), _rows_of(paged, li, rows, n), strict=True):
            assert torch.equal(a, b), li


def _pos(b: int, p: int):
    return torch.full((b,), p, dtype=torch.int32, device=DEV)


def test_paged_engine_equals_static(tiny_model):
    """Two rows: a prefill of 11 tokens (crossing a block), decode steps (batch 2 and 1; the fused q|k|v, then the
    unfused GEMV and rope_cache of a plan that fuses at no batch), a chunk continuing a prompt (start 3), and a
    verify chunk over a key span (keys 32): the same logits and keys."""
    static, paged = _engines(tiny_model)
    tok = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(0)).to(DEV)
    with torch.no_grad():
        for e in (static, paged):
            e.out = [e.forward(tok, _pos(2, 0), last_only=False)]
            for p in range(11, 13):  # batch-2 decode steps
                e.out.append(e.forward(tok[:, p - 11 : p - 10], _pos(2, p)))
            e.out.append(e.forward(tok[:1, :1], _pos(1, 13)))  # batch 1
            fused = e.plan
            e.plan = dataclasses.replace(fused, fused_max_b=0)
            e.out.append(e.forward(tok[:, 5:6], _pos(2, 14)))
            e.plan = fused
            e.forward(tok[:, :3], _pos(2, 0), row0=1)  # rows 1-2: a prompt's first 3 tokens, then the rest
            e.out.append(e.forward(tok[:, 3:], _pos(2, 3), row0=1, start=3))
            vt = tok[:1, :4]  # row 0, positions 15..18 over keys 0..31 (a captured verify's form)
            e.out.append(e.forward(vt, _pos(1, 15), last_only=False, row0=0, keys=S))
    for a, b in zip(static.out, paged.out, strict=True):
        assert torch.equal(a, b)
    _same(static, paged, 3, 19)


def test_paged_engine_prefill_pads_write_no_other_block(tiny_model):
    """A prefill's positions past the row's blocks (a padded prompt's tail) land in the trash block, and no block
    of another row changes."""
    static, paged = _engines(tiny_model)
    paged.table[0, 1:] = paged.trash  # row 0 holds one block: positions 0..7
    before = [c.clone() for c in paged.k_cache]
    tok = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(2)).to(DEV)
    with torch.no_grad():
        paged.forward(tok, _pos(1, 0))
    mine = {int(paged.table[0, 0]), paged.trash}
    for c, c0 in zip(paged.k_cache, before, strict=True):
        for blk in range(c.shape[0]):
            if blk not in mine:
                assert torch.equal(c[blk], c0[blk]), blk
        assert not torch.equal(c[paged.trash], c0[paged.trash])


def test_paged_engine_refuses_a_copy_row(tiny_model):
    """copy_to (a static cache's second row for a prefill) has no meaning over blocks: a clear error."""
    _, paged = _engines(tiny_model)
    tok = torch.zeros((1, 2), dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match="copy_to"):
        paged.forward(tok, _pos(1, 0), copy_to=torch.zeros((1,), dtype=torch.long, device=DEV))


def test_paged_engine_captured_prefill_body_and_kept_slots(tiny_model):
    """What a captured prefill runs (`scratch_prefill`: through the scratch row, into row 1's blocks) and what a
    decode capture's warm-up overwrites and `kept_slots` restores, eagerly: the static engine's logits and keys,
    and row 0's blocks as they were."""
    static, paged = _engines(tiny_model)
    tok = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(3)).to(DEV)
    last = torch.tensor([8], device=DEV)
    row = torch.tensor([1], device=DEV)
    with torch.no_grad():
        got = [e.scratch_prefill(tok, _pos(1, 0), last, row) for e in (static, paged)]
        assert torch.equal(got[0], got[1])
        for li in range(len(static.layers)):
            for a, b in zip(_rows_of(static, li, 2, 9), _rows_of(paged, li, 2, 9), strict=True):
                assert torch.equal(a[1], b[1])
        before = [c.clone() for c in paged.k_cache + paged.v_cache]
        with paged.kept_slots(2):
            for p in range(3):  # the warm-up runs of a capture from position 0
                paged.forward(tok[:1, :1].expand(2, 1), _pos(2, p))
            assert not all(torch.equal(a, b) for a, b in zip(before, paged.k_cache + paged.v_cache))
    assert all(torch.equal(a, b) for a, b in zip(before, paged.k_cache + paged.v_cache, strict=True))


def test_paged_engine_rows_sharing_a_prompt_block(tiny_model):
    """Row 1 maps row 0's first block (a shared prompt prefix) and prefills only its own tail; both then decode
    together, reading the shared block: the logits of a static cache where each row computed its whole prompt
    (close, not bitwise: the shared keys came from a prefill of another length)."""
    static, paged = _engines(tiny_model)
    paged.table[1, 0] = paged.table[0, 0]
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(0, 512, (1, BS), generator=g)
    prompts = torch.cat([shared.expand(2, BS), torch.randint(0, 512, (2, 3), generator=g)], 1).to(DEV)
    with torch.no_grad():
        want = [static.forward(prompts, _pos(2, 0))]
        row0 = paged.forward(prompts[:1], _pos(1, 0), row0=0)  # writes the shared block
        tail = paged.forward(prompts[1:, BS:], _pos(1, BS), row0=1, start=BS)  # row 1: its own tokens only
        got = [torch.cat([row0, tail])]
        nxt = want[0].argmax(-1, keepdim=True)
        want.append(static.forward(nxt, _pos(2, 11)))
        got.append(paged.forward(nxt, _pos(2, 11)))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
