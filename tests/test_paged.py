"""The paged KV cache: the block allocator alone, then the paged CPU runner against the static one (logits equal
bit for bit: the fused step reads the same keys in the same order), then the engine over it (prefix reuse through
shared blocks gives the tokens that no reuse gives; tests/test_preempt.py: a pool too small for every request)."""

from __future__ import annotations

import pytest
import torch
from serve_parts import tiny_model, tiny_model_and_tokenizer

from bitnetlm.engine.core import EngineCore
from bitnetlm.engine.metrics import Metrics
from bitnetlm.engine.sequence import GenerationRequest, Token
from bitnetlm.runtime import make_runner
from bitnetlm.runtime.blocks import BlockPool, OutOfBlocks
from bitnetlm.runtime.config import RuntimeConfig
from bitnetlm.runtime.cpu import CpuRunner
from bitnetlm.runtime.paged import PagedCpuRunner
from bitnetlm.runtime.paged_rows import PagedRows
from bitnetlm.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 300  # (the engine tests': their tokenizer's)


# ---- the allocator --------------------------------------------------------------------------------------------
def test_pool_refcounts_free_list_and_lru_eviction():
    p = BlockPool(4, 2)
    a, b, c = p.allocate(), p.allocate(), p.allocate()
    assert (a, b, c) == (0, 1, 2) and p.available() == 1 and p.in_use() == 3
    p.incref(a)
    p.decref(a)
    assert p.refs[a] == 1  # still held once
    p.cache(a, None, [5, 6])
    p.cache(b, a, [7, 8])
    p.decref(b)  # released first: evicted first
    p.decref(a)
    assert p.available() == 3 and p.in_use() == 1  # c in use; a, b cached and evictable
    assert p.match([5, 6, 7, 8, 9]) == [a, b]
    assert p.allocate() == 3  # a free block before any cached one
    assert p.allocate() == b  # then the least recently released cached block
    assert p.match([5, 6, 7, 8]) == [a]  # b's tokens are gone with it
    p.incref(a)  # a cached block taken again leaves the LRU
    with pytest.raises(OutOfBlocks, match="all 4 blocks of 2 positions are in use"):
        p.allocate()
    with pytest.raises(ValueError, match="released more often"):
        p.decref(3), p.decref(3)


def test_pool_keys_name_the_whole_prefix():
    """A block matches only after the same cached block: the same tokens after another prefix do not match, nor
    after a parent that was evicted and reused for other tokens."""
    p = BlockPool(3, 2)
    a = p.allocate()
    p.cache(a, None, [1, 2])
    b = p.allocate()
    p.cache(b, a, [3, 4])
    assert p.match([9, 9, 3, 4]) == [] and p.match([1, 2, 3, 4]) == [a, b]
    p.decref(a)
    p.allocate()  # the free block 2
    a2 = p.allocate()  # evicts a (b still referenced)
    assert a2 == a
    p.cache(a2, None, [1, 2])  # the same tokens again in the same block: a new generation
    assert p.match([1, 2, 3, 4]) == [a2]  # b followed the old a, not this one
    p.decref(b)
    assert p.cached(b)  # unreferenced, still cached
    with pytest.raises(ValueError, match="uncached while 2 rows"):
        p.incref(a2), p.uncache(a2)
    assert p.hits == 3 and p.queries == 6


def test_pool_a_rewritten_block_leaves_the_cache_with_what_followed_it():
    p = BlockPool(2, 2)
    a = p.allocate()
    p.cache(a, None, [1, 2])
    b = p.allocate()
    p.cache(b, a, [3, 4])
    p.uncache(a)  # its one row writes it
    assert p.match([1, 2, 3, 4]) == []
    p.cache(a, None, [1, 9])  # prefilled again with other tokens
    assert p.match([1, 9, 3, 4]) == [a]  # b followed the old contents


# ---- the runner against the static one ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return tiny_model(VOCAB, max_len=256, backend="cpu")


def _runners(model, rows=3, ctx=96, bs=4, tokens=256, kv=None):
    static = CpuRunner(model, RuntimeConfig(device="cpu", kv_cache_dtype=kv), rows, ctx)
    paged = make_runner(
        model, RuntimeConfig(device="cpu", kv_cache_dtype=kv, kv_tokens=tokens, kv_block_size=bs), rows, ctx
    )
    assert isinstance(paged, PagedCpuRunner) and static.fused is not None
    return static, paged


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _script(r, prompts):
    """Batched and chunked prefills of different lengths, decodes, a rejected draft rolled back (verify,
    truncate), a copied prefix diverging, a context shift -> every logits tensor produced."""
    out = [r.prefill_many([1, 2], prompts[1:3])]
    out.append(r.prefill(0, prompts[0][:7]))
    out.append(r.prefill(0, prompts[0][7:], 7))
    pos = [len(p) for p in prompts[:3]]
    tok = [int(out[-1].argmax()), *out[0].argmax(-1).tolist()]
    for step in range(9):
        lg = r.decode([0, 1, 2], tok, pos)
        out.append(lg)
        tok, pos = lg.argmax(-1).tolist(), [p + 1 for p in pos]
        if step == 3:  # row 1 scores a 3-token draft, keeps 1 of it
            v = r.verify(1, [tok[1], 5, 6], pos[1])
            out.append(v)
            r.truncate(1, pos[1] + 1)
            tok[1], pos[1] = int(v[0].argmax()), pos[1] + 1
        if step == 5:  # row 2 restarts with row 0's first 13 positions (a partly filled last block)
            r.copy_prefix(0, 2, 13)
            tok[2], pos[2] = prompts[0][13], 13
        if step == 7:
            r.shift(0, 3, 6)
            pos[0] -= 6
    return out


@pytest.mark.parametrize("kv", [None, "bf16"])
def test_paged_runner_equals_static_bit_for_bit(model, kv):
    static, paged = _runners(model, kv=kv)
    prompts = [_prompt(n, i) for i, n in enumerate((18, 11, 6))]
    a, b = _script(static, prompts), _script(paged, prompts)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    assert paged.fused.calls > 0 and paged.pool.in_use() > 0
    for r in range(3):
        paged.reset(r)
    assert paged.pool.in_use() == 0  # every block back (the prompts' full blocks stay cached)


def test_prefix_blocks_are_shared_not_recomputed(model):
    """A prompt whose leading full blocks a row prefilled maps those blocks (refcount 2) and prefills the rest:
    the logits equal a fresh static prefill; a write into a shared block copies it first, so the first row's
    keys stay as they were."""
    static, paged = _runners(model, bs=4)
    p = _prompt(21, 3)
    q = p[:14] + _prompt(6, 4)
    paged.prefill(0, p)
    static.prefill(0, p)
    static.copy_prefix(0, 1, 12)
    assert paged.cached_prefix(q) == 12  # three full blocks of 4
    assert paged.adopt(1, q[:12]) == 12
    shared = paged.blocks[1][:3]
    assert shared == paged.blocks[0][:3] and all(paged.pool.refs[b] == 2 for b in shared)
    before = [k[paged.blocks[0][2]].clone() for k in paged.k]
    got = paged.prefill(1, q[12:], 12)
    assert torch.equal(got, static.prefill(1, q[12:], 12))
    paged.truncate(1, 10)  # back into a shared block, then written again: copy on write
    paged.decode([1], [q[10]], [10])
    assert paged.blocks[1][2] != paged.blocks[0][2]
    assert all(torch.equal(k[paged.blocks[0][2]], b) for k, b in zip(paged.k, before, strict=True))
    assert torch.equal(paged.decode([0], [7], [21]), static.decode([0], [7], [21]))


def test_out_of_blocks_is_an_error_that_changes_nothing(model):
    static, paged = _runners(model, rows=2, bs=4, tokens=16)  # 4 blocks
    p = _prompt(10, 5)
    paged.prefill(0, p)  # 3 blocks
    static.prefill(0, p)
    with pytest.raises(OutOfBlocks, match="needs 2 more blocks of 4 positions, 1 of 4 are free"):
        paged.prefill(1, _prompt(8, 6))
    assert paged.blocks[1] == [] and paged.lengths[1] == 0 and paged.pool.available() == 1
    assert torch.equal(paged.decode([0], [3], [10]), static.decode([0], [3], [10]))
    # the C step checks every block id a token reads or writes against the pool
    paged.table[0, 1] = 4
    before = [k.clone() for k in paged.k]
    with pytest.raises(RuntimeError, match="fused C step failed with code -1"):
        paged.decode([0], [3], [11])
    # (bitwise: the pool is allocated uninitialised, and its unused blocks may hold NaN patterns)
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(paged.k, before, strict=True)
    )


def test_kv_tokens_falls_back_to_a_static_cache_where_it_cannot_page(model):
    m = tiny_model(VOCAB, max_len=64, backend="reference")  # no fused C step
    r = make_runner(m, RuntimeConfig(device="cpu", kv_tokens=64), 2, 32)
    assert not isinstance(r, PagedCpuRunner)
    r = make_runner(model, RuntimeConfig(device="cpu", kv_tokens=64, kv_cache_dtype="fp8"), 2, 32)
    assert not isinstance(r, PagedCpuRunner)
    assert not isinstance(make_runner(model, RuntimeConfig(device="cpu", kv_tokens=0), 2, 32), PagedCpuRunner)
    with pytest.raises(ValueError, match="--kv-tokens -1: expected an integer >= 0"):
        RuntimeConfig(kv_tokens=-1)


# ---- the engine -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_model():
    return tiny_model_and_tokenizer(max_len=256, backend="cpu")


def _serve_all(model_tok, runner, prompts, reuse=True, max_tokens=6, **options):
    metrics = Metrics("m")
    core = EngineCore(runner, model_tok[1], prefill_chunk=64, metrics=metrics, prefix_reuse=reuse, **options)
    got: dict[int, list[int]] = {}

    def sink(i):
        return lambda ev: got.setdefault(i, []).append(ev.token) if isinstance(ev, Token) else None

    for i, p in enumerate(prompts):
        core.add(GenerationRequest(p, SamplingParams(max_tokens=max_tokens, temperature=0.0)), sink(i))
    most = 0
    while core.has_work():
        core.step()
        most = max(most, len(core.running()))
    return [got[i] for i in range(len(prompts))], metrics.counters, most


def test_engine_shared_system_prompt_equal_with_and_without_reuse(engine_model):
    """32 requests sharing a system prompt through the engine: the paged cache with block reuse, without it, and
    the static cache give the same greedy tokens; reuse skips the shared blocks; a pool of 160 positions holds
    more requests at once than a reservation of prompt + max_tokens each would (2), and every block comes back at
    the end."""
    model = engine_model[0]
    vocab = model.config.vocab_size
    system = [int(t) % vocab for t in _prompt(40, 9)]
    prompts = [system + [int(t) % vocab for t in _prompt(3 + i % 5, 100 + i)] for i in range(32)]
    want, _, _ = _serve_all(engine_model, CpuRunner(model, RuntimeConfig(device="cpu"), 8, 64), prompts)
    cfg = RuntimeConfig(device="cpu", kv_tokens=160, kv_block_size=8)
    for reuse in (True, False):
        runner = make_runner(model, cfg, 8, 64)
        got, counters, most = _serve_all(engine_model, runner, prompts, reuse)
        assert got == want
        # each may fill 7 blocks of 8 positions (a prompt of 43-47 + 6): a reservation ran 2 at once in 20 blocks
        assert most > 2 and runner.pool.in_use() == 0
        hits = counters["prefix_cache_hits_total"]
        # all but the first reuse the system prompt's 5 full blocks (the second, which came with it, waits for
        # its prefill)
        assert hits == (31 * 40 if reuse else 0)
        # (a preempted request's tokens are queried again when it is prefilled again)
        queries = counters["prefix_cache_queries_total"]
        assert counters["prompt_tokens_total"] + hits == queries
        assert (queries == sum(map(len, prompts))) == (counters["num_preemptions_total"] == 0)


@pytest.mark.parametrize("case", ["speculative", "context_shift"])
def test_engine_speculative_rollback_and_context_shift_equal_static(engine_model, case):
    """Prompt lookup drafts rolled back by truncate, and context shifts past a 48-position window, over shared
    prompt blocks: the same greedy tokens as the static cache."""
    from bitnetlm.engine.scheduler import ContextShift
    from bitnetlm.engine.speculative import SpeculativeConfig

    model = engine_model[0]
    vocab = model.config.vocab_size
    loop = [int(t) % vocab for t in _prompt(6, 11)]
    prompts = [loop * 3 + [int(t) % vocab for t in _prompt(2 + i, 50 + i)] for i in range(6)]
    if case == "speculative":
        opts, n = dict(speculative=SpeculativeConfig(4, lookup=3)), 24
    else:
        opts, n = dict(context=48, context_shift=ContextShift(4)), 70
    want, _, _ = _serve_all(
        engine_model, CpuRunner(model, RuntimeConfig(device="cpu"), 4, 96), prompts, True, n, **opts
    )
    paged = make_runner(model, RuntimeConfig(device="cpu", kv_tokens=320, kv_block_size=4), 4, 96)
    got, counters, _ = _serve_all(engine_model, paged, prompts, True, n, **opts)
    assert got == want and counters["prefix_cache_hits_total"] > 0 and paged.pool.in_use() == 0
    if case == "speculative":
        assert (
            counters["spec_decode_num_accepted_tokens_total"] < counters["spec_decode_num_draft_tokens_total"]
        )


def test_engine_choices_share_their_prompt_blocks(engine_model):
    """n = 3 seeded sampled choices of one prompt: the siblings share the first's prompt blocks (the partly filled
    last one copied on their first write) and sample what they sample over the static cache."""
    model, tok = engine_model
    prompt = [int(t) % model.config.vocab_size for t in _prompt(30, 21)]
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=5)

    def run(runner):
        core = EngineCore(runner, tok)
        got: dict[int, list[int]] = {}
        core.add(
            GenerationRequest(prompt, params, n=3),
            lambda ev: got.setdefault(ev.seq.index, []).append(ev.token) if isinstance(ev, Token) else None,
        )
        most = 0
        while core.has_work():
            core.step()
            if getattr(runner, "pool", None) is not None:
                most = max(most, runner.pool.in_use())
        return got, most

    want, _ = run(CpuRunner(model, RuntimeConfig(device="cpu"), 3, 64))
    paged = make_runner(model, RuntimeConfig(device="cpu", kv_tokens=128, kv_block_size=8), 3, 64)
    got, most = run(paged)
    assert got == want and len({tuple(v) for v in got.values()}) > 1
    assert most < 3 * 6  # 42 positions each (6 blocks): the 3 full prompt blocks held once
    assert paged.pool.in_use() == 0


def test_scheduler_defers_a_prompt_whose_prefix_is_being_prefilled():
    """Requests that arrive together with one system prompt: the second waits one step for the first's prefill,
    then maps its blocks (the worker's part is not needed for the bookkeeping: the cache is a dict here)."""
    from test_prefix_reuse import _seq

    from bitnetlm.engine.scheduler import Scheduler, SchedulerConfig

    cached: set[tuple] = set()
    lookup = lambda p: max((len(c) for c in cached if tuple(p[: len(c)]) == c), default=0)  # noqa: E731
    sch = Scheduler(SchedulerConfig(rows=4, kv_blocks=64, block_size=8, lookup=lookup))
    system = list(range(100, 140))
    a, b, c = _seq(system + [1, 2]), _seq(system + [3, 4]), _seq([7] * 20)
    for s in (a, b, c):
        sch.add(s)
    plan = sch.schedule()
    assert plan.admitted == [a] and plan.reused == {}  # b waits; c (FIFO) behind it
    cached.add(tuple(system))  # a's prefill cached its 5 full blocks
    plan = sch.schedule()
    assert plan.admitted == [b, c] and plan.reused == {id(b): (None, 40)}
    assert sch.promised == 6 + 3  # b's and c's prompts and first decodes: (43, 21 positions) / 8, rounded up


def test_engine_rejects_a_request_the_pool_can_never_hold(engine_model):
    runner = make_runner(engine_model[0], RuntimeConfig(device="cpu", kv_tokens=32, kv_block_size=8), 2, 64)
    core = EngineCore(runner, engine_model[1])
    with pytest.raises(ValueError, match="may fill 40 KV positions .* holds: 32 \\(--kv-tokens\\)"):
        core.add(GenerationRequest(_prompt(30, 1), SamplingParams(max_tokens=10)), print)


def test_server_paged_outputs_equal_static_without_reuse(engine_model):
    """16 concurrent chats sharing a system prompt through the server on a paged cache (reuse on) give the tokens
    of the static cache with reuse off; /metrics counts the hits and the blocks in use (none once done); a
    request the pool could never hold is a 400 naming --kv-tokens."""
    import concurrent.futures as cf

    import httpx
    import openai

    from bitnetlm.engine.metrics import parse_metrics
    from bitnetlm.serve import start

    model, tok = engine_model
    words = "truth universally acknowledged single man possession good fortune want wife".split()
    system = " ".join(words[i % len(words)] for i in range(150))
    chats = [
        [{"role": "system", "content": system}, {"role": "user", "content": f"{words[i % 10]} {i}"}]
        for i in range(16)
    ]

    def run(**options):
        h = start(model, tok, port=0, max_batch=8, max_queue=64, log_level="warning", **options)
        try:
            c = openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=120)

            def one(msgs):
                r = c.chat.completions.create(model="bitnet", messages=msgs, max_tokens=6, temperature=0)
                return r.choices[0].message.content

            with cf.ThreadPoolExecutor(16) as ex:
                outs = list(ex.map(one, chats))
            big = httpx.post(
                h.url + "/v1/completions", json={"model": "bitnet", "prompt": system, "max_tokens": 100}
            )
            return outs, parse_metrics(httpx.get(h.url + "/metrics").text), big
        finally:
            h.stop()

    want, _, _ = run(prefix_caching=False)
    got, m, big = run(kv_tokens=240, kv_block_size=16, max_seq_len=256)  # one chat at a time
    assert got == want
    lab = '{model_name="bitnet"}'
    assert m[f"vllm:prefix_cache_hits_total{lab}"] >= 8 * 144 and m[f"vllm:kv_cache_usage_perc{lab}"] == 0
    assert big.status_code == 400 and "--kv-tokens" in big.text


# ---- the rows' bookkeeping with a trash block (as the CUDA runner keeps it) ------------------------------------
class _Rows(PagedRows):
    """PagedRows over real CPU pools, with the CUDA runner's conventions: a trash block past the pool's blocks,
    which every table entry that names none of a row's blocks holds, and new blocks not zeroed."""

    zero_new_blocks = False

    def __init__(self, rows=3, ctx=32, blocks=12, bs=4):
        self.k = [torch.zeros(blocks + 1, 2, bs, 8)]
        self.v = [torch.zeros(blocks + 1, 2, bs, 8)]
        self._init_rows(rows, ctx, blocks, bs, no_block=blocks)

    def write(self, row, start, tokens, prefill=True):
        self._reserve([(row, start, start + len(tokens))])
        self._written(row, start, tokens, prefill)
        for p, t in zip(range(start, start + len(tokens)), tokens, strict=True):
            b = self.blocks[row][p // self.pool.block_size]
            self.k[0][b, :, p % self.pool.block_size] = t
        if prefill:
            self._cache_blocks(row)

    def check(self):
        """Each row's table names its blocks, then the trash; the trash is in no row's keeping."""
        for r, have in enumerate(self.blocks):
            assert self.table[r, : len(have)].tolist() == have
            assert (self.table[r, len(have) :] == self.no_block).all()
            assert self.no_block not in have


def test_rows_tables_point_past_their_blocks_at_the_trash():
    """Appends, copy on write of a shared partial block, a rollback, a shared prefix, adoption from the prefix
    cache, a reset: every table names the row's blocks and then the trash; a shared block is never written; the
    step's tables put rows that hold no sequence wholly at the trash."""
    r = _Rows()
    r.write(0, 0, [5, 6, 7, 8, 9, 10])  # 2 blocks, the second half full
    r.check()
    r._share_prefix(0, 1, 6)  # row 1 shares both (the partial one too)
    assert r.blocks[1] == r.blocks[0] and r.pool.refs[r.blocks[0][1]] == 2
    kept = r.k[0][r.blocks[0][1]].clone()
    r.write(1, 6, [11], prefill=False)  # copy on write: row 1 gets its own second block
    assert r.blocks[1][1] != r.blocks[0][1] and torch.equal(r.k[0][r.blocks[0][1]], kept)
    assert (
        r.k[0][r.blocks[1][1], 0, 2, 0] == 11 and r.k[0][r.blocks[1][1], 0, 1, 0] == 10
    )  # copied, then written
    r.check()
    r._drop_from(1, 3)  # a rollback into the first (shared) block frees the second
    assert len(r.blocks[1]) == 1
    r.check()
    assert r.adopt(2, [5, 6, 7, 8, 1, 2]) == 4  # the cached full first block
    assert r.blocks[2] == r.blocks[0][:1]
    r.check()
    r._drop_from(0, 0)
    r._drop_from(1, 0)
    r._drop_from(2, 0)
    r.check()
    assert r.pool.in_use() == 0
    r.write(0, 0, [1, 2, 3, 4, 5])
    step = r.step_table(idle=[1, 2])
    assert (step[1:] == r.no_block).all() and step[0].tolist() == r.table[0].tolist()
    assert r.step_table() is r.table
