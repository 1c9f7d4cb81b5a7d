"""POST /v1/embeddings on a real server through the official openai client: a served decoder (checked against
transformers' pooled final hidden state) and a served encoder (checked against offline `bitnetlm.embed`)."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import threading
import time

import grpc
import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
import websockets
from oracle import embedder_tokenizer, make_checkpoint, oracle_model
from oracle_bert import make_bert
from serve_parts import tiny_model_and_tokenizer

import bitnetlm
from bitnetlm.generate import SamplingParams, generate
from bitnetlm.loading import load_for_generation
from bitnetlm.serve import start
from bitnetlm.serve.engine import Engine, EngineClosed, Failed, Finished, GenerationRequest
from bitnetlm.serve.kserve import inference_pb2 as pb
from bitnetlm.serve.kserve import inference_pb2_grpc as pb_grpc

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TEXTS = [
    "It is a truth universally acknowledged.",
    "A single man in possession of a good fortune must be in want of a wife.",
    "views",
]


@pytest.fixture(scope="module")
def decoder_dir(tmp_path_factory):
    """A tiny ternary BitNet written by transformers (its oracle dir beside it), declared Matryoshka."""
    path = tmp_path_factory.mktemp("dec") / "m"
    oracle = make_checkpoint(path, "packed-autobitlinear", seed=3)
    embedder_tokenizer().save(path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "is_matryoshka": True}))
    return path, oracle


@pytest.fixture(scope="module")
def decoder(decoder_dir):
    with start(path=decoder_dir[0], model_name="dec", port=0, log_level="warning", prefill_chunk=16) as h:
        c = openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        _wait_ready(h)
        yield h, c


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    path = make_bert(tmp_path_factory.mktemp("enc") / "bert", "packed-autobitlinear", pooling=("mean",))
    with start(path=path, model_name="enc", port=0, grpc_port=0, log_level="warning") as h:
        c = openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        _wait_ready(h)
        yield path, h, c


def _wait_ready(h, timeout=60.0):
    """Until /health says the model is loaded (it loads on a thread)."""
    deadline = time.monotonic() + timeout
    while httpx.get(h.url + "/health").status_code != 200:
        assert time.monotonic() < deadline, "server did not load"
        time.sleep(0.05)


def _vectors(resp) -> torch.Tensor:
    return torch.tensor([d.embedding for d in sorted(resp.data, key=lambda d: d.index)])


def _post(h, body):
    return httpx.post(h.url + "/v1/embeddings", json=body, timeout=60)


def test_decoder_vectors_equal_transformers_pooled_hidden_state(decoder, decoder_dir):
    h, c = decoder
    r = c.embeddings.create(model="dec", input=TEXTS)  # the client asks for base64 and decodes it
    got = _vectors(r)
    tok = embedder_tokenizer()
    ref = oracle_model(decoder_dir[1])
    want = []
    for ids in tok.encode_batch(TEXTS):
        with torch.no_grad():
            hs = ref(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]
        want.append(F.normalize(hs[0, -1], dim=-1))
    assert got.shape == (3, 64)
    assert torch.allclose(got, torch.stack(want), atol=2e-4, rtol=0), (got - torch.stack(want)).abs().max()
    assert torch.allclose(got.norm(dim=-1), torch.ones(3), atol=1e-5)
    assert r.model == "dec" and r.object == "list" and [d.index for d in r.data] == [0, 1, 2]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, tok.encode_batch(TEXTS)))
    model, tok2 = bitnetlm.load(decoder_dir[0])
    assert torch.allclose(got, bitnetlm.embed(model, tok2, TEXTS), atol=1e-6, rtol=0)


def test_identical_batch_single_base64_float_and_token_ids(decoder):
    h, c = decoder
    batch = _vectors(c.embeddings.create(model="dec", input=[TEXTS[1], TEXTS[0], TEXTS[1]]))
    assert torch.equal(batch[0], batch[2])  # identical inputs, identical vectors
    single = _vectors(c.embeddings.create(model="dec", input=TEXTS[1]))
    assert torch.allclose(batch[0], single[0], atol=1e-6, rtol=0)  # (batched in other company)
    floats = c.embeddings.create(model="dec", input=TEXTS[1], encoding_format="float").data[0].embedding
    raw = c.embeddings.create(model="dec", input=TEXTS[1], encoding_format="base64").data[0].embedding
    decoded = list(struct.unpack(f"<{len(floats)}f", base64.b64decode(raw)))
    assert decoded == floats  # little-endian float32, exactly the float list
    assert torch.equal(single[0], torch.tensor(floats))
    ids = embedder_tokenizer().encode_batch(TEXTS[:2])
    by_ids = _vectors(c.embeddings.create(model="dec", input=ids))
    assert torch.equal(_vectors(c.embeddings.create(model="dec", input=ids[1]))[0], by_ids[1])
    texts = _vectors(c.embeddings.create(model="dec", input=TEXTS[:2]))
    assert torch.allclose(by_ids, texts, atol=1e-6, rtol=0)


def test_dimensions_on_a_matryoshka_decoder_and_a_plain_encoder(decoder, encoder):
    h, c = decoder
    full = _vectors(c.embeddings.create(model="dec", input=TEXTS[0], encoding_format="float"))[0]
    cut = _vectors(c.embeddings.create(model="dec", input=TEXTS[0], dimensions=16, encoding_format="float"))[
        0
    ]
    assert cut.shape == (16,) and torch.allclose(cut, F.normalize(full[:16], dim=0), atol=1e-6)
    r = _post(h, {"input": "x", "dimensions": 65})
    assert (
        r.status_code == 400
        and r.json()["error"]["param"] == "dimensions"
        and "64" in r.json()["error"]["message"]
    )
    _, eh, ec = encoder
    assert (
        len(ec.embeddings.create(model="enc", input="x", dimensions=64).data[0].embedding) == 64
    )  # full size
    with pytest.raises(openai.BadRequestError, match="does not support matryoshka representation") as e:
        ec.embeddings.create(model="enc", input="x", dimensions=16)
    assert e.value.body["param"] == "dimensions"


@pytest.mark.parametrize(
    "body,param,text",
    [
        ({"input": ""}, "input", "'input' must not be empty"),
        ({"input": []}, "input", "must not be an empty list"),
        ({"input": ["a", ""]}, "input", "'input[1]' must not be empty"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
        ({"input": "a " * 300}, "input", "maximum context length is 256 tokens"),
        ({"input": [[1, 2], [5000]]}, "input", "token id 5000 is outside the vocabulary [0, 512)"),
        ({"input": "a", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
        ({"input": "a", "stream": True}, "stream", "Unsupported parameter"),
        (
            {"input": [1, "a"]},
            "input",
            "expected a string, a list of strings, a list of token ids or a list of",
        ),
        ({"input": [[1], [True]]}, "input", "expected a string, a list of strings, a list of token ids"),
        ({"input": None}, "input", "expected a string, a list of strings"),
        (
            {"input": "a", "truncate_prompt_tokens": 0},
            "truncate_prompt_tokens",
            "a positive number of tokens",
        ),
    ],
)
def test_errors_are_one_line_400s(decoder, body, param, text):
    h, _ = decoder
    r = _post(h, {"model": "dec", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and text in err["message"] and "\n" not in err["message"], err


def test_truncate_prompt_tokens_cuts_as_vllm_names_it(decoder):
    h, c = decoder
    long = "the truth of a single man " * 60
    r = c.embeddings.create(model="dec", input=long, extra_body={"truncate_prompt_tokens": 20}, user="u1")
    assert r.usage.prompt_tokens == 20
    tok = embedder_tokenizer()
    ids = tok.encode_batch([long], False)[0][:19] + [
        tok.backend.token_to_id("<|endoftext|>")
    ]  # (end token kept)
    same = c.embeddings.create(model="dec", input=ids)
    assert torch.allclose(_vectors(r), _vectors(same), atol=1e-6, rtol=0)
    assert (
        c.embeddings.create(
            model="dec", input=long, extra_body={"truncate_prompt_tokens": -1}
        ).usage.prompt_tokens
        == 256
    )


def test_generation_goes_on_beside_embeddings(decoder, decoder_dir):
    """Embeddings run on the engine thread between steps: a greedy stream beside them is unchanged."""
    h, c = decoder
    model, tok = load_for_generation(decoder_dir[0])
    want = str(
        generate(model, tok, "It is a truth", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    )

    async def main():
        async with openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="u", max_retries=0, timeout=60) as ac:

            async def gen():
                s = await ac.completions.create(model="dec", prompt="It is a truth", max_tokens=40, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})  # fmt: skip
                return "".join([ch.choices[0].text async for ch in s])

            async def emb():
                return [await ac.embeddings.create(model="dec", input=TEXTS * 8) for _ in range(4)]

            return await asyncio.gather(gen(), emb())

    text, embs = asyncio.run(main())
    assert text == want
    assert all(len(e.data) == 24 for e in embs)


def test_engine_call_runs_on_the_engine_thread(decoder):
    h, _ = decoder
    fut = h.engine.call(lambda a: (threading.current_thread().name, a), 7)
    assert fut.result(timeout=30) == ("bitnet-engine", 7)
    fut = h.engine.call(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        fut.result(timeout=30)
    assert h.engine.call(lambda: "still serving").result(timeout=30) == "still serving"
    model, tok = tiny_model_and_tokenizer(max_len=64)
    e = Engine(model, tok)
    e.shutdown()
    with pytest.raises(EngineClosed, match="shutting down"):
        e.call(print)


def test_calls_leave_running_sequences_half_the_engine_thread():
    """After a call, the engine steps its running sequences for as long as the call took before the next one: a
    queue of calls never runs back to back while a sequence decodes (no timing asserted: step counts)."""
    model, tok = tiny_model_and_tokenizer(max_len=2048)
    e = Engine(model, tok)
    try:
        done = threading.Event()
        p = SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True)
        e.submit(
            GenerationRequest(tok.encode("fox"), p),
            lambda ev: isinstance(ev, (Finished, Failed)) and done.set(),
        )
        while e.steps < 2:
            time.sleep(0.001)

        def slow():
            time.sleep(0.05)
            return e.steps

        at = [f.result(timeout=60) for f in [e.call(slow) for _ in range(4)]]
        assert not done.is_set()  # (the sequence ran throughout)
        assert all(b - a >= 3 for a, b in zip(at, at[1:])), at
    finally:
        e.shutdown(drain=False)


def test_served_encoder_equals_offline_embed_and_refuses_generation(encoder):
    path, h, c = encoder
    got = _vectors(c.embeddings.create(model="enc", input=TEXTS))
    model, tok = bitnetlm.load(path)
    assert torch.allclose(got, bitnetlm.embed(model, tok, TEXTS), atol=1e-6, rtol=0)
    assert [m.id for m in c.models.list().data] == ["enc"]
    for call in (
        lambda: c.chat.completions.create(model="enc", messages=[{"role": "user", "content": "hi"}]),
        lambda: c.completions.create(model="enc", prompt="hi"),
    ):
        with pytest.raises(openai.BadRequestError, match="model 'enc' is an embedding model") as e:
            call()
        assert e.value.body["param"] == "model"

    async def ws_chat():
        async with websockets.connect(h.url.replace("http://", "ws://") + "/v1/ws") as ws:
            await ws.send(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
            return json.loads(await ws.recv())

    err = asyncio.run(ws_chat())["error"]
    assert "model 'enc' is an embedding model" in err["message"] and err["param"] == "model"
    with grpc.insecure_channel(f"127.0.0.1:{h.grpc_port}") as channel:
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.GRPCInferenceServiceStub(channel).Generate(pb.GenerateRequest(text_input="hi")))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model 'enc' is an embedding model" in e.value.details()
    r = httpx.post(h.url + "/v1/embeddings", json={"input": "hello " * 200})
    assert r.status_code == 400 and "maximum context length is 128 tokens" in r.json()["error"]["message"]
    assert httpx.get(h.url + "/metrics").status_code == 200
