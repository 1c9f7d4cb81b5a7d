"""`bitnet serve` as a real process: env-var flags, /health 503 -> 200, API key, SIGTERM drains a running stream;
start-up failures (a bad option, a port in use, a model that cannot load) as one line and a non-zero exit."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serve_parts import tiny_model_and_tokenizer

import bitnetlm
from bitnetlm.commands.serve import FLAGS, env_name


def test_every_flag_has_an_env_var():
    import argparse

    from bitnetlm.commands import serve as cmd

    p = argparse.ArgumentParser()
    cmd.add_arguments(p)
    env = {"BITNET_PORT": "1234", "BITNET_MAX_BATCH": "3", "BITNET_CORS_ORIGINS": "http://a"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        o = cmd.resolve(p.parse_args(["--port", "99"]))
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert o["port"] == 99  # the flag wins
    assert o["max_batch"] == 3 and o["cors_origins"] == "http://a"  # the environment fills in
    assert o["host"] == "127.0.0.1"  # safe default
    for _, dest, *_ in FLAGS:
        assert env_name(dest) in p.format_help()
    # a boolean flag: alone, with a value, from the environment; a bad value names the variable
    assert cmd.resolve(p.parse_args([]))["enforce_eager"] is False
    assert cmd.resolve(p.parse_args(["--enforce-eager"]))["enforce_eager"] is True
    assert cmd.resolve(p.parse_args(["--enforce-eager", "false"]))["enforce_eager"] is False
    assert cmd.resolve(p.parse_args([]))["prefix_caching"] is True
    assert cmd.resolve(p.parse_args(["--prefix-caching", "off"]))["prefix_caching"] is False
    os.environ["BITNET_ENFORCE_EAGER"] = "yes"
    try:
        assert cmd.resolve(p.parse_args([]))["enforce_eager"] is True
        os.environ["BITNET_ENFORCE_EAGER"] = "maybe"
        with pytest.raises(ValueError, match="BITNET_ENFORCE_EAGER='maybe'"):
            cmd.resolve(p.parse_args([]))
    finally:
        os.environ.pop("BITNET_ENFORCE_EAGER")


def test_bitnet_serve_process_health_auth_and_graceful_drain(tmp_path):
    model, tok = tiny_model_and_tokenizer(max_len=256)
    bitnetlm.save(model, tmp_path / "tiny", tokenizer=tok)
    env = dict(
        os.environ,
        BITNET_API_KEY="k",
        BITNET_MAX_BATCH="2",
        BITNET_BACKEND="reference",
        BITNET_PORT="0",
        BITNET_THREADS="1",
    )
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bitnetlm.cli",
            "serve",
            "-m",
            str(tmp_path / "tiny"),
            "--log-level",
            "warning",
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = None
        t0 = time.monotonic()
        while url is None and time.monotonic() - t0 < 120:
            line = proc.stderr.readline()
            assert line, f"server exited early (rc={proc.poll()})"
            m = re.search(r"listening on (http://\S+)", line)
            url = m.group(1) if m else None
        assert url.startswith("http://127.0.0.1:")
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
        codes = []
        while time.monotonic() - t0 < 120:
            codes.append(httpx.get(url + "/health").status_code)
            if codes[-1] == 200:
                break
            time.sleep(0.05)
        assert codes[-1] == 200 and set(codes) <= {200, 503}
        assert httpx.get(url + "/v1/models").status_code == 401
        auth = {"Authorization": "Bearer k"}
        assert httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"] == "tiny"

        # a long stream is running when SIGTERM arrives: it must finish completely, then the process exits 0
        body = {"model": "tiny", "prompt": "fox", "max_tokens": 60, "stream": True, "ignore_eos": True}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=auth, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        proc.send_signal(signal.SIGTERM)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # uvicorn re-raises the signal after its graceful shutdown, so the exit status is "killed by SIGTERM"
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    from bitnetlm import cli

    rc = cli.main(argv)
    return rc, capsys.readouterr().err.strip().splitlines()


BAD_FLAGS = [
    (["--prefill-chunk", "0"], "--prefill-chunk 0"),
    (["--prefill-chunk", "-3"], "--prefill-chunk -3"),
    (["--max-queue", "-1"], "--max-queue -1"),
    (["--max-body-bytes", "0"], "--max-body-bytes 0"),
    (["--graceful-timeout", "-1"], "--graceful-timeout -1"),
    (["--graceful-timeout", "nan"], "--graceful-timeout nan"),
    (["--graceful-timeout", "inf"], "--graceful-timeout inf"),
    (["--port", "70000"], "--port 70000"),
    (["--port", "-1"], "--port -1"),
    (["--max-batch", "0"], "--max-batch 0"),
    (["-c", "-5"], "--ctx-size -5"),
    (["--log-level", "loud"], "--log-level 'loud'"),
]


@pytest.mark.timeout(120)  # an option accepted by mistake would serve (and so wait) forever
@pytest.mark.parametrize("flags,named", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_every_numeric_flag_is_checked_before_the_port_opens(flags, named, capsys):
    rc, err = _cli(["serve", "-m", "/nonexistent", "--port", "0", *flags], capsys)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"bitnet serve: error: {named}"), err


@pytest.mark.timeout(120)
def test_a_flag_from_the_environment_is_checked_too(monkeypatch, capsys):
    monkeypatch.setenv("BITNET_PREFILL_CHUNK", "0")
    rc, err = _cli(["serve", "-m", "/nonexistent", "--port", "0"], capsys)
    assert rc == 2 and err == ["bitnet serve: error: --prefill-chunk 0: expected an integer >= 1"]


@pytest.mark.timeout(120)
def test_a_port_in_use_is_one_line_naming_the_address(capsys):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        rc, err = _cli(["serve", "-m", "/nonexistent", "--port", str(port)], capsys)
    finally:
        busy.close()
    assert rc == 2 and err == [
        f"bitnet serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]


def test_a_model_that_cannot_load_ends_the_process_with_one_line():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(
        [sys.executable, "-m", "bitnetlm.cli", "serve", "-m", "/nonexistent/model", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # before, the server kept running with /health saying "error"
    )
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("bitnet serve: error: /nonexistent/model: no such file or directory"), r.stderr


def test_a_context_beyond_the_model_is_refused(tmp_path):
    from bitnetlm.serve import start

    model, tok = tiny_model_and_tokenizer(max_len=256)
    with pytest.raises(ValueError, match=r"--ctx-size 100000: the model's context is 256 tokens"):
        start(model, tok, port=0, max_seq_len=100000)
    bitnetlm.save(model, tmp_path / "tiny", tokenizer=tok)
    h = start(path=tmp_path / "tiny", port=0, max_seq_len=100000, backend="reference", log_level="warning")
    h.thread.join(60)  # the server stops by itself: it has nothing to serve
    assert not h.thread.is_alive()
    assert h.error == "--ctx-size 100000: the model's context is 256 tokens; give at most 256"
