"""`bitnet serve` as a real process: env-var flags, /health 503 -> 200, API key, SIGTERM drains a running stream."""

from __future__ import annotations

import json
import os
import re
import signal
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
