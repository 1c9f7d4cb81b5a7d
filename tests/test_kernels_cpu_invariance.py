"""Batch invariance of the CPU backend: a sequence's logits are bit-identical whether it decodes alone or among
other sequences at other positions (rows that joined earlier or later, rows that leave), in the fused C step and
in the per-projection path (the model's own layers over the C projections), and through the public APIs.

A row's logits once depended on the batch through the float LM head (torch's CPU GEMM picks its kernel, and with
it the summation order, by the number of rows: seen as greedy divergence after ~15 tokens in a busy server) and, in
batched prefills, through the left padding (the attention's sums were laid out from slot 0, not from the first
visible key).
"""

from __future__ import annotations

import threading

import pytest
import torch
from oracle import random_model

from bitnetlm.kernels import cpu, prepare
from bitnetlm.kernels.cpu import ops
from bitnetlm.quant import to_inference_
from bitnetlm.runtime.config import RuntimeConfig
from bitnetlm.runtime.cpu import CpuRunner

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not cpu.available(), reason="C kernels not built"),
]

MAX_LEN = 160


@pytest.fixture(scope="module")
def tiny():
    """The bundled bitnet-tiny: float32 tied head, relu2, GQA, sub-norms (fused C step)."""
    import bitnetlm

    model, tok = bitnetlm.load("bitnet-tiny")
    return model.eval(), tok


@pytest.fixture(scope="module")
def near_ties():
    """bitnet-tiny whose (tied) vocabulary rows come in pairs one float32 step apart: the two tokens of a pair get
    logits equal up to rounding, so any change in a row's summation order shows in its greedy tokens and in the
    order of a top-k, as real models' near-ties do now and then."""
    import bitnetlm

    model, tok = bitnetlm.load("bitnet-tiny")
    w = model.embed_tokens.weight.data
    g = torch.Generator().manual_seed(0)
    away = torch.where(torch.rand(w[1::2].shape, generator=g) < 0.5, torch.inf, -torch.inf)
    w[1::2] = torch.nextafter(w[0::2], away)
    return model.eval(), tok


@pytest.fixture(scope="module")
def silu():
    """A 1bitLLM-shaped model: silu, untied float32 head, no GQA (fused C step)."""
    return prepare(to_inference_(random_model("1bitllm", seed=3)).eval(), backend="cpu")


def _prompts(n: int, vocab: int, seed: int, longest: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, longest, (n,), generator=g)
    return [torch.randint(3, vocab, (int(k),), generator=g).tolist() for k in lens]


def alone(model, prompt, steps: int, rt: RuntimeConfig) -> list[torch.Tensor]:
    """Logits after the prompt and after each of `steps` greedy decode steps, the sequence alone."""
    r = CpuRunner(model, rt, 1, MAX_LEN)
    out = [r.prefill(0, prompt)]
    for s in range(steps):
        out.append(r.decode([0], [int(out[-1].argmax())], [len(prompt) + s])[0])
    return out


def in_batch(model, prompt, steps: int, rows: int, at: int, rt: RuntimeConfig, seed: int, behind=False):
    """The same sequence in row `at` of a runner whose other rows arrive at other steps (from 20 steps before it
    to the end), hold prompts of other lengths and leave after random lifetimes (freed rows are reused).
    behind: the other rows never hold more positions than it (their prompts start after it and are short)."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    r = CpuRunner(model, rt, rows, MAX_LEN)
    first = 0 if behind else -20
    arrivals = sorted(int(x) for x in torch.randint(first, steps, (3 * rows,), generator=g))
    others = _prompts(3 * rows, vocab, seed + 1, longest=3 if behind else 40)
    live: dict[int, list] = {}  # row -> [next token, position, steps left]
    got, nxt = [], 0
    for clock in range(first, steps + 1):
        if clock == 0:
            got.append(r.prefill(at, prompt))
            live[at] = [int(got[-1].argmax()), len(prompt), steps]
        while nxt < len(arrivals) and arrivals[nxt] <= clock:
            free = [i for i in range(rows) if i not in live and i != at]
            if free:
                row, p = free[int(torch.randint(len(free), (1,), generator=g))], others[nxt]
                r.reset(row)
                life = int(torch.randint(1, 30, (1,), generator=g))
                live[row] = [int(r.prefill(row, p).argmax()), len(p), life]
            nxt += 1
        rows_now = sorted(live)
        if not rows_now:
            continue
        logits = r.decode(rows_now, [live[i][0] for i in rows_now], [live[i][1] for i in rows_now])
        for j, i in enumerate(rows_now):
            if i == at:
                got.append(logits[j].clone())
            live[i][0], live[i][1], live[i][2] = int(logits[j].argmax()), live[i][1] + 1, live[i][2] - 1
            if live[i][2] <= 0 or live[i][1] >= MAX_LEN - 1:
                del live[i]
        if at not in live and clock >= 0:
            break
    return got


def _assert_same(ref: list[torch.Tensor], got: list[torch.Tensor], where: str):
    assert len(got) == len(ref), where
    for s, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a, b), f"{where}: step {s}, max |diff| {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("kv", ["auto", "bf16"])
def test_fused_step_rows_do_not_depend_on_the_batch(tiny, kv):
    model, _ = tiny
    rt = RuntimeConfig(kv_cache_dtype=kv)
    assert CpuRunner(model, rt, 1, 8).fused is not None
    prompt = _prompts(1, model.config.vocab_size, seed=5, longest=20)[0]
    ref = alone(model, prompt, 12, rt)
    for rows, at in ((2, 1), (5, 0), (17, 9), (33, 32)):
        got = in_batch(model, prompt, 12, rows, at, rt, seed=rows)
        _assert_same(ref, got, f"{rows} rows, row {at}")


def test_fused_step_silu_untied_head(silu):
    rt = RuntimeConfig()
    prompt = _prompts(1, silu.config.vocab_size, seed=6, longest=20)[0]
    ref = alone(silu, prompt, 10, rt)
    for rows, at in ((3, 1), (9, 8)):
        _assert_same(ref, in_batch(silu, prompt, 10, rows, at, rt, seed=rows), f"{rows} rows")


@pytest.fixture(scope="module")
def unfused(tiny):
    """bitnet-tiny run by its own torch layers over the C projections: the fused step refuses the model (its
    config names an activation the C step lacks; the layers still compute relu2)."""
    import bitnetlm

    model, _ = bitnetlm.load("bitnet-tiny")
    model.config.hidden_act = "gelu"
    assert CpuRunner(model, RuntimeConfig(), 1, 8).fused is None
    return model.eval()


def test_per_projection_path_rows_do_not_depend_on_the_batch(unfused):
    """The other rows never longer than the row under test: the float head alone decided the difference."""
    rt = RuntimeConfig()
    prompt = _prompts(1, unfused.config.vocab_size, seed=7, longest=20)[0] + [5] * 20
    ref = alone(unfused, prompt, 8, rt)
    for rows, at in ((2, 0), (9, 4), (33, 20)):
        got = in_batch(unfused, prompt, 8, rows, at, rt, seed=40 + rows, behind=True)
        _assert_same(ref, got, f"{rows} rows, row {at}")


def test_per_projection_path_rows_longer_than_it(unfused):
    rt = RuntimeConfig()
    prompt = _prompts(1, unfused.config.vocab_size, seed=7, longest=20)[0]
    ref = alone(unfused, prompt, 8, rt)
    for rows, at in ((2, 0), (9, 4)):
        _assert_same(ref, in_batch(unfused, prompt, 8, rows, at, rt, seed=40 + rows), f"{rows} rows")


# the AVX2 attention kernels where the CPU has them, the portable ones; the bf16 head: the attention alone decides
@pytest.mark.parametrize("head,isa", [(None, None), (None, "scalar"), ("bf16", None)])
def test_batched_prefill_does_not_depend_on_the_other_prompts(head, isa):
    """prefill_many left-pads prompts to the longest: each prompt's logits, and the decode steps from the cache
    rows it wrote, equal its own prefill's."""
    import bitnetlm

    model, _ = bitnetlm.load("bitnet-tiny", head_dtype=head)
    prompts = _prompts(6, model.config.vocab_size, seed=8)
    with cpu.use_isa(isa):
        _batched_prefill(model.eval(), RuntimeConfig(), prompts)


def _batched_prefill(model, rt, prompts):
    refs = [alone(model, p, 3, rt) for p in prompts]
    for group in (prompts[:2], prompts[1:4], prompts):
        r = CpuRunner(model, rt, len(group), MAX_LEN)
        first = r.prefill_many(list(range(len(group))), group)
        tokens = first.argmax(-1).tolist()
        got = [[first[i]] for i in range(len(group))]
        for s in range(3):
            logits = r.decode(list(range(len(group))), tokens, [len(p) + s for p in group])
            tokens = logits.argmax(-1).tolist()
            for i in range(len(group)):
                got[i].append(logits[i])
        for i, p in enumerate(group):
            _assert_same(refs[prompts.index(p)], got[i], f"prompt {i} of {len(group)}")


@pytest.mark.parametrize("isa", cpu.supported_isas() if cpu.available() else [])
def test_float_heads_rows_alone_equal_rows_in_a_batch(isa):
    """bn_gemm_f32 / bn_gemm_bf16 / bn_gemm_i8row: row i of an m-row call equals the same row alone, bit for bit,
    for every m; float32 also against float64."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(523, 300, generator=g)  # rows in blocks of 4 and 3 left over
    wb = w.bfloat16()
    q = torch.randint(-127, 128, (523, 300), generator=g, dtype=torch.int8)
    ws = torch.rand(523, generator=g) + 0.01
    x = torch.randn(33, 300, generator=g)
    heads = {
        "f32": lambda v: ops.gemm_float(v, w),
        "bf16": lambda v: ops.gemm_float(v, wb),
        "i8": lambda v: ops.gemm_i8row(v, q, ws),
    }
    with cpu.use_isa(isa):
        for name, head in heads.items():
            rows = [head(x[i : i + 1])[0] for i in range(33)]
            for m in (2, 3, 8, 17, 33):
                y = head(x[:m])
                for i in range(m):
                    assert torch.equal(y[i], rows[i]), (name, m, i)
        want = (x.double() @ w.double().T).float()
        torch.testing.assert_close(ops.gemm_float(x, w), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_batch_generate_equals_generate(near_ties):
    """The public API: prompts of different lengths in one batch_generate (one batched prefill, rows at other
    positions) give each prompt's `generate` tokens, greedy and seeded top-k sampling."""
    import bitnetlm
    from bitnetlm.generate import SamplingParams

    model, tok = near_ties
    texts = ["Once upon a time", "The", "A dog and a cat went to the market to buy", "Hello there, how"]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    sampled = [
        SamplingParams(max_tokens=24, temperature=0.8, top_k=40, seed=100 + i, ignore_eos=True)
        for i in range(4)
    ]
    for params in ([greedy] * 4, sampled):
        want = [bitnetlm.generate(model, tok, t, p).tokens for t, p in zip(texts, params)]
        got = bitnetlm.batch_generate(model, tok, texts, params)
        assert [r.tokens for r in got] == want


def test_server_requests_joining_a_running_batch(near_ties):
    """The serving engine: requests submitted while others decode (staggered arrivals) each get the tokens of
    `generate` alone."""
    import bitnetlm
    from bitnetlm.generate import SamplingParams
    from bitnetlm.serve.engine import Chunk, Engine, Failed, Finished, GenerationRequest

    model, tok = near_ties

    class Sink:
        def __init__(self):
            self.tokens, self.done = [], threading.Event()

        def __call__(self, ev):
            if isinstance(ev, Chunk):
                self.tokens.extend(ev.token_ids)
            if isinstance(ev, (Finished, Failed)):
                self.done.set()

    texts = ["Once upon a time there", "The", "A dog and a cat went", "Hello", "It was a dark and stormy"]
    params = [
        SamplingParams(
            max_tokens=40 - 4 * i, temperature=0.8 * (i % 2), top_k=40, seed=7 + i, ignore_eos=True
        )
        for i in range(len(texts))
    ]
    want = [bitnetlm.generate(model, tok, t, p).tokens for t, p in zip(texts, params)]
    eng = Engine(model, tok, runtime=RuntimeConfig(max_batch=4))
    try:
        sinks = []
        for i, (t, p) in enumerate(zip(texts, params)):
            if sinks:  # join while the earlier requests are decoding: wait until the last one made progress
                while len(sinks[-1].tokens) < 3 + i and not sinks[-1].done.is_set():
                    threading.Event().wait(0.002)
            sinks.append(Sink())
            eng.submit(GenerationRequest(tok.encode(t), p), sinks[-1])
        assert all(s.done.wait(120) for s in sinks)
    finally:
        eng.shutdown()
    assert [s.tokens for s in sinks] == want
