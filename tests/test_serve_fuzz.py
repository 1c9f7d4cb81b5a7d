"""Random mutations of valid requests against every JSON endpoint of a live server (hypothesis): no 5xx, every
stream ends with [DONE] and no server error, nothing with a traceback or at ERROR in the log, and afterwards
the server answers a greedy request exactly as before (and as offline `generate` does)."""

from __future__ import annotations

import copy
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_log import ServerLog
from serve_parts import tiny_model_and_tokenizer

from bitnetlm.generate import SamplingParams, generate
from bitnetlm.serve import start

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASES = [
    ("/v1/completions", {"model": "bitnet", "prompt": "the fox", "max_tokens": 4, "temperature": 0}),
    (
        "/v1/completions",
        {"prompt": [[5, 6, 7], [8]], "max_tokens": 3, "n": 2, "seed": 3, "logprobs": 2, "stop": ["e", "x"]},
    ),
    (
        "/v1/completions",
        {
            "prompt": "lazy dog",
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logit_bias": {"5": 2.0},
            "top_k": 5,
            "top_p": 0.9,
            "min_p": 0.05,
            "stop_token_ids": [7],
            "ignore_eos": True,
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
            "max_tokens": 4,
            "logprobs": True,
            "top_logprobs": 2,
            "seed": 1,
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi", "name": "a"}],
            "max_completion_tokens": 3,
            "stream": True,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.1,
            "repetition_penalty": 1.2,
            "response_format": {"type": "text"},
        },
    ),
    ("/tokenize", {"prompt": "Hello world", "add_special_tokens": False}),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}),
    ("/detokenize", {"tokens": [5, 6, 7]}),
]
KEYS = sorted(
    {k for _, b in BASES for k in b} | {"echo", "best_of", "suffix", "tools", "tool_choice", "user"}
)
# characters that break naive handling: lone surrogates, NUL, line separators, beyond the BMP
odd_chars = st.characters(categories=["Cs"]) | st.sampled_from(
    ["\x00", "\u2028", "\x85", "🙂", "é", "\ufffd"]
)
odd_text = st.lists(odd_chars | st.characters(), min_size=1, max_size=6).map("".join)
# numbers at the edges of what a field, torch or an int64 takes
INT_EDGES = [0, -1, 1, 2, 255, 256, 257, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30]
EDGES = [*INT_EDGES, 1.5, -0.0, 1e308, True, False, None, "1", "", [], {}]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 300)
    | st.sampled_from(EDGES).map(copy.deepcopy)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | odd_text
)
values = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.sampled_from(KEYS) | odd_text, kids, max_size=3)
    ),
    max_leaves=8,
)


def _paths(node, path=()):
    """Every location in a JSON value, as key/index paths."""
    yield path
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield from _paths(v, (*path, k))


def _set(body, path, value):
    if not path:
        return value
    node = body
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return body


def _get(body, path):
    for k in path:
        body = body[k]
    return body


def _edge(data, node):
    """`node` bent at its edges: odd characters inside a string, an edge number for a number, and so on."""
    if isinstance(node, str):
        i = data.draw(st.integers(0, len(node)))
        return node[:i] + data.draw(odd_text) + node[i:]
    if isinstance(node, list) and node and data.draw(st.booleans()):
        return [_edge(data, node[0]), *node[1:]]
    return data.draw(st.sampled_from(EDGES).map(copy.deepcopy))


def _mutate(data, body):
    kind = data.draw(
        st.sampled_from(["edge"] * 6 + ["set"] * 3 + ["delete"] * 3 + ["add"] * 2 + ["wrap", "deep", "whole"])
    )
    if kind == "whole":
        return data.draw(values)
    path = data.draw(st.sampled_from(list(_paths(body))[1:] or [()]))
    node = _get(body, path)
    if kind == "edge":
        return _set(body, path, _edge(data, node))
    if kind == "delete" and path:
        del _get(body, path[:-1])[path[-1]]
        return body
    if kind == "add" and isinstance(node, (dict, list)):
        if isinstance(node, dict):
            node[data.draw(st.sampled_from(KEYS) | odd_text)] = data.draw(values)
        else:
            node.append(data.draw(values))
        return body
    if kind == "wrap":
        return _set(body, path, data.draw(st.sampled_from([[node], {"text": node}])))
    if kind == "deep":  # around the nesting limit (past the interpreter's recursion limit: _encode)
        for _ in range(data.draw(st.sampled_from([60, 63, 64, 65, 70]))):
            node = [node]
        return _set(body, path, node)
    return _set(body, path, data.draw(values))  # "set", and what does not apply to this node


def _encode(data, body) -> bytes:
    raw = json.dumps(body, ensure_ascii=True).encode()  # lone surrogates go out as \ud800 escapes
    how = data.draw(st.sampled_from(["json"] * 17 + ["cut", "byte", "deeper"]))
    if how == "deeper":  # nesting json.dumps itself cannot write
        wall = b"[" * 1200 + b"]" * 1200
        return raw[:-1] + b', "stop": ' + wall + b"}" if raw.startswith(b"{") and raw != b"{}" else wall
    if how == "cut":
        return raw[: data.draw(st.integers(0, max(len(raw) - 1, 0)))]
    if how == "byte":
        i = data.draw(st.integers(0, len(raw)))
        return raw[:i] + bytes([data.draw(st.integers(0, 255))]) + raw[i:]
    return raw


def _check(r: httpx.Response, what) -> None:
    assert r.status_code < 500, (what, r.status_code, r.text[:500])
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), (what, r.text[-300:])
        assert '"server_error"' not in r.text, (what, r.text[-500:])
        return
    body = r.json()  # every other answer is JSON
    if r.status_code >= 400:
        assert isinstance(body["error"]["message"], str), (what, body)


GREEDY = {"prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def test_fuzzed_requests_never_break_the_server():
    model, tok = tiny_model_and_tokenizer(max_len=256)
    ref = str(
        generate(model, tok, GREEDY["prompt"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    )
    with (
        start(model, tok, port=0, max_batch=4, max_queue=4, log_level="warning") as h,
        httpx.Client(base_url=h.url, timeout=120, headers={"Content-Type": "application/json"}) as client,
    ):
        assert client.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"] == ref

        @settings(
            max_examples=150,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(st.data())
        def one(data):
            path, base = data.draw(st.sampled_from(BASES))
            body = copy.deepcopy(base)
            for _ in range(data.draw(st.integers(1, 2))):
                body = _mutate(data, body)
            raw = _encode(data, body)
            _check(client.post(path, content=raw), (path, raw[:300]))

        with ServerLog() as log:
            one()
        assert log.problems() == []
        assert httpx.get(h.url + "/health").json() == {"status": "ok"}
        # the server still answers exactly as before: nothing it was fed changed its state
        assert client.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"] == ref
