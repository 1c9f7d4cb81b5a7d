"""Structured output: a random-weights model whose only guide is the grammar writes JSON that validates against
20 schemas (offline, and through the official openai client on chat and completions, streamed and not), regexes
and choices; a grammar that allows everything changes nothing; what cannot be enforced is a 400 naming it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jsonschema
import openai
import pytest
import torch
from serve_parts import tiny_model_and_tokenizer, tiny_tokenizer
from structured_schemas import SCHEMAS

from bitnetlm.engine import grammar
from bitnetlm.engine.speculative import SpeculativeConfig
from bitnetlm.generate import SamplingParams, batch_generate, generate, stream_generate
from bitnetlm.sampling.sampler import EXCLUDED, apply_allowed
from bitnetlm.sampling.structured import StructuredOutput
from bitnetlm.serve import start

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def mt():
    return tiny_model_and_tokenizer(max_len=512)


@pytest.fixture(scope="module")
def server(mt):
    model, tok = mt
    h = start(model, tok, port=0, max_batch=8, max_queue=64, log_level="warning")
    yield h
    h.stop()


def _text(out) -> str:
    return out if isinstance(out, str) else out.text


def test_offline_outputs_validate_against_20_schemas(mt):
    model, tok = mt
    params = [
        SamplingParams(max_tokens=400, temperature=1.0, seed=i, structured={"json": s})
        for i, s in enumerate(SCHEMAS)
    ]
    outs = batch_generate(model, tok, ["Hello world"] * len(SCHEMAS), params)
    for schema, out in zip(SCHEMAS, outs, strict=True):
        jsonschema.validate(json.loads(_text(out)), schema)


def test_unconstrained_random_model_does_not_write_json(mt):
    """The control for the test above: the same requests without the grammar are not JSON."""
    model, tok = mt
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i) for i in range(4)]
    for out in batch_generate(model, tok, ["Hello world"] * 4, params):
        with pytest.raises(ValueError):
            json.loads(_text(out))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_that_allows_everything_changes_nothing(mt, temperature):
    model, tok = mt
    everything = StructuredOutput(grammar=f"start: <[0-{model.config.vocab_size - 1}]>*")
    n = 0
    for seed in range(4):
        p = SamplingParams(max_tokens=40, temperature=temperature, seed=seed)
        ref = generate(model, tok, "the quick brown fox", p)
        got = generate(
            model, tok, "the quick brown fox", SamplingParams(**{**vars(p), "structured": everything})
        )
        assert got.tokens == ref.tokens and _text(got) == _text(ref)
        n += len(ref.tokens)
    assert n > 40


def test_apply_allowed_removes_exactly_the_tokens_the_bitmask_excludes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 70, generator=g)
    allowed_ids = [5, 31, 32, 64, 69]
    words = torch.zeros(3, dtype=torch.int32)
    for t in allowed_ids:
        words[t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    y = x.clone()
    apply_allowed(y, [None, words, torch.full((3,), -1, dtype=torch.int32)])
    assert torch.equal(y[0], x[0]) and torch.equal(y[2], x[2])
    keep = torch.zeros(70, dtype=torch.bool)
    keep[allowed_ids] = True
    assert torch.equal(y[1][keep], x[1][keep]) and bool((y[1][~keep] == EXCLUDED).all())
    assert bool((torch.softmax(y[1], dim=-1)[~keep] == 0).all())


def test_masks_equal_llguidances_own_and_import_no_compiler():
    """The engine's masks are llguidance.torch's, computed without importing that module (its torch.compile
    decorator pulled in torch's compiler stack: seconds on a server's first constrained request)."""
    code = (
        "import sys; sys.path.insert(0, 'tests'); from serve_parts import tiny_tokenizer\n"
        "from bitnetlm.engine import grammar; from bitnetlm.sampling.structured import StructuredOutput\n"
        "tok = tiny_tokenizer(); so = StructuredOutput(json=True)\n"
        "c = grammar.Constraint(grammar.compile_grammar(so, tok, set(tok.eos_token_ids), tok.vocab_size))\n"
        "assert int(grammar.masks([c])[0].count_nonzero()) > 0\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'llguidance.torch') if m in sys.modules))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr[-2000:] + r.stdout
    import llguidance
    import llguidance.torch as llt

    tok = tiny_tokenizer()
    so = StructuredOutput(
        json={"type": "object", "properties": {"a": {"enum": ["x", "yz"]}}, "required": ["a"]}
    )
    compiled = grammar.compile_grammar(so, tok, set(tok.eos_token_ids), tok.vocab_size)
    ours, ref = grammar.Constraint(compiled), grammar.Constraint(compiled)
    for t in tok.encode('{"a": "yz"}', add_special_tokens=False):
        want = torch.zeros(2, ours.words, dtype=torch.int32)
        llt.fill_next_token_bitmask_par(llguidance.LLExecutor(), [(ref.matcher, 1)], want)
        [got] = grammar.masks([ours])
        assert torch.equal(got, want[1]) and (int(got[t // 32]) >> (t % 32)) & 1
        ours.consume(t)
        ref.consume(t)
    assert not ours.failed and ours.matcher.is_accepting()


def test_regex_choice_and_grammar_offline(mt):
    model, tok = mt
    for seed in range(3):
        p = SamplingParams(max_tokens=60, temperature=1.0, seed=seed)
        out = generate(
            model,
            tok,
            "Hello",
            SamplingParams(**{**vars(p), "structured": {"regex": r"[0-9]{3}-[a-z]{2,4}"}}),
        )
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", _text(out))
        choices = ["yes", "no", "maybe (later)"]
        out = generate(model, tok, "Hello", SamplingParams(**{**vars(p), "structured": {"choice": choices}}))
        assert _text(out) in choices
        gbnf = 'root ::= "(" [a-c]+ ")" | "x"'
        out = generate(model, tok, "Hello", SamplingParams(**{**vars(p), "structured": {"grammar": gbnf}}))
        assert re.fullmatch(r"\([a-c]+\)|x", _text(out))


def test_constrained_rows_do_not_draft_and_give_the_plain_output(mt):
    """Speculative decoding on: a constrained greedy request drafts nothing and gives the output it gives
    without speculation (an unconstrained one beside it does draft)."""
    model, tok = mt
    prompt = "Hello world Hello world Hello world"
    p = SamplingParams(max_tokens=200, temperature=0.0, structured={"json": SCHEMAS[15]})
    spec = SpeculativeConfig(lookup=2, num_tokens=4)
    ref = _text(generate(model, tok, prompt, p))
    chunks = list(stream_generate(model, tok, prompt, p, speculative=spec))
    got = "".join(c.text for c in chunks)
    assert got == ref and chunks[-1].draft_tokens == 0
    jsonschema.validate(json.loads(got), SCHEMAS[15])
    free = list(stream_generate(model, tok, prompt, max_tokens=60, temperature=0.0, speculative=spec))
    assert free[-1].draft_tokens > 0


def _ask(client, i: int, schema: dict) -> str:
    """Schema i through mode i % 4: chat or completions, streamed or not."""
    rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
    chat, stream = i % 2 == 0, i % 4 >= 2
    kw = dict(model="bitnet", max_tokens=400, temperature=1.0, seed=i, response_format=rf, stream=stream)
    if chat:
        r = client.chat.completions.create(messages=[{"role": "user", "content": "Give me JSON"}], **kw)
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in r if c.choices)
        return r.choices[0].message.content
    kw.pop("response_format")
    r = client.completions.create(prompt="Give me JSON", extra_body={"response_format": rf}, **kw)
    if stream:
        return "".join(c.choices[0].text for c in r if c.choices)
    return r.choices[0].text


def test_server_outputs_validate_against_20_schemas_chat_and_completions_streamed_or_not(client):
    for i, schema in enumerate(SCHEMAS):
        jsonschema.validate(json.loads(_ask(client, i, schema)), schema)


def test_server_vllm_extensions(client):
    msgs = [{"role": "user", "content": "pick"}]
    r = client.chat.completions.create(
        model="bitnet", messages=msgs, max_tokens=50, seed=1, extra_body={"guided_choice": ["alpha", "beta"]}
    )
    assert r.choices[0].message.content in ("alpha", "beta") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(
        model="bitnet", prompt="x", max_tokens=50, seed=2, extra_body={"guided_regex": "[a-f]{4}"}
    )
    assert re.fullmatch("[a-f]{4}", r.choices[0].text)
    r = client.completions.create(
        model="bitnet",
        prompt="x",
        max_tokens=50,
        seed=2,
        extra_body={"structured_outputs": {"regex": "[0-9]{2}"}},
    )
    assert re.fullmatch("[0-9]{2}", r.choices[0].text)
    r = client.completions.create(
        model="bitnet", prompt="x", max_tokens=200, seed=3, extra_body={"guided_json": json.dumps(SCHEMAS[5])}
    )
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS[5])


def test_server_json_object(mt, client):
    """Any JSON object: a bias towards '}' closes it at once, and the grammar makes '{' come first."""
    _, tok = mt
    close = tok.token_to_id("}")
    r = client.chat.completions.create(
        model="bitnet",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=50,
        response_format={"type": "json_object"},
        logit_bias={str(close): 100},
    )
    assert json.loads(r.choices[0].message.content) == {}


@pytest.mark.parametrize(
    "extra, names",
    [
        ({"guided_json": {"type": "object", "if": {"a": 1}, "then": {}}}, ['"if"', '"then"']),
        ({"guided_json": {"type": "string", "format": "hostnamex"}}, ["hostnamex"]),
        ({"guided_regex": "[a-"}, ["regex"]),
        ({"guided_json": "{not json"}, ["not valid JSON"]),
        ({"guided_regex": "a", "guided_choice": ["b"]}, ["'guided_regex'", "'guided_choice'"]),
        ({"response_format": {"type": "json_schema"}}, ["json_schema"]),
        ({"guided_choice": []}, ["choice"]),
    ],
)
def test_what_cannot_be_enforced_is_a_400_naming_it(client, extra, names):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="bitnet", prompt="x", max_tokens=5, extra_body=extra)
    msg = e.value.body["message"]
    assert "\n" not in msg and all(n in msg for n in names), msg


@pytest.mark.gpu
def test_cuda_runner_constrained_rows_beside_captured_ones(oracle_dirs):
    """On the CUDA runner: constrained rows (sampled by the host sampler) validate, unconstrained rows of the same
    batch give what they give alone (the captured sampler), and a grammar allowing everything changes nothing."""
    from serve_parts import tiny_tokenizer

    from bitnetlm.loading import load_model

    ours, _ = oracle_dirs["packed-autobitlinear"]
    model = load_model(ours, device="cuda", dtype=torch.float32).eval()
    tok = tiny_tokenizer()
    free = [SamplingParams(max_tokens=30, temperature=1.0, seed=i, ignore_eos=True) for i in range(2)]
    bound = [
        SamplingParams(max_tokens=300, temperature=1.0, seed=i, structured={"json": SCHEMAS[i]})
        for i in (5, 19)
    ]
    alone = [generate(model, tok, "Hello world", p).tokens for p in free]
    outs = batch_generate(model, tok, ["Hello world"] * 4, [free[0], bound[0], free[1], bound[1]])
    assert [outs[0].tokens, outs[2].tokens] == alone
    jsonschema.validate(json.loads(_text(outs[1])), SCHEMAS[5])
    jsonschema.validate(json.loads(_text(outs[3])), SCHEMAS[19])
    everything = StructuredOutput(grammar=f"start: <[0-{model.config.vocab_size - 1}]>*")
    p = SamplingParams(max_tokens=30, temperature=0.0)
    ref = generate(model, tok, "the quick brown fox", p)
    got = generate(model, tok, "the quick brown fox", SamplingParams(**{**vars(p), "structured": everything}))
    assert got.tokens == ref.tokens
