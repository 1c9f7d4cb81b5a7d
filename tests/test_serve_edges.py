"""The server at its edges: large prompts tokenized beside the event loop, shutdown cutting what outlives the
graceful timeout with a proper end of stream, idle keep-alive connections closed."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from serve_log import ServerLog
from serve_parts import tiny_model_and_tokenizer

from bitnetlm.serve import start

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WORDS = (
    "the quick brown fox jumps over lazy dog truth universally acknowledged single man fortune wife".split()
)


class TimedTokenizer:
    """The real tokenizer, recording when each encode of a large text starts and ends (any entry point)."""

    def __init__(self, tok):
        self._tok = tok
        self.spans: list[tuple[float, float]] = []
        self.started = threading.Event()

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def _timed(self, fn, texts, *args, **kw):
        if max(map(len, texts), default=0) < 100_000:
            return fn(*args, **kw)
        self.started.set()
        t0 = time.monotonic()
        try:
            return fn(*args, **kw)
        finally:
            self.spans.append((t0, time.monotonic()))

    def encode(self, text, *args, **kw):
        return self._timed(self._tok.encode, [text], text, *args, **kw)

    def encode_batch(self, texts, *args, **kw):
        return self._timed(self._tok.encode_batch, texts, texts, *args, **kw)


def test_health_answers_while_eight_large_prompts_are_tokenized():
    model, tok = tiny_model_and_tokenizer(max_len=256)
    timed = TimedTokenizer(tok)
    words = (WORDS * 20000)[:180_000]
    prompts = [" ".join(words[i:] + words[:i])[:1_000_000] for i in range(8)]  # 1 MB each
    with start(model, timed, port=0, log_level="warning") as h:
        codes = []

        def big(p):
            r = httpx.post(h.url + "/v1/completions", json={"prompt": p, "max_tokens": 1}, timeout=300)
            codes.append((r.status_code, r.json()["error"]["code"]))

        threads = [threading.Thread(target=big, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        assert timed.started.wait(120), "no large prompt was tokenized"
        r = httpx.get(h.url + "/health", timeout=300)
        health_done = time.monotonic()
        for t in threads:
            t.join(300)
    assert r.json() == {"status": "ok"}
    assert codes == [(400, "context_length_exceeded")] * 8  # each was tokenized in full (the model holds 256)
    assert len(timed.spans) == 8
    # the order, not a speed: /health came back while the first large tokenization was still running
    assert health_done < min(end for _, end in timed.spans)


def _stream_events(url: str, body: dict, started: threading.Event) -> list[str]:
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():  # a broken chunked body raises here (httpx.RemoteProtocolError)
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    return events


def test_graceful_timeout_ends_running_streams_with_an_error_event_and_done():
    model, tok = tiny_model_and_tokenizer(max_len=2048)
    h = start(model, tok, port=0, max_batch=4, graceful_timeout_s=0.3, log_level="warning")
    long = {"prompt": "the fox", "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
    out, started = {}, threading.Event()

    def streaming():
        out["events"] = _stream_events(h.url, {**long, "stream": True}, started)

    def plain():
        r = httpx.post(h.url + "/v1/completions", json=long, timeout=120)
        out["plain"] = (r.status_code, r.json())

    threads = [threading.Thread(target=streaming), threading.Thread(target=plain)]
    with ServerLog() as log:
        for t in threads:
            t.start()
        assert started.wait(60)
        deadline = time.monotonic() + 60
        while h.engine.stats()["rows_in_use"] < 2 and time.monotonic() < deadline:  # both are generating
            time.sleep(0.01)
        t0 = time.monotonic()
        h.stop()  # what SIGTERM does: uvicorn's graceful shutdown
        for t in threads:
            t.join(120)
    assert time.monotonic() - t0 < 60
    events = out["events"]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert "graceful timeout (0.3 s)" in err["message"] and err["type"] == "server_error"
    assert len(events) < 2000  # it was cut, not finished
    status, body = out["plain"]
    assert status == 503 and "graceful timeout" in body["error"]["message"]
    assert log.problems() == []  # uvicorn did not have to cancel a task mid-body


def test_idle_keep_alive_connections_are_closed():
    model, tok = tiny_model_and_tokenizer(max_len=64)
    with start(model, tok, port=0, keep_alive_s=0.5, log_level="warning") as h:
        s = socket.create_connection((h.host, h.port))
        s.settimeout(30)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        got = b""
        while not got.endswith(b'{"status":"ok"}'):
            got += s.recv(65536)
        assert got.startswith(b"HTTP/1.1 200") and b"connection: close" not in got.lower()
        t0 = time.monotonic()
        rest = s.recv(65536)  # nothing more is sent: the server closes the idle connection
        assert rest == b"" and time.monotonic() - t0 < 20
        s.close()


def test_a_client_connecting_before_uvicorn_runs_waits_and_is_served():
    """`bitnet serve` prints its address once the port is bound, before uvicorn has started: a client that
    connects then (a health probe) must wait in the backlog, not be refused."""
    from bitnetlm.serve import server as S
    from bitnetlm.serve.app import ServerConfig

    model, tok = tiny_model_and_tokenizer(max_len=64)
    cfg = ServerConfig(port=0, log_level="warning")
    srv = S._make_server(cfg, model, tok)
    sock = S._bind(cfg.host, cfg.port)
    url = "http://{}:{}".format(*sock.getsockname()[:2])
    out = {}
    probe = threading.Thread(target=lambda: out.update(r=httpx.get(url + "/health", timeout=60)))
    probe.start()
    time.sleep(0.3)  # the probe has connected (or been refused) before uvicorn runs
    run = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    run.start()
    probe.join(60)
    srv.should_exit = True
    run.join(60)
    assert out["r"].json() == {"status": "ok"}
