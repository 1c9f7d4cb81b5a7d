"""`bitnet serve --replicas`: engine replicas on Ray Serve, against a local Ray cluster started here.

Oracle: offline `bitnetlm.generate` on the same zoo model; Prometheus' own parser for the merged /metrics.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from bitnetlm import load
from bitnetlm.generate import SamplingParams, generate
from bitnetlm.serve.ray import ReplicaConfig, merge_metrics

KEY = "secret-key"
MODEL = "bitnet-tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replica_names() -> list[str]:
    return sorted(
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::default#bitnet#")
    )  # fmt: skip


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = cond()
        if out:
            return out
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def cluster():
    from bitnetlm.serve.ray import _server_config, build

    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 << 20, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        cfg = _server_config(MODEL, {"api_key": KEY, "max_batch": 4, "log_level": "warning"})
        serve.run(build(MODEL, cfg, ReplicaConfig(replicas=2, cpus=1)), name="default")
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: httpx.get(url + "/health").status_code == 200, 120, "the replicas")
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def reference():
    model, tok = load(MODEL)
    return lambda prompt, n: str(
        generate(model, tok, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    )


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_replicas_answer_like_offline_generate(cluster, reference):
    c = _client(cluster)
    for prompt in ("Once upon a time", "The little dog", "She said that", "In the morning"):
        r = c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].text == reference(prompt, 12)
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.choices[0].message.role == "assistant"
    # the app's API key rule holds on every replica
    assert httpx.post(cluster + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 401
    assert httpx.get(cluster + "/metrics").status_code == 401


def test_metrics_aggregate_every_replica(cluster):
    c = _client(cluster)
    for i in range(12):
        c.completions.create(model=MODEL, prompt=f"Count {i}", max_tokens=2)
    time.sleep(2.5)  # a push period or two
    text = httpx.get(cluster + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    ok = [s for s in fams["vllm:request_success"].samples if s.name == "vllm:request_success_total"]
    replicas = {s.labels["replica"] for s in ok}
    assert len(replicas) == 2
    assert sum(s.value for s in ok) >= 12


def test_killed_replica_is_replaced_and_only_its_requests_fail(cluster, reference):
    names = _replica_names()
    assert len(names) == 2
    results: list[tuple[float, str]] = []  # (start time, outcome)
    stop = threading.Event()
    want = reference("The cat", 24)

    def load_loop():
        c = _client(cluster)
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                r = c.completions.create(
                    model=MODEL,
                    prompt="The cat",
                    max_tokens=24,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                results.append((t0, "ok" if r.choices[0].text == want else "wrong text"))
            except openai.APIStatusError as e:
                results.append((t0, f"status {e.status_code}"))
            except openai.APIConnectionError as e:
                results.append((t0, f"connection {e}"))

    threads = [threading.Thread(target=load_loop) for _ in range(6)]
    for t in threads:
        t.start()
    _wait(lambda: len(results) >= 6, 60, "the load")
    killed_at = time.monotonic()
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    _wait(lambda: len(_replica_names()) == 2 and names[0] not in _replica_names(), 120, "a new replica")
    _wait(lambda: httpx.get(cluster + "/health").status_code == 200, 60, "health")
    time.sleep(2)
    stop.set()
    for t in threads:
        t.join(120)
    failed = [(t0, what) for t0, what in results if what != "ok"]
    assert not [f for f in failed if not f[1].startswith("status 5")], failed  # failures are clear 5xx
    # only requests that were running on the killed replica fail: at most one per client, all started before
    assert len(failed) <= len(threads) and all(t0 < killed_at for t0, _ in failed), failed
    assert sum(what == "ok" for t0, what in results if t0 > killed_at) > 0
    # a retry succeeds
    r = _client(cluster).completions.create(model=MODEL, prompt="The cat", max_tokens=24, temperature=0,
                                            extra_body={"ignore_eos": True})  # fmt: skip
    assert r.choices[0].text == want


def test_merge_metrics_is_valid_prometheus():
    a = (
        "# HELP x_total Things.\n# TYPE x_total counter\nx_total 3.0\n"
        '# HELP h Latency.\n# TYPE h histogram\nh_bucket{le="1.0"} 1.0\nh_bucket{le="+Inf"} 2.0\nh_sum 1.5\nh_count 2.0\n'
    )
    b = a.replace("3.0", "4.0")
    fams = {f.name: f for f in text_string_to_metric_families(merge_metrics({"r1": a, "r2": b}))}
    assert {s.labels["replica"]: s.value for s in fams["x"].samples} == {"r1": 3.0, "r2": 4.0}
    assert {(s.name, s.labels["replica"]) for s in fams["h"].samples} >= {("h_sum", "r1"), ("h_count", "r2")}


def test_replica_flags_need_replicas(capsys):
    from bitnetlm.cli import main

    assert main(["serve", "--replica-cpus", "2"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "bitnet serve: error: --replica-cpus needs --replicas (serving on Ray Serve)"
    ]


def test_replica_options():
    assert ReplicaConfig(replicas=2).options()["num_replicas"] == 2
    auto = ReplicaConfig(replicas=1, max_replicas=4, target_requests=16).options()["autoscaling_config"]
    assert auto == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16}
    with pytest.raises(ValueError, match="--max-replicas 1: expected an integer >= --replicas"):
        ReplicaConfig(replicas=2, max_replicas=1)
    with pytest.raises(ValueError, match="--replica-gpus -1"):
        ReplicaConfig(gpus=-1)


@pytest.mark.parametrize("path", ["examples/ray_serve_config.yaml", "examples/kuberay_rayservice.yaml"])
def test_example_serve_configs_build(path):
    import importlib
    from pathlib import Path

    import yaml

    doc = yaml.safe_load((Path(__file__).parent.parent / path).read_text())
    if doc.get("kind") == "RayService":
        doc = yaml.safe_load(doc["spec"]["serveConfigV2"])
    for app in doc["applications"]:
        module, _, attr = app["import_path"].partition(":")
        built = getattr(importlib.import_module(module), attr)(app["args"])
        assert isinstance(built, serve.Application)
