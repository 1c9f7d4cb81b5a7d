"""`bitnet serve` through the official openai client against a real server on a free port.

Oracle: offline `bitnetlm.generate` on the same model (greedy and seeded sampling must match it exactly,
also under 32 concurrent requests that join and leave the running batch).
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest
from serve_parts import tiny_model_and_tokenizer

from bitnetlm.engine.metrics import parse_metrics
from bitnetlm.generate import SamplingParams, generate
from bitnetlm.serve import start

WORDS = (
    "the quick brown fox jumps over lazy dog truth universally acknowledged single man fortune wife".split()
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def mt():
    return tiny_model_and_tokenizer(max_len=256)


@pytest.fixture(scope="module")
def server(mt):
    model, tok = mt
    h = start(model, tok, port=0, max_batch=8, max_queue=64, log_level="warning")
    yield h
    h.stop()


def _prompt(rng):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 24)))


def test_completion_greedy_equals_offline_with_logprobs(mt, client):
    model, tok = mt
    ref = generate(model, tok, "Hello world", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    r = client.completions.create(
        model="bitnet",
        prompt="Hello world",
        max_tokens=12,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    c = r.choices[0]
    assert c.text == str(ref)
    assert c.finish_reason == "length"
    assert c.logprobs.tokens == [tok.decode([t]) for t in ref.tokens]
    assert c.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert all(1 <= len(d) <= 3 for d in c.logprobs.top_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(
        max(d.values()) == pytest.approx(lp, abs=1e-6) for d, lp in zip(c.logprobs.top_logprobs, ref.logprobs)
    )
    assert r.usage.prompt_tokens == len(tok.encode("Hello world"))
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_stream_equals_nonstream_and_offline(mt, client):
    model, tok = mt
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the fox."}]
    ref = generate(model, tok, msgs, SamplingParams(max_tokens=16, temperature=0))
    r = client.chat.completions.create(model="bitnet", messages=msgs, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == str(ref)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(tok.apply_chat_template(msgs, tokenize=True))
    assert r.usage.completion_tokens == len(ref.tokens)
    stream = client.chat.completions.create(
        model="bitnet",
        messages=msgs,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == str(ref)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        ref.finish_reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.tokens)
    assert all(c.usage is None for c in chunks[:-1])


def test_n_choices_with_seed_match_offline(mt, client):
    model, tok = mt
    kw = dict(temperature=0.9, top_p=0.95, top_k=40, min_p=0.01, max_tokens=10, ignore_eos=True)
    refs = [generate(model, tok, "The fox", SamplingParams(seed=7 + i, **kw)) for i in range(3)]
    r = client.completions.create(
        model="bitnet",
        prompt="The fox",
        n=3,
        seed=7,
        max_tokens=10,
        temperature=0.9,
        top_p=0.95,
        extra_body={"top_k": 40, "min_p": 0.01, "ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [str(x) for x in refs]
    assert r.usage.completion_tokens == 30
    assert len({c.text for c in r.choices}) > 1  # different seeds, different samples


def test_penalties_and_logit_bias_match_offline(mt, client):
    model, tok = mt
    kw = dict(
        presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.3, max_tokens=12, ignore_eos=True
    )
    ref = generate(model, tok, "lazy dog", SamplingParams(temperature=0, **kw))
    r = client.completions.create(
        model="bitnet",
        prompt="lazy dog",
        temperature=0,
        max_tokens=12,
        presence_penalty=0.5,
        frequency_penalty=0.7,
        extra_body={"repetition_penalty": 1.3, "ignore_eos": True},
    )
    assert r.choices[0].text == str(ref)
    forced = tok.encode(" fortune", add_special_tokens=False)[0]
    r = client.completions.create(
        model="bitnet", prompt="lazy dog", temperature=0, max_tokens=3, logit_bias={str(forced): 100}
    )
    assert r.choices[0].text == tok.decode([forced] * 3)


def test_stop_strings_and_stop_token_ids(mt, client):
    model, tok = mt
    ref = generate(model, tok, "single man", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    text = str(ref)
    stop = text[5:8]
    cut = text[: text.find(stop)]
    r = client.completions.create(
        model="bitnet",
        prompt="single man",
        temperature=0,
        max_tokens=20,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    # streamed: the stop string is never shown, even partially
    s = client.completions.create(
        model="bitnet",
        prompt="single man",
        temperature=0,
        max_tokens=20,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in s if c.choices) == cut
    tid = ref.tokens[4]
    first = ref.tokens.index(tid)
    r = client.completions.create(
        model="bitnet",
        prompt="single man",
        temperature=0,
        max_tokens=20,
        extra_body={"stop_token_ids": [tid], "ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == first + 1
    assert r.choices[0].text == tok.decode(ref.tokens[:first], skip_special_tokens=True)


def test_32_concurrent_greedy_requests_equal_offline(mt, server):
    model, tok = mt
    rng = random.Random(1)
    prompts = [_prompt(rng) for _ in range(32)]
    lens = [rng.randint(4, 20) for _ in range(32)]
    refs = [
        generate(model, tok, p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        for p, n in zip(prompts, lens)
    ]
    steps0 = server.engine.steps

    async def go():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
        return await asyncio.gather(
            *[
                c.completions.create(
                    model="bitnet",
                    prompt=p,
                    max_tokens=n,
                    temperature=0,
                    logprobs=0,
                    extra_body={"ignore_eos": True},
                )
                for p, n in zip(prompts, lens)
            ]
        )

    outs = asyncio.run(go())
    for r, ref in zip(outs, refs):
        assert r.choices[0].logprobs.tokens == [tok.decode([t]) for t in ref.tokens]
        assert r.choices[0].text == str(ref)
    # 8 rows for 32 requests: they must have shared decode steps (continuous batching), not run one by one
    assert server.engine.steps - steps0 < sum(lens) / 3
    assert server.engine.batched_prefills > 0  # prompts that arrived together were prefilled together


def test_errors_are_openai_style(mt, client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model="bitnet", prompt="x", extra_body={"frobnicate": 1, "best_of": 1, "zz": 0}
        )
    assert e.value.status_code == 400
    assert e.value.body["code"] == "unsupported_parameter"
    assert "'frobnicate'" in e.value.body["message"] and "'zz'" in e.value.body["message"]
    assert e.value.body["param"] == "frobnicate"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="bitnet",
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        )
    assert e.value.body["param"] == "tool_choice" and "'g'" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="bitnet", prompt="x", stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="bitnet", prompt="x", temperature=3)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="bitnet", prompt="fox " * 100, max_tokens=200)
    assert e.value.body["code"] == "context_length_exceeded" and "256" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x")
    assert e.value.body["code"] == "model_not_found"
    r = httpx.post(server.url + "/v1/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/completions", content=b"x" * (2 << 20))
    assert r.status_code == 413
    assert httpx.get(server.url + "/v1/nope").json()["error"]["type"] == "not_found_error"


def test_models_tokenize_detokenize_health_metrics(mt, client, server):
    _, tok = mt
    assert [m.id for m in client.models.list()] == ["bitnet"]
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + "/tokenize", json={"messages": msgs}).json()
    assert r["tokens"] == tok.apply_chat_template(msgs, tokenize=True)
    r = httpx.post(
        server.url + "/detokenize", json={"tokens": tok.encode("Hello world", add_special_tokens=False)}
    )
    assert r.json() == {"prompt": "Hello world"}
    assert httpx.post(server.url + "/detokenize", json={"tokens": [10**6]}).status_code == 400
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    client.completions.create(model="bitnet", prompt="Hello", max_tokens=2)  # counted whatever ran before
    m = parse_metrics(httpx.get(server.url + "/metrics").text)
    lab = '{model_name="bitnet"}'
    assert m[f"vllm:num_requests_running{lab}"] == 0 and m[f"vllm:num_requests_waiting{lab}"] == 0
    assert m[f"vllm:prompt_tokens_total{lab}"] > 0 and m[f"vllm:generation_tokens_total{lab}"] > 0
    n = m[f"vllm:time_to_first_token_seconds_count{lab}"]
    assert n > 0 and m['vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="bitnet"}'] == n
    assert m[f"vllm:e2e_request_latency_seconds_count{lab}"] == n
    assert m[f"vllm:inter_token_latency_seconds_count{lab}"] > 0


def test_process_gauges_match_prometheus_client(server):
    """/metrics carries the process_* gauges as prometheus_client writes them (same names, types, values)."""
    from prometheus_client import ProcessCollector, generate_latest
    from prometheus_client.registry import CollectorRegistry

    reg = CollectorRegistry()
    ProcessCollector(registry=reg)
    before = parse_metrics(generate_latest(reg).decode())
    text = httpx.get(server.url + "/metrics").text
    after = parse_metrics(generate_latest(reg).decode())
    ours = parse_metrics(text)
    assert {k for k in ours if k.startswith("process_")} == set(before)
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total"):
        assert f"# TYPE {name} {'counter' if name.endswith('_total') else 'gauge'}" in text
    for name in ("process_start_time_seconds", "process_max_fds"):
        assert ours[name] == pytest.approx(before[name], abs=0.02)
    for name in (
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
    ):
        lo, hi = sorted((before[name], after[name]))
        assert 0.8 * lo <= ours[name] <= 1.2 * hi + 0.05, name


def test_api_key_protects_everything_but_health(mt):
    model, tok = mt
    with start(model, tok, port=0, api_key="s3cret", log_level="warning") as h:
        assert httpx.get(h.url + "/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            r = httpx.get(h.url + path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(h.url + "/tokenize", json={"prompt": "x"}).status_code == 401
        assert httpx.get(h.url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=h.url + "/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=h.url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(model="bitnet", prompt="x", max_tokens=2).usage.completion_tokens >= 1
        assert httpx.get(h.url + "/metrics", headers={"X-API-Key": "s3cret"}).status_code == 200
        # CORS is off by default: no Access-Control-Allow-Origin header
        r = httpx.get(h.url + "/health", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in r.headers


def test_prompt_batch_and_n_streaming(mt, client):
    model, tok = mt
    prompts = ["the lazy dog", "a single man in possession"]
    refs = [
        generate(model, tok, p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)) for p in prompts
    ]
    r = client.completions.create(
        model="bitnet", prompt=prompts, n=2, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [str(refs[0])] * 2 + [str(refs[1])] * 2
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == 4 * 6
    s = client.chat.completions.create(
        model="bitnet", messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=5, stream=True, seed=3
    )
    texts = {}
    finished = set()
    for ch in s:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2}
    ref = generate(model, tok, [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=5, seed=3))
    assert texts[0] == str(ref)


def test_health_is_503_while_loading(mt):
    import threading

    model, tok = mt
    gate = threading.Event()

    def loader():
        gate.wait(60)
        return model, tok

    from bitnetlm.serve.app import ServerConfig
    from bitnetlm.serve.server import start_server

    h = start_server(ServerConfig(port=0, log_level="warning"), loader=loader)
    try:
        r = httpx.get(h.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = httpx.get(h.url + "/v1/models")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        gate.set()
        for _ in range(500):
            if httpx.get(h.url + "/health").status_code == 200:
                break
            time.sleep(0.02)
        assert httpx.get(h.url + "/health").json() == {"status": "ok"}
        assert httpx.get(h.url + "/v1/models").status_code == 200
    finally:
        h.stop()


def test_real_llama3_tokenizer_chat_and_stream_match_offline():
    """The LLaMA-3 tokenizer (128,256 ids, byte-level BPE, the real chat template) through the whole server."""
    from assets import asset
    from serve_parts import tiny_model

    from bitnetlm.generate import Tokenizer

    tok = Tokenizer.from_dir(asset("llama3-tokenizer"))
    model = tiny_model(tok.vocab_size, max_len=128, seed=3)
    msgs = [{"role": "user", "content": "Grüße! Wie geht's? 你好 🙂"}]
    ref = generate(model, tok, msgs, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert len(str(ref)) > 40 and any(ord(ch) > 127 for ch in str(ref))  # multi-byte text streams through
    with start(model, tok, port=0, model_name="llama3-tiny", log_level="warning") as h:
        c = openai.OpenAI(base_url=h.url + "/v1", api_key="x", max_retries=0, timeout=120)
        kw = dict(
            model="llama3-tiny", messages=msgs, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
        r = c.chat.completions.create(**kw)
        assert r.choices[0].message.content == str(ref)
        assert r.usage.prompt_tokens == len(tok.apply_chat_template(msgs, tokenize=True))
        streamed = "".join(
            ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **kw)
        )
        assert streamed == str(ref)
        t = httpx.post(h.url + "/tokenize", json={"prompt": "Hello world"}).json()
        assert t["tokens"] == [128000, 9906, 1917]


def test_cors_only_for_given_origins(mt):
    model, tok = mt
    with start(model, tok, port=0, api_key="k", cors_origins=["http://ok.example"], log_level="warning") as h:
        pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        r = httpx.options(h.url + "/v1/chat/completions", headers={"Origin": "http://ok.example", **pre})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ok.example"
        r = httpx.options(h.url + "/v1/chat/completions", headers={"Origin": "http://evil.example", **pre})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = httpx.get(
            h.url + "/v1/models", headers={"Origin": "http://ok.example", "Authorization": "Bearer k"}
        )
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ok.example"


def test_a_stream_event_is_one_line_for_line_splitting_clients():
    """A token's text may hold U+0085, U+2028 or U+2029, which JSON leaves raw and str.splitlines (httpx's
    aiter_lines, which many SSE clients read with) breaks lines at: each event must stay one data line."""
    import json

    from bitnetlm.serve.relay import sse as _sse

    obj = {"choices": [{"text": "a\u2028b\x85c\u2029d\ne\x1c f\u00e9"}]}
    ev = _sse(obj)
    lines = ev.splitlines()
    assert lines[0].startswith("data: ") and lines[1:] == [""] and ev.endswith("\n\n")
    assert json.loads(lines[0][len("data: ") :]) == obj
    assert "\u00e9" in lines[0]  # other non-ASCII text stays raw
