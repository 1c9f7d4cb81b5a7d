"""Sliding-window layers on a ring of their window: a local layer's KV keeps `window + RING_SLACK` positions per
row, whatever the context, and the model computes exactly what transformers computes past the window (several
times round the ring): chunked prefill (chunks longer than the ring too), batched rows at different positions,
speculative verification and its rollback, prefix reuse while the ring still holds the window it needs."""

from __future__ import annotations

import pytest
import torch
from oracle import byte_level_bpe
from oracle_families import make_checkpoint, oracle_model

import bitnetlm
from bitnetlm.engine.core import EngineCore
from bitnetlm.engine.metrics import Metrics
from bitnetlm.engine.scheduler import ContextShift, Scheduler, SchedulerConfig
from bitnetlm.engine.sequence import GenerationRequest, Group, Sequence, Token
from bitnetlm.engine.speculative import SpeculativeConfig
from bitnetlm.models.cache import RING_SLACK, Ring
from bitnetlm.runtime import RuntimeConfig, make_runner, runner_for
from bitnetlm.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

W = 8  # the window: a ring of W + RING_SLACK slots, which 100 positions go round four times
QWEN3_LAYERS = ["sliding_attention", "full_attention"]
# an untied head: a tied one over the tiny models' N(0, 1) embeddings mostly repeats the last token, which would
# not show whether the window is right
OVERRIDES = {
    "gemma3": dict(sliding_window=W, tie_word_embeddings=False),
    "qwen3": dict(
        use_sliding_window=True, sliding_window=W, layer_types=QWEN3_LAYERS, tie_word_embeddings=False
    ),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """family -> a windowed checkpoint written by transformers (full precision), with a byte-level BPE tokenizer."""
    base = tmp_path_factory.mktemp("ring")
    tok = byte_level_bpe()
    out = {}
    for i, (family, kw) in enumerate(OVERRIDES.items()):
        d = make_checkpoint(base / family, family, "fp", seed=700 + i, **kw)
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
        out[family] = d
    return out


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def _runner(model, rows: int = 2, ctx: int = 128):
    return make_runner(model, RuntimeConfig(), rows, ctx)


def test_ring_holds_the_window_and_memory_grows_with_global_layers(dirs):
    """Gemma 3's local layers hold W + RING_SLACK positions a row, its global layer the whole context: a row's
    bytes grow with the global layers only."""
    model, _ = bitnetlm.load(dirs["gemma3"], backend="reference")
    cfg = model.config
    sliding = [cfg.is_sliding(i) for i in range(cfg.num_hidden_layers)]
    assert sliding == [True, False, True]
    per_pos = 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # k and v, float32
    for ctx in (128, 1024):
        cache = model.new_cache(2, ctx)
        assert cache.ring == Ring(W, W + RING_SLACK)
        assert [k.shape[2] for k in cache.k] == [W + RING_SLACK, ctx, W + RING_SLACK]
        assert cache.nbytes() == 2 * per_pos * (ctx + 2 * (W + RING_SLACK))
        assert model.new_cache(2, ctx, rings=False).nbytes() == 2 * per_pos * 3 * ctx
    # a context no longer than the ring keeps every layer whole (and masks the window by position)
    assert model.new_cache(1, W + RING_SLACK).ring is None


@pytest.mark.parametrize("family", list(OVERRIDES))
def test_generation_past_the_window_equals_transformers(dirs, family):
    """Greedy generation round the ring four times equals transformers' own, alone and with other rows at other
    positions in the batch (prompts prefilled together, left-padded, then moved into their rings)."""
    ref = oracle_model(dirs[family])
    model, tok = bitnetlm.load(dirs[family])  # the CPU runner (the model's own layers: no fused step)
    prompts = [_ids(n, seed=n) for n in (12, 3, 29)]
    want = []
    with torch.no_grad():
        for p in prompts:
            out = ref.generate(torch.tensor([p]), max_new_tokens=90, min_new_tokens=90, do_sample=False)
            want.append(out[0, len(p) :].tolist())
    kw = dict(max_tokens=90, temperature=0, ignore_eos=True)
    assert bitnetlm.generate(model, tok, prompts[0], **kw).tokens == want[0]
    assert [r.tokens for r in bitnetlm.batch_generate(model, tok, prompts, **kw)] == want
    assert len(set(want[0])) > 30  # (tokens that depend on their context)
    assert runner_for(model, None, 3, 29 + 90).ring == Ring(W, W + RING_SLACK)  # (the runner generate used)


@pytest.mark.parametrize("family", list(OVERRIDES))
def test_chunks_longer_than_the_ring_and_decode_match_transformers(dirs, family):
    """Logits of a forward cut into chunks shorter than the slack (written, then attended), longer than it (the
    ring as it was, then the chunk) and longer than the whole ring, then one-token steps: transformers' own."""
    ref = oracle_model(dirs[family])
    model, _ = bitnetlm.load(dirs[family], backend="reference")
    ids = torch.tensor([_ids(100, seed=1)])
    cuts = [0, 5, 17, 20, 50, 59, *range(60, 101)]  # chunks of 5, 12, 3, 30, 9, then 1s
    with torch.no_grad():
        want = ref(ids).logits
        cache = model.new_cache(1, 128)
        assert cache.ring is not None
        got = [
            model(ids[:, a:b], positions=torch.arange(a, b)[None], cache=cache)
            for a, b in zip(cuts, cuts[1:], strict=False)
        ]
    torch.testing.assert_close(torch.cat(got, 1), want, atol=1e-4, rtol=0)


def test_float8_rings_equal_whole_float8_layers(dirs):
    """A float8 ring (bytes scattered; a long chunk's keys rounded through float8 as if stored) computes what
    whole float8 layers masked by position compute."""
    model, _ = bitnetlm.load(dirs["gemma3"], backend="reference")
    ids = torch.tensor([_ids(100, seed=1)])
    cuts = [0, 5, 17, 20, 50, 59, *range(60, 101)]
    out = []
    for rings in (True, False):
        cache = model.new_cache(1, 128, dtype=torch.float8_e4m3fn, rings=rings)
        assert (cache.ring is not None) == rings
        with torch.no_grad():
            steps = [
                model(ids[:, a:b], positions=torch.arange(a, b)[None], cache=cache)
                for a, b in zip(cuts, cuts[1:])
            ]
        out.append(torch.cat(steps, 1))
    torch.testing.assert_close(out[0], out[1], atol=1e-5, rtol=0)


def test_rollback_after_the_ring_wrapped(dirs):
    """A verify of slack + 1 tokens after the ring wrapped, most of it rejected: the rolled-back positions are
    gone (the same tokens at those positions afterwards, or others, compute what a run without the draft
    computes) and the window the row continues from is still there."""
    model, _ = bitnetlm.load(dirs["gemma3"], backend="reference")
    ring = model.new_cache(1, 128).ring
    toks = _ids(70, seed=2)
    junk = _ids(ring.slack, seed=3)
    spec, plain = _runner(model, rows=1), _runner(model, rows=1)
    for r in (spec, plain):
        r.prefill(0, toks[:40])
    spec.verify(0, [toks[40], *junk], 40)  # writes positions 40..40+slack: the ring wraps again
    spec.truncate(0, 42)  # one draft token "accepted": position 41 holds junk[0]
    plain.verify(0, [toks[40], junk[0]], 40)
    a = [spec.decode([0], [t], [p]) for p, t in enumerate(toks[42:], start=42)]
    b = [plain.decode([0], [t], [p]) for p, t in enumerate(toks[42:], start=42)]
    torch.testing.assert_close(torch.stack(a), torch.stack(b), atol=1e-5, rtol=0)


def test_speculative_decoding_after_wraps_equals_plain_greedy(dirs):
    """Prompt lookup on a repetitive prompt, then a draft model (drafts longer than the slack asked for: capped),
    90 tokens round the ring: the tokens of plain greedy decoding (and transformers'), drafts rejected on the way."""
    ref = oracle_model(dirs["qwen3"])
    model, tok = bitnetlm.load(dirs["qwen3"])
    prompt = _ids(6, seed=1) * 4
    kw = dict(max_tokens=90, temperature=0, ignore_eos=True)
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=90, min_new_tokens=90, do_sample=False)
    sp = SpeculativeConfig(num_tokens=32, lookup=3)
    got = bitnetlm.generate(model, tok, prompt, speculative=sp, **kw)
    assert got.tokens == want[0, len(prompt) :].tolist()
    assert got.draft_tokens > got.accepted_tokens > 0
    # a draft model with rings of its own (Gemma 3's): its rows roll back too
    draft, _ = bitnetlm.load(dirs["gemma3"])
    got = bitnetlm.generate(
        model, tok, prompt, speculative=SpeculativeConfig(num_tokens=32, draft=draft), **kw
    )
    assert got.tokens == want[0, len(prompt) :].tolist()
    assert got.draft_tokens > got.accepted_tokens


def _run(core: EngineCore, prompt: list[int], n: int) -> list[int]:
    events: list = []
    core.add(
        GenerationRequest(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)), events.append
    )
    while core.has_work():
        core.step()
    return [e.token for e in events if isinstance(e, Token)]


def test_prefix_reuse_only_while_the_ring_holds_the_window(dirs):
    """A row that ended soon after its prompt still holds the window before a shared prefix's end: a new prompt
    reuses it; one that went on round the ring does not (its keys there are overwritten). Either way the tokens
    are those of the same requests with reuse off."""
    model, tok = bitnetlm.load(dirs["gemma3"])
    system = _ids(30, seed=5)

    def serve(reuse: bool):
        m = Metrics("bitnet")
        core = EngineCore(_runner(model, rows=1), tok, prefill_chunk=512, metrics=m, prefix_reuse=reuse)
        out = [_run(core, system + _ids(3, seed=6), 2)]
        out.append(_run(core, system + _ids(4, seed=7), 60))  # reuses the 30 tokens, then goes round the ring
        hits = m.counters["prefix_cache_hits_total"]
        out.append(_run(core, system + _ids(5, seed=8), 5))  # the ring no longer holds them
        return out, hits, m.counters["prefix_cache_hits_total"] - hits

    on, hits, late = serve(True)
    off, _, _ = serve(False)
    assert on == off
    assert (hits, late) == (30, 0)


def test_scheduler_reuses_what_the_ring_keeps():
    """The pure rule: prefix n of a row written up to `written` is kept while written - size <= n - W + 1."""
    ring = Ring(8, 24)
    assert ring.slack == 17
    assert ring.keeps(24, 1) and ring.keeps(40, 23) and not ring.keeps(41, 23)
    system = list(range(100, 140))
    sch = Scheduler(SchedulerConfig(rows=1, prefill_chunk=512, ring=ring))
    g = Group(GenerationRequest([*system, 1], SamplingParams(max_tokens=4)), print)
    a = g.seqs = [Sequence(g, 0, None, set(), None)]
    sch.add(a[0])
    sch.schedule()
    a[0].written = 41 + ring.slack  # a verify wrote this far
    sch.finish(a[0])
    g2 = Group(GenerationRequest([*system, 2], SamplingParams(max_tokens=4)), print)
    g2.seqs = [Sequence(g2, 0, None, set(), None)]
    sch.add(g2.seqs[0])
    assert sch.schedule().reused == {}  # 40 - W + 1 = 33 < 58 - 24
    # a row reused while its ring keeps the window takes over what the ring lost (its source's writes)
    sch = Scheduler(SchedulerConfig(rows=1, prefill_chunk=512, ring=ring))
    g3 = Group(GenerationRequest([*system, 3], SamplingParams(max_tokens=4)), print)
    g3.seqs = [Sequence(g3, 0, None, set(), None)]
    sch.add(g3.seqs[0])
    sch.schedule()
    g3.seqs[0].written = 50
    sch.finish(g3.seqs[0])
    g4 = Group(GenerationRequest([*system, 4], SamplingParams(max_tokens=4)), print)
    b = g4.seqs = [Sequence(g4, 0, None, set(), None)]
    sch.add(b[0])
    assert sch.schedule().reused == {id(b[0]): (0, 40)} and b[0].written == 50


def _shifted(model, tok, prompt: list[int], keep: int, ring: Ring | None) -> list[int]:
    """150 greedy tokens in a 64-position context with context shift (the drops that `ring` allows), on a
    runner with rings, or (ring None) the same shifts over a cache without them."""
    runner = _runner(model, rows=1, ctx=64)
    rings = runner.ring
    if ring is None:
        runner.cache, runner.ring = model.new_cache(1, 64, rings=False), None
    core = EngineCore(runner, tok, context=64, context_shift=ContextShift(keep))
    core.scheduler.config.ring = rings  # (the same drops both ways)
    return _run(core, prompt, 150)


@pytest.mark.parametrize("window,keep", [(W, 4), (24, 20)])
def test_context_shift_on_rings_equals_the_shift_without_them(tmp_path, window, keep):
    """Qwen3's one RoPE base re-rotates a ring's moved keys as it does a whole row's: generation past a
    64-position context (several shifts) gives the tokens of the same shifts over a cache without rings. A window
    longer than the slack, which after half the row goes would reach kept positions the ring has overwritten,
    drops only the slack (dropping more is refused in one line)."""
    path = make_checkpoint(
        tmp_path, "qwen3", "fp", seed=10, **{**OVERRIDES["qwen3"], "sliding_window": window}
    )
    byte_level_bpe().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    model, tok = bitnetlm.load(path)
    ring = model.new_cache(1, 64).ring
    assert ring == Ring(window, window + RING_SLACK)
    drop = (64 - keep) // 2
    assert ring.shift_drop(64, keep, drop) == (drop if window == W else ring.slack)
    # the row right after one shift: the logits of the next tokens (whose window holds moved keys) agree
    runners = [_runner(model, rows=1, ctx=64) for _ in range(2)]
    runners[1].cache = model.new_cache(1, 64, rings=False)
    toks = _ids(64 + 12, seed=13)
    step = ring.shift_drop(64, keep, drop)
    logits = []
    for r in runners:
        r.prefill(0, toks[:64])
        r.shift(0, keep, step)
        logits.append(
            torch.stack([r.decode([0], [t], [p]) for p, t in enumerate(toks[64:], start=64 - step)])
        )
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)
    prompt = _ids(24, seed=11)
    got = _shifted(model, tok, prompt, keep, ring)
    assert got == _shifted(model, tok, prompt, keep, None) and len(got) == 150
    if window != W:
        runner = _runner(model, rows=1, ctx=64)
        runner.prefill(0, _ids(64, seed=12))
        with pytest.raises(ValueError, match="context shift: dropping 22 .* rings no longer hold"):
            runner.shift(0, keep, drop)
