"""gRPC beside HTTP (KServe v2 + Generate) against a real server with a `grpcio` client.

Oracle: the HTTP /v1/completions route through the official openai client on the same server; the engine's own
counters for cancellation; grpcio-tools for the committed stubs.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from serve_parts import tiny_model_and_tokenizer

from bitnetlm.serve import start

grpc = pytest.importorskip("grpc")
pb = pytest.importorskip("bitnetlm.serve.kserve.inference_pb2")
pb_grpc = pytest.importorskip("bitnetlm.serve.kserve.inference_pb2_grpc")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-grpc-test"
AUTH = (("authorization", f"Bearer {KEY}"),)
PROMPTS = ["Hello world", "The quick brown fox"]


@pytest.fixture(scope="module")
def server():
    model, tok = tiny_model_and_tokenizer(max_len=512)
    h = start(model, tok, port=0, grpc_port=0, max_batch=4, api_key=KEY, log_level="warning")
    assert h.grpc_port
    yield h
    h.stop()


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    yield pb_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def _params(**kw) -> dict:
    out = {}
    for k, v in kw.items():
        if isinstance(v, bool):
            out[k] = pb.InferParameter(bool_param=v)
        elif isinstance(v, int):
            out[k] = pb.InferParameter(int64_param=v)
        elif isinstance(v, float):
            out[k] = pb.InferParameter(double_param=v)
        else:
            out[k] = pb.InferParameter(string_param=v)
    return out


def _http(server, prompts, **kw) -> list[str]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    r = client.completions.create(
        model="bitnet", prompt=prompts, temperature=0, extra_body={"ignore_eos": True}, **kw
    )
    return [c.text for c in sorted(r.choices, key=lambda c: c.index)]


def _infer_request(prompts, raw=False, **kw):
    t = pb.ModelInferRequest.InferInputTensor(name="text_input", datatype="BYTES", shape=[len(prompts)])
    data = [p.encode() for p in prompts]
    req = pb.ModelInferRequest(model_name="bitnet", id="r1", inputs=[t], parameters=_params(**kw))
    if raw:
        req.raw_input_contents.append(b"".join(struct.pack("<I", len(b)) + b for b in data))
    else:
        req.inputs[0].contents.bytes_contents.extend(data)
    return req


def _raw_out(blob: bytes) -> list[str]:
    out, i = [], 0
    while i < len(blob):
        (n,) = struct.unpack_from("<I", blob, i)
        out.append(blob[i + 4 : i + 4 + n].decode())
        i += 4 + n
    return out


def test_model_infer_and_generate_equal_http(server, stub):
    want = _http(server, PROMPTS, max_tokens=12)
    opts = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    r = stub.ModelInfer(_infer_request(PROMPTS, **opts), metadata=AUTH)
    assert r.model_name == "bitnet" and r.id == "r1"
    assert [o.name for o in r.outputs] == ["text_output"] and list(r.outputs[0].shape) == [2]
    assert [b.decode() for b in r.outputs[0].contents.bytes_contents] == want
    raw = stub.ModelInfer(_infer_request(PROMPTS, raw=True, **opts), metadata=AUTH)
    assert _raw_out(raw.raw_output_contents[0]) == want

    msgs = list(
        stub.Generate(pb.GenerateRequest(text_input=PROMPTS[1], parameters=_params(**opts)), metadata=AUTH)
    )
    assert len(msgs) > 2  # streamed: several deltas, then the final message
    assert "".join(m.text_output for m in msgs) == want[1]
    last = msgs[-1]
    assert (last.finish_reason, last.completion_tokens, last.model_name) == ("length", 12, "bitnet")
    assert last.prompt_tokens > 0


def test_health_metadata_and_errors(stub):
    assert stub.ServerLive(pb.ServerLiveRequest()).live  # health needs no key, as /health
    assert stub.ServerReady(pb.ServerReadyRequest()).ready
    assert stub.ModelReady(pb.ModelReadyRequest(name="bitnet"), metadata=AUTH).ready
    assert stub.ModelReady(pb.ModelReadyRequest(), metadata=(("x-api-key", KEY),)).ready  # '' = the default
    md = stub.ModelMetadata(pb.ModelMetadataRequest(name="bitnet"), metadata=AUTH)
    assert md.name == "bitnet" and [(t.name, t.datatype) for t in md.inputs] == [("text_input", "BYTES")]
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelReady(pb.ModelReadyRequest(name="nope"), metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'bitnet'" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(_infer_request(PROMPTS, max_tokens=0), metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(_infer_request(PROMPTS, temperature="hot"), metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # the /v1/completions limit on prompts per request
        stub.ModelInfer(_infer_request(["x"] * 65, max_tokens=1), metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 64 prompts" in e.value.details()
    bad = _infer_request(PROMPTS)
    bad.inputs[0].shape[:] = [3]
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(bad, metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "shape [3]" in e.value.details()


def test_api_key_is_required(stub):
    for md in (None, (("authorization", "Bearer wrong"),)):
        for call in (
            lambda md=md: stub.ModelInfer(_infer_request(PROMPTS, max_tokens=2), metadata=md),
            lambda md=md: stub.ModelMetadata(pb.ModelMetadataRequest(name="bitnet"), metadata=md),
            lambda md=md: list(stub.Generate(pb.GenerateRequest(text_input="x"), metadata=md)),
        ):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_is_imported_only_for_a_grpc_port():
    code = "import sys, bitnetlm.serve.server, bitnetlm.serve.app; assert 'grpc' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_cancelling_a_generate_call_stops_the_engine(server, stub):
    eng = server.engine
    before = eng.metrics.counters["request_cancelled_total"]
    opts = _params(max_tokens=400, temperature=0.0, ignore_eos=True)
    call = stub.Generate(pb.GenerateRequest(text_input="Hello", parameters=opts), metadata=AUTH)
    for _ in range(3):
        next(call)
    assert eng.stats()["running"] == 1
    call.cancel()
    deadline = time.monotonic() + 30
    while eng.metrics.counters["request_cancelled_total"] == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.metrics.counters["request_cancelled_total"] == before + 1
    while eng.stats()["rows_in_use"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.stats()["running"] == 0 and eng.stats()["rows_in_use"] == 0


def test_committed_stubs_equal_freshly_generated(tmp_path):
    pytest.importorskip("grpc_tools")
    subprocess.run([sys.executable, str(ROOT / "scripts/gen_grpc.py"), "--out", str(tmp_path)], check=True)
    for name in ("inference_pb2.py", "inference_pb2_grpc.py"):
        fresh = (tmp_path / "bitnetlm/serve/kserve" / name).read_text()
        assert fresh == (ROOT / "bitnetlm/serve/kserve" / name).read_text(), (
            f"{name} is stale: run scripts/gen_grpc.py"
        )


def test_a_grpc_port_in_use_stops_the_server_with_one_line():
    import socket

    model, tok = tiny_model_and_tokenizer(max_len=64)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        h = start(model, tok, port=0, grpc_port=port, log_level="critical")
        h.thread.join(30)
    assert not h.thread.is_alive()
    assert h.error.startswith(f"cannot listen on 127.0.0.1:{port} (gRPC):") and "\n" not in h.error
