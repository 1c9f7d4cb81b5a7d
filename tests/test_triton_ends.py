"""The decode step's two ends (kernels/triton/ends.py): int8 embedding rows and the greedy argmax +
bookkeeping, against PyTorch. Under Triton's interpreter on the CPU (CI), compiled on a GPU."""

from __future__ import annotations

import pytest
import torch
from triton_interp import DEV, triton_modules


def _embed_case(dtype):
    (ends,) = triton_modules("ends")
    g = torch.Generator().manual_seed(0)
    v, k = 50, 40  # k not a power of two
    q = torch.randint(-127, 128, (v, k), generator=g, dtype=torch.int8).to(DEV)
    s = (torch.rand(v, generator=g) * 0.1).to(DEV)
    tok = torch.tensor([3, 49, 3, 0, 17], device=DEV)
    want = (q[tok].float() * s[tok][:, None]).to(dtype)  # the engine's former PyTorch path
    got = ends.embed_int8(tok, q, s, dtype)
    assert got.dtype == dtype and torch.equal(got, want)


def test_embed_int8_equals_torch():
    _embed_case(torch.float32)


@pytest.mark.gpu
def test_gpu_embed_int8_bf16_equals_torch():
    """bf16 rows, rounded to nearest even as PyTorch rounds (the interpreter's bf16 cast truncates)."""
    _embed_case(torch.bfloat16)


def _logits_with_ties(b: int, v: int, g: torch.Generator) -> torch.Tensor:
    """Random rows whose maximum sits at several places: across chunk and block edges, in the last (short)
    chunk, and twice inside one block; argmax must give the first."""
    x = torch.randn(b, v, generator=g)
    spots = [(0, [5, v - 1]), (1, [v - 1]), (2, [v // 2 - 1, v // 2]), (3, [v // 4 + 7, 3 * v // 4])]
    for r, cols in spots:
        if r < b:
            x[r, cols] = 9.0
    if b > 4:  # a NaN beats every number, even an earlier infinity (torch.argmax: the first NaN)
        x[4, [1, v // 2]] = float("inf")
        x[4, [v - 2, v - 1]] = float("nan")  # both in the last block
    if b > 5:  # a row of -inf gives 0
        x[5] = float("-inf")
    if b > 6:  # NaNs in two chunks (or blocks): the first
        x[6, 1] = float("inf")
        x[6, [v // 3, v - 2]] = float("nan")
    return x.to(DEV)


@pytest.mark.parametrize("b,v,chunks", [(4, 1000, 4), (3, 1000, 0), (1, 257, 2), (7, 300, 1), (7, 1000, 4)])
def test_greedy_step_equals_argmax_and_bookkeeping(b, v, chunks):
    (ends,) = triton_modules("ends")
    g = torch.Generator().manual_seed(b * v)
    s = 6
    tok = torch.zeros((b, 1), dtype=torch.long, device=DEV)
    out = torch.full((b, s), -1, dtype=torch.long, device=DEV)
    step = torch.tensor([2], device=DEV)
    pos = torch.arange(10, 10 + b, dtype=torch.int32, device=DEV)
    for i in range(3):  # the counters reset themselves between calls
        x = _logits_with_ties(b, v, g)
        want = x.argmax(dim=-1)
        ends.greedy_step(x, tok, out, step, pos, chunks=chunks)
        assert torch.equal(tok[:, 0], want), (tok[:, 0], want)
        assert torch.equal(out[:, 2 + i], want)
        assert int(step) == 3 + i
        assert torch.equal(pos.cpu(), torch.arange(11 + i, 11 + i + b, dtype=torch.int32))
    assert (out[:, :2] == -1).all() and (out[:, 5:] == -1).all()  # no other column written


@pytest.mark.parametrize("b,chunks", [(1, 1), (1, 3), (3, 1), (3, 4)])
def test_greedy_step_index_maps_the_winning_tile(b, chunks):
    """index= (tile maxima, each tile's first index): the token is the winning tile's index, with one chunk a
    row (no partials) and with several (partials + the last program's reduction); ties go to the first tile."""
    (ends,) = triton_modules("ends")
    g = torch.Generator().manual_seed(b * 10 + chunks)
    t = 700  # tiles: several 256-blocks under the interpreter, the last one short
    x = _logits_with_ties(b, t, g)
    index = torch.randperm(t * 64, generator=g)[:t].to(torch.int32).expand(b, t).contiguous().to(DEV)
    tok = torch.zeros((b, 1), dtype=torch.long, device=DEV)
    out = torch.full((b, 3), -1, dtype=torch.long, device=DEV)
    step = torch.tensor([1], device=DEV)
    pos = torch.zeros((b,), dtype=torch.int32, device=DEV)
    for i in range(2):  # counters reset between calls
        ends.greedy_step(x, tok, out, step, pos, chunks=chunks, index=index)
        want = index.gather(1, x.argmax(-1, keepdim=True))[:, 0].long()
        assert torch.equal(tok[:, 0], want) and torch.equal(out[:, 1 + i], want), i
        assert int(step) == 2 + i and (pos == 1 + i).all()


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 8, 64])
def test_gpu_greedy_step_2b4t_vocab_in_a_graph(b):
    """The 2B4T vocabulary, default chunking, replayed in a CUDA graph (as the engine's decode step runs)."""
    from bitnetlm.kernels.triton.ends import greedy_step
    from bitnetlm.runtime.cuda.graphs import capture

    v = 128256
    g = torch.Generator().manual_seed(b)
    x = _logits_with_ties(b, v, g)
    tok = torch.zeros((b, 1), dtype=torch.long, device="cuda")
    out = torch.zeros((b, 8), dtype=torch.long, device="cuda")
    step = torch.zeros((1,), dtype=torch.long, device="cuda")
    pos = torch.zeros((b,), dtype=torch.int32, device="cuda")
    graph, _ = capture(lambda: greedy_step(x, tok, out, step, pos), before_capture=lambda: step.zero_())
    pos.zero_()
    for i in range(4):
        x.copy_(_logits_with_ties(b, v, g))
        graph.replay()
        want = x.cpu().argmax(dim=-1).cuda()  # the CPU's semantics: the first NaN, else the first maximum
        assert torch.equal(tok[:, 0], want) and torch.equal(out[:, i], want), i
    assert int(step) == 4 and (pos == 4).all()


def _head_argmax_case(m: int, n: int, k: int, s: torch.Tensor, w: torch.Tensor, x: torch.Tensor, cfg=None):
    """`w8a16_argmax`'s tiles against the logits of `w8a16_linear` (same codes, same tile): each tile's maximum
    and first index as torch.argmax over that tile gives them, and greedy_step(index=) over the tiles gives the
    argmax of the whole row."""
    ends, L, T = triton_modules("ends", "head", "tune")
    cfg = cfg or T._w8_candidates(m)[0]
    nw = torch.ones(k, device=DEV, dtype=x.dtype)
    logits = L.w8a16_linear(x, nw, 1e-5, w, s, cfg=cfg).cpu()
    _tiles_argmax(L.w8a16_argmax(x, nw, 1e-5, w, s, cfg=cfg), logits, cfg["BN"], ends)
    _folded_argmax(L, x, nw, w, s, cfg, logits)
    return logits


def _folded_argmax(L, x, nw, w, s, cfg, logits):
    """`w8a16_greedy` (the head's last program samples) over three steps: the row's argmax into tok and out[:,
    step], pos and step advanced, and its best / counter buffers left zero for the next call."""
    m = x.shape[0]
    tok = torch.full((m, 1), -1, dtype=torch.long, device=DEV)
    out = torch.full((m, 4), -1, dtype=torch.long, device=DEV)
    step = torch.ones((1,), dtype=torch.long, device=DEV)
    pos = torch.arange(m, dtype=torch.int32, device=DEV) * 7
    for i in range(3):  # the first call picks its tile itself (w8a16_argmax's key; the one candidate here)
        L.w8a16_greedy(x, nw, 1e-5, w, s, tok, out, step, pos, cfg=None if i == 0 else cfg)
        assert torch.equal(tok[:, 0].cpu(), logits.argmax(-1)), i
        assert torch.equal(out[:, 1 + i].cpu(), logits.argmax(-1)), i
    assert (out[:, 0] == -1).all() and int(step) == 4
    assert torch.equal(pos.cpu(), torch.arange(m, dtype=torch.int32) * 7 + 3)
    best, cnt = L._fold_ws[(str(x.device), m)]
    assert not best.any() and not cnt.any()


def _tiles_argmax(tiles, logits, bn, ends):
    maxima, index = tiles
    m, n = logits.shape
    assert maxima.shape == index.shape == (m, -(-n // bn))
    for t in range(maxima.shape[1]):  # the CPU's argmax: the first NaN, else the first maximum
        i = logits[:, t * bn : (t + 1) * bn].argmax(-1) + t * bn
        assert torch.equal(index[:, t].cpu().long(), i), t
        want = logits.gather(1, i[:, None])[:, 0]
        torch.testing.assert_close(maxima[:, t].cpu(), want, rtol=0, atol=0, equal_nan=True)
    tok = torch.zeros((m, 1), dtype=torch.long, device=DEV)
    out = torch.zeros((m, 2), dtype=torch.long, device=DEV)
    step = torch.zeros((1,), dtype=torch.long, device=DEV)
    pos = torch.zeros((m,), dtype=torch.int32, device=DEV)
    ends.greedy_step(maxima, tok, out, step, pos, index=index)
    assert torch.equal(tok[:, 0].cpu(), logits.argmax(-1))


def test_head_argmax_in_tiles_ties_nan_inf():
    """The int8 head reduced inside its tiles: ties inside a tile and across tiles (equal weight rows and scales:
    the first wins), an infinity before a NaN (the NaN wins), two NaNs (the first), a short last tile; 5 rows."""
    g = torch.Generator().manual_seed(11)
    m, n, k = 5, 40, 96
    x = (torch.rand(m, k, generator=g) + 0.1).to(DEV)  # positive rows: an all-positive weight row scores high
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    w[[3, 20, 21, 37]] = 127  # equal rows: 3 and 20/21 in different tiles, 20 and 21 in one
    w = w.to(DEV)
    s = (torch.rand(n, generator=g) * 0.01).to(DEV)
    s[[3, 20, 21, 37]] = 5.0
    logits = _head_argmax_case(m, n, k, s, w, x)
    assert (logits.argmax(-1) == 3).all()  # the ties were real and the first won
    s2 = s.clone()
    s2[3] = 1.0  # 20 and 21 now tie for the maximum inside one tile
    assert (_head_argmax_case(m, n, k, s2, w, x).argmax(-1) == 20).all()
    s3 = s.clone()
    s3[5], s3[37] = float("inf"), float("nan")  # w[5] . x > 0 in some rows: +inf; NaN at 37 beats it
    logits = _head_argmax_case(m, n, k, s3, w, x)
    assert (logits.argmax(-1) == 37).all()
    s3[18] = float("nan")
    assert (_head_argmax_case(m, n, k, s3, w, x).argmax(-1) == 18).all()
    zero = torch.zeros_like(s)  # every logit +0.0 or -0.0 (a negative dot): they tie, so the first wins
    logits = _head_argmax_case(m, n, k, zero, w, x)
    assert (logits == 0).all() and torch.signbit(logits).any() and (logits.argmax(-1) == 0).all()


def _gpu_engine(b):
    """A 2B4T-shaped engine of b rows with random weights: int8 head, float8 cache."""
    import bitnetlm.runtime.cuda.engine as E
    from bitnetlm.models import ModelConfig

    ecfg = E.EngineConfig(max_batch=b, max_seq_len=600, head="int8", kv_dtype=torch.float8_e4m3fn)
    return E.CudaEngine.random(ModelConfig(), ecfg)


def _start(eng, st, b):
    """A zeroed KV cache, rows at positions 400 + row, tokens 7 * row + 3, output slot 1 of a zeroed out."""
    for c in eng.k_cache + eng.v_cache:
        c.view(torch.uint8).zero_()
    st.pos.copy_(torch.arange(b, dtype=torch.int32, device="cuda") + 400)
    st.step.fill_(1)
    st.out.zero_()
    st.tok.copy_(torch.arange(b, device="cuda").view_as(st.tok) * 7 + 3)


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 8, 64])
def test_gpu_engine_head_fold_exact(b):
    """The 2B4T-shaped engine's captured greedy step (int8 head, float8 cache), whose head takes each row's
    argmax and does the step's bookkeeping itself (`head.w8a16_greedy`), against the captured step without
    sampling (`logits_state`) and torch.argmax of its logits: the same tokens, outputs, positions and step over 8
    replays."""
    eng = _gpu_engine(b)
    st = eng.decode_state(b, max_keys=1024)
    _start(eng, st, b)
    for _ in range(8):
        st.graph.replay()
    ls = eng.logits_state(b, max_keys=1024)
    _start(eng, ls, b)
    toks = []
    for _ in range(8):
        ls.graph.replay()
        toks.append(ls.logits.argmax(-1))
        ls.tok.copy_(toks[-1][:, None])
    assert torch.equal(st.out[:, 1:9], torch.stack(toks, 1)) and not st.out[:, 9:].any()
    assert torch.equal(st.tok, ls.tok) and torch.equal(st.pos, ls.pos) and int(st.step) == 9


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 2, 3, 4, 5, 6, 7, 8])
def test_gpu_engine_attention_prefetch_exact(b):
    """The same captured greedy step with and without the attention's L2 prefetch of gate|up's weights
    (`DecodePlan.attn_pf_table`, at every batch it names a count for; at batch 1 the next layer's q|k|v too, at
    batch 2 down's; without: `attn_pf_programs` 0): the same tokens, outputs, positions and step."""
    import dataclasses

    from bitnetlm.kernels.triton import attention as A

    assert A.prefetch_programs(b, kv8=True) > 0
    eng = _gpu_engine(b)
    plan = eng.plan
    runs = []
    for on in (False, True):
        eng.plan = dataclasses.replace(plan, attn_pf_programs=-1 if on else 0)
        eng._graphs.clear()
        st = eng.decode_state(b, max_keys=1024)
        _start(eng, st, b)
        for _ in range(8):
            st.graph.replay()
        runs.append((st.out[:, :10].clone(), st.tok.clone(), st.pos.clone(), st.step.clone()))
    assert all(torch.equal(u, v) for u, v in zip(*runs))
    assert int(runs[1][3]) == 9 and (runs[1][0][:, 1:9] != 0).any()
