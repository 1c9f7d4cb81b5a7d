"""Bad input to a live server is a 400 naming what is wrong, never a 500, a hang or a traceback in the log:
lone surrogates, deep nesting, a client gone mid-upload, seeds out of range, booleans for integers, 405 with
Allow, and requests that can never fit beside the queue."""

from __future__ import annotations

import json
import socket
import time
import typing

import httpx
import pytest
from serve_log import ServerLog
from serve_parts import tiny_model_and_tokenizer

from bitnetlm.generate import SamplingParams, generate
from bitnetlm.serve import protocol as P
from bitnetlm.serve import start

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def mt():
    return tiny_model_and_tokenizer(max_len=256)


@pytest.fixture(scope="module")
def server(mt):
    model, tok = mt
    h = start(model, tok, port=0, max_batch=2, max_queue=1, log_level="info")
    yield h
    h.stop()


def _post(url, path, raw: bytes) -> httpx.Response:
    return httpx.post(url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=60)


def _bad(r: httpx.Response, param: str | None, *words: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert all(w in err["message"] for w in words), err
    return err


def test_a_lone_surrogate_in_a_prompt_or_a_parameter_name_is_a_400_naming_it(server):
    with ServerLog() as log:
        for path, raw, param in [
            ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
            ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt.1"),
            ("/tokenize", b'{"prompt": "x\\udc80"}', "prompt"),
            (
                "/v1/chat/completions",
                b'{"messages": [{"role": "user", "content": "hi \\ud83d"}], "max_tokens": 2}',
                "messages.0.content",
            ),
            ("/v1/completions", b'{"prompt": "ab", "\\ud800": 1}', "\\ud800"),
            ("/v1/completions", b'{"prompt": "ab", "logit_bias": {"\\ud800": 1}}', "logit_bias.\\ud800"),
        ]:
            _bad(_post(server.url, path, raw), param, "lone surrogate")
        # a surrogate pair is one character, and fine
        r = _post(server.url, "/tokenize", b'{"prompt": "\\ud83d\\ude00"}')
        assert r.status_code == 200 and r.json()["count"] >= 1
    assert log.problems() == []


def test_json_nested_deeper_than_the_limit_is_a_400_naming_the_limit(server):
    for depth in (65, 100, 20000):  # 20000: past the interpreter's recursion limit
        raw = b'{"prompt": "x", "stop": ' + b"[" * depth + b"]" * depth + b"}"
        _bad(_post(server.url, "/v1/completions", raw), None, "64 levels")
    raw = b'{"prompt": "x", "logit_bias": ' + b'{"a": ' * 70 + b"1" + b"}" * 71
    _bad(_post(server.url, "/v1/completions", raw), None, "64 levels")
    # at the limit, the body is parsed (and then refused by the schema, naming the field)
    raw = b'{"prompt": "x", "stop": ' + b"[" * 63 + b"]" * 63 + b"}"
    _bad(_post(server.url, "/v1/completions", raw), "stop.str")
    # NaN and Infinity are not JSON
    _bad(_post(server.url, "/v1/completions", b'{"prompt": "x", "temperature": NaN}'), None, "NaN")


def test_a_client_aborting_its_upload_is_one_log_line(server):
    with ServerLog() as log:
        s = socket.create_connection((server.host, server.port))
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": "the fox'
        )
        time.sleep(0.2)
        s.close()
        deadline = time.monotonic() + 30
        while not log.records and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # anything else it would log
    assert log.problems() == []
    assert len(log.records) == 1, log.lines()
    assert "went away after 19 bytes" in log.lines()[0] and "/v1/completions" in log.lines()[0]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_a_seed_out_of_torch_range_is_a_400_naming_seed(mt, server):
    lo, hi = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
    for seed, n in [(hi + 1, 1), (lo - 1, 1), (10**30, 1), (hi, 2)]:
        body = {"prompt": "x", "max_tokens": 2, "seed": seed, "n": n}
        _bad(httpx.post(server.url + "/v1/completions", json=body, timeout=60), "seed", str(seed))
    # both ends of the range work, and the server still serves (the engine thread survived)
    for seed in (lo, hi):
        body = {"prompt": "x", "max_tokens": 3, "seed": seed, "temperature": 0.8, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        model, tok = mt
        ref = generate(
            model, tok, "x", SamplingParams(max_tokens=3, seed=seed, temperature=0.8, ignore_eos=True)
        )
        assert r.json()["choices"][0]["text"] == str(ref)


def _int_fields(cls) -> dict[str, typing.Any]:
    """Each field of a request model whose type holds an integer -> a JSON value putting a boolean there."""

    def has_int(t):
        return t is int or any(has_int(a) for a in typing.get_args(t))

    def as_bool(t):
        if typing.get_origin(t) is list:
            return [as_bool(typing.get_args(t)[0])]
        lists = [a for a in typing.get_args(t) if typing.get_origin(a) is list and has_int(a)]
        return as_bool(lists[0]) if lists else True

    return {k: as_bool(f.annotation) for k, f in cls.model_fields.items() if has_int(f.annotation)}


@pytest.mark.parametrize(
    "path,cls,base",
    [
        ("/v1/completions", P.CompletionRequest, {"prompt": "x", "max_tokens": 2}),
        ("/v1/chat/completions", P.ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}),
        ("/detokenize", P.DetokenizeRequest, {"tokens": [5]}),
    ],
)
def test_a_boolean_is_no_integer_in_any_field(server, path, cls, base):
    fields = _int_fields(cls)
    assert "max_tokens" in fields or path == "/detokenize"
    for name, value in fields.items():
        r = httpx.post(server.url + path, json={**base, name: value}, timeout=60)
        assert r.status_code == 400, (name, value, r.text)
        assert r.json()["error"]["param"].split(".")[0] == name, r.text
    if path == "/v1/completions":  # and a number is no boolean, a string no number
        for name, value in [("stream", 1), ("temperature", True), ("max_tokens", "5"), ("echo", 0)]:
            r = httpx.post(server.url + path, json={**base, name: value}, timeout=60)
            _bad(r, name)


def test_405_names_the_allowed_methods(server):
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/health")
    assert r.status_code == 405 and "GET" in r.headers["allow"]


def test_a_request_that_can_never_fit_is_a_400_not_429_forever(server):
    # an idle server with 2 rows and a queue of 1 holds at most 3 sequences at once
    assert httpx.get(server.url + "/metrics").status_code == 200
    for body, words in [
        ({"prompt": "x", "n": 4}, ["4 sequences", "3", "--max-batch 2", "--max-queue 1"]),
        ({"prompt": ["a", "b"], "n": 2}, ["4 sequences", "2 prompts x n=2"]),
        ({"prompt": ["a", "b", "c", "d"]}, ["4 sequences"]),
    ]:
        r = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=60)
        _bad(r, "n", *words)
        assert "retry-after" not in r.headers
    msgs = [{"role": "user", "content": "x"}]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": msgs, "n": 5, "max_tokens": 2})
    _bad(r, "n", "5 sequences")
    # exactly what fits is served
    r = httpx.post(
        server.url + "/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "n": 3, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 3


def test_every_error_body_is_json_the_client_can_read(server):
    # an error naming a key that held a surrogate must itself be valid UTF-8 JSON
    r = _post(server.url, "/v1/completions", b'{"\\udbff\\udbff": 1}')
    assert r.status_code == 400
    json.loads(r.content.decode("utf-8"))


def test_a_null_max_tokens_completes_to_the_context(mt, server):
    # found by the fuzz test: null reached SamplingParams and failed there (a 500)
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": ["the fox", "a"], "max_tokens": None, "ignore_eos": True, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    _, tok = mt
    longest = max(len(tok.encode("the fox")), len(tok.encode("a")))
    assert r.json()["usage"]["completion_tokens"] == 2 * (256 - longest)
