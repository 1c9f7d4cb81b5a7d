"""Several models by name and hot swap (POST /v1/admin/models) on a real server, with the official openai client.

Oracle: offline greedy `generate` on each model loaded from disk with the server's runtime options; every
request's whole output must equal one model's greedy output.
"""

from __future__ import annotations

import asyncio
import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref

import httpx
import openai
import pytest
from serve_parts import tiny_model_and_tokenizer

import bitnetlm
from bitnetlm.engine.metrics import parse_metrics
from bitnetlm.generate import SamplingParams, generate
from bitnetlm.loading import load_for_generation
from bitnetlm.runtime.config import RuntimeConfig
from bitnetlm.serve import start

pytestmark = pytest.mark.usefixtures("one_torch_thread")
KEY = "sk-admin-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
RT = dict(backend="reference", threads=1)
PROMPTS = ["Hello world", "The quick brown fox", "a single man", "truth universally"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Two different tiny models (same tokenizer) on disk, and each one's greedy outputs per prompt."""
    base = tmp_path_factory.mktemp("models")
    out, refs = {}, {}
    for name, seed in (("a", 0), ("b", 1)):
        model, tok = tiny_model_and_tokenizer(max_len=512, seed=seed)
        bitnetlm.save(model, base / name, tokenizer=tok)
        out[name] = str(base / name)
        m, t = load_for_generation(out[name], RuntimeConfig(**RT))
        greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        refs[name] = {p: str(generate(m, t, p, greedy)) for p in PROMPTS}
        refs[name]["long"] = str(
            generate(m, t, "Hello", SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
        )
    assert all(refs["a"][p] != refs["b"][p] for p in PROMPTS)  # the outputs tell the models apart
    return out, refs


def _admin(url, body, headers=AUTH):
    return httpx.post(url + "/v1/admin/models", json=body, headers=headers, timeout=60)


def _wait(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_hot_swap_under_load_fails_no_request_and_never_mixes_models(paths):
    path, refs = paths
    with start(path=path["a"], model_name="tiny", port=0, api_key=KEY, max_batch=8, max_queue=128, **RT,
               log_level="warning") as h:  # fmt: skip
        assert _wait(lambda: h.engine is not None)  # (loaded on a thread)
        old = h.engine

        async def main(old):
            async with (
                openai.AsyncOpenAI(base_url=h.url + "/v1", api_key=KEY, max_retries=0, timeout=120) as client,
                httpx.AsyncClient(timeout=60, headers=AUTH) as http,
            ):
                return await under_load(client, http, old)

        async def under_load(client, http, old):
            async def one(prompt, max_tokens=24, started=None):
                s = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True})  # fmt: skip
                text = ""
                async for c in s:
                    text += c.choices[0].text if c.choices else ""
                    if started is not None and not started.done():
                        started.set_result(None)
                return text

            started = asyncio.get_running_loop().create_future()
            long = asyncio.create_task(one("Hello", 300, started))
            await started  # running on model a
            before = [asyncio.create_task(one(PROMPTS[i % 4])) for i in range(32)]
            load = {"action": "load", "name": "tiny", "path": path["b"]}
            swap = asyncio.create_task(http.post(h.url + "/v1/admin/models", json=load))
            during = []
            for i in range(32):  # more requests while the new model loads
                during.append(asyncio.create_task(one(PROMPTS[i % 4])))
                await asyncio.sleep(0.005)
            swapped = await swap
            old_running = old.stats()["running"]
            after = await one(PROMPTS[0])
            texts = await asyncio.gather(*before, *during)  # (raises if any request failed)
            return swapped, await long, texts, after, old_running

        swapped, long, texts, after, old_running = asyncio.run(main(old))
        assert swapped.status_code == 200 and swapped.json()["status"] == "swapped"
        assert long == refs["a"]["long"]  # ran through the swap on the old model, to the end
        assert after == refs["b"][PROMPTS[0]]  # new requests go to the new model
        prompts = [PROMPTS[i % 4] for i in range(32)] * 2
        origin = [
            "a" if t == refs["a"][p] else "b" if t == refs["b"][p] else "mixed"
            for t, p in zip(texts, prompts)
        ]
        assert "mixed" not in origin and len(texts) == 64
        assert "a" in origin  # some ran on the old model, the rest on the new one
        print(f"hot swap: {origin.count('a')} requests on the old model, {origin.count('b')} on the new; "
              f"{old_running} still running on the old one when the swap returned")  # fmt: skip
        # the old engine stops once its requests ended, and is no longer served
        assert _wait(lambda: not h.models.retiring)
        assert not old.accepting and not old._thread.is_alive()
        assert h.engine is not old
        gone = weakref.ref(old.model)
        del old
        assert _wait(lambda: gc.collect() >= 0 and gone() is None)  # the old model's memory is freed


def test_several_models_admin_routes_and_failed_loads(paths, tmp_path):
    path, refs = paths
    with start(
        path=path["a"], model_name="tiny", port=0, api_key=KEY, max_models=2, **RT, log_level="warning"
    ) as h:
        assert _wait(lambda: h.engine is not None)
        client = openai.OpenAI(base_url=h.url + "/v1", api_key=KEY, max_retries=0, timeout=60)

        def complete(model, prompt=PROMPTS[1]):
            r = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True})  # fmt: skip
            assert r.model == model
            return r.choices[0].text

        assert _admin(h.url, {"action": "list"}, headers={}).status_code == 401  # the key, as every route
        assert [m["id"] for m in _admin(h.url, {"action": "list"}).json()["data"]] == ["tiny"]
        r = _admin(h.url, {"action": "load", "name": "other", "path": path["b"]})
        assert r.status_code == 200 and r.json()["status"] == "loaded"
        assert [m.id for m in client.models.list().data] == ["tiny", "other"]
        assert complete("tiny") == refs["a"][PROMPTS[1]] and complete("other") == refs["b"][PROMPTS[1]]
        with pytest.raises(openai.NotFoundError) as e:
            complete("nope")
        assert "'tiny', 'other'" in e.value.body["message"]
        # /metrics: each model's samples under its model_name, each metric's HELP once
        text = httpx.get(h.url + "/metrics", headers=AUTH).text
        m = parse_metrics(text)
        assert m['vllm:request_success_total{finished_reason="length",model_name="other"}'] == 1
        assert m['vllm:num_requests_running{model_name="tiny"}'] == 0
        assert text.count("# HELP vllm:num_requests_running ") == 1

        # the budget: a third model is refused; a load that fails leaves the served model serving
        r = _admin(h.url, {"action": "load", "name": "third", "path": path["b"]})
        assert r.status_code == 400 and "--max-models 2" in r.json()["error"]["message"]
        (tmp_path / "broken").mkdir()
        (tmp_path / "broken" / "config.json").write_text("{not json")
        for bad in (str(tmp_path / "missing"), str(tmp_path / "broken")):
            r = _admin(h.url, {"action": "load", "name": "tiny", "path": bad})
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "model_load_failed" and "\n" not in err["message"]
            assert err["message"].startswith("cannot load 'tiny' from ")
        assert complete("tiny") == refs["a"][PROMPTS[1]]

        # unload: the default stays; another goes (404 from then on) and its engine stops
        other = h.models.models["other"].engine
        r = _admin(h.url, {"action": "unload", "name": "tiny"})
        assert r.status_code == 400 and "default" in r.json()["error"]["message"]
        assert _admin(h.url, {"action": "unload", "name": "other"}).json()["status"] == "unloaded"
        assert _admin(h.url, {"action": "unload", "name": "other"}).status_code == 404
        with pytest.raises(openai.NotFoundError):
            complete("other")
        assert _wait(lambda: not h.models.retiring) and not other._thread.is_alive()
        assert [m["id"] for m in _admin(h.url, {"action": "list"}).json()["data"]] == ["tiny"]
        bad = _admin(h.url, {"action": "load", "name": "x"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "path"


def test_admin_is_refused_without_a_key_unless_allowed(paths):
    path, refs = paths
    with start(path=path["a"], port=0, **RT, log_level="warning") as h:
        assert _wait(lambda: h.engine is not None)
        r = _admin(h.url, {"action": "list"}, headers={})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"
    with start(path=path["a"], port=0, allow_admin=True, **RT, log_level="warning") as h:
        assert _wait(lambda: h.engine is not None)
        assert _admin(h.url, {"action": "list"}, headers={}).status_code == 200


def test_the_cli_serves_grpc_and_admin_and_sighup_reloads_the_default_model(paths, tmp_path):
    """`bitnet serve --grpc-port 0 --allow-admin --max-models 2`: gRPC beside HTTP on the same models, admin
    without a key, and `kill -HUP` reloading the default model from its path (seen by HTTP and gRPC alike)."""
    grpc = pytest.importorskip("grpc")
    from bitnetlm.serve.kserve import inference_pb2 as pb
    from bitnetlm.serve.kserve import inference_pb2_grpc as pb_grpc

    path, refs = paths
    live = tmp_path / "live"
    shutil.copytree(path["a"], live)
    env = dict(os.environ, BITNET_BACKEND="reference", BITNET_THREADS="1", BITNET_PORT="0")
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "bitnetlm.cli", "serve", "-m", str(live), "--log-level", "info",
           "--grpc-port", "0", "--allow-admin", "--max-models", "2"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = grpc_addr = None
        while url is None or grpc_addr is None:  # (gRPC starts before the model is loaded: both lines come)
            line = proc.stderr.readline()
            assert line, f"server exited early (rc={proc.poll()})"
            m = re.search(r"listening on (http://\S+)", line)
            url = m.group(1) if m else url
            m = re.search(r"gRPC listening on (\S+)", line)
            grpc_addr = m.group(1) if m else grpc_addr
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
        body = {"prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        P = pb.InferParameter
        opts = {
            "max_tokens": P(int64_param=24),
            "temperature": P(double_param=0),
            "ignore_eos": P(bool_param=True),
        }
        channel = grpc.insecure_channel(grpc_addr)
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        def text():
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            return r.json()["choices"][0]["text"] if r.status_code == 200 else None

        def grpc_text():
            req = pb.GenerateRequest(text_input=PROMPTS[2], parameters=opts)
            return "".join(m.text_output for m in stub.Generate(req, timeout=60))

        assert _wait(lambda: httpx.get(url + "/health").status_code == 200, timeout=120)
        assert text() == refs["a"][PROMPTS[2]] == grpc_text()
        r = _admin(url, {"action": "load", "name": "other", "path": path["b"]}, headers={})  # --allow-admin
        assert r.status_code == 200 and r.json()["status"] == "loaded"  # --max-models 2
        shutil.rmtree(live)
        shutil.copytree(path["b"], live)  # a new model at the same path
        proc.send_signal(signal.SIGHUP)
        assert _wait(lambda: text() == refs["b"][PROMPTS[2]], timeout=60)
        assert grpc_text() == refs["b"][PROMPTS[2]]
        assert proc.poll() is None  # still serving
        channel.close()
    finally:
        proc.terminate()
        proc.wait(60)
