"""gRPC beside HTTP (`bitnet serve --grpc-port P`): the KServe Open Inference Protocol v2 and a streaming Generate
call (kserve/inference.proto), on the same event loop and the same engine as the HTTP routes.

ModelInfer takes a BYTES input "text_input" (one prompt per element, as /v1/completions' `prompt`) and returns a
BYTES output "text_output"; the sampling options are request parameters named and checked as the completions
body's (max_tokens, temperature, top_p, top_k, min_p, seed, stop, ignore_eos, ...), so a request gets what the
same HTTP request gets. Auth: with an API key set, every call but ServerLive / ServerReady (health, as /health)
needs the metadata `authorization: Bearer KEY` (or `x-api-key: KEY`), as HTTP. Errors carry the HTTP route's
message with the matching status code (400 -> INVALID_ARGUMENT, 404 -> NOT_FOUND, 429 -> RESOURCE_EXHAUSTED,
503 -> UNAVAILABLE, ...).
grpcio is imported only when a gRPC port is asked for.
"""

from __future__ import annotations

import hmac
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import grpc

from bitnetlm.serve import protocol as P
from bitnetlm.serve.kserve import inference_pb2 as pb
from bitnetlm.serve.kserve import inference_pb2_grpc as pb_grpc
from bitnetlm.serve.models import Served, pick, ready
from bitnetlm.serve.relay import CUT, Run
from bitnetlm.serve.requests import Chunk, Failed, Finished
from bitnetlm.serve.routes import _params

INPUT, OUTPUT = "text_input", "text_output"
_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
}


def _param(p: pb.InferParameter) -> Any:
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def _raw_strings(raw: bytes) -> list[bytes]:
    """A BYTES tensor's raw contents: each element a 4-byte little-endian length, then its bytes."""
    out, i = [], 0
    while i < len(raw):
        if i + 4 > len(raw):
            raise P.APIError(400, f"raw_input_contents: a length prefix is cut short at byte {i}")
        (n,) = struct.unpack_from("<I", raw, i)
        if i + 4 + n > len(raw):
            raise P.APIError(400, f"raw_input_contents: element of {n} bytes runs past the end at byte {i}")
        out.append(raw[i + 4 : i + 4 + n])
        i += 4 + n
    return out


def _prompts(request: pb.ModelInferRequest) -> tuple[list[str], bool]:
    """The prompts of the "text_input" tensor, and whether they came as raw_input_contents."""
    names = [t.name for t in request.inputs]
    if names != [INPUT]:
        raise P.APIError(400, f"inputs: expected one tensor named {INPUT!r}, found {names}", param="inputs")
    t = request.inputs[0]
    if t.datatype != "BYTES":
        raise P.APIError(400, f"input {INPUT!r}: expected datatype BYTES, found {t.datatype!r}", param=INPUT)
    raw = bool(request.raw_input_contents)
    items = _raw_strings(request.raw_input_contents[0]) if raw else list(t.contents.bytes_contents)
    count = 1
    for d in t.shape:
        count *= d
    if not items or count != len(items):
        raise P.APIError(
            400, f"input {INPUT!r}: shape {list(t.shape)} holds {len(items)} elements", param=INPUT
        )
    try:
        return [b.decode("utf-8") for b in items], raw
    except UnicodeDecodeError as e:
        raise P.APIError(400, f"input {INPUT!r}: not UTF-8 text ({e.reason} at byte {e.start})") from None


class Servicer(pb_grpc.GRPCInferenceServiceServicer):
    """The calls of kserve/inference.proto over the server's state (app.state.bitnet)."""

    def __init__(self, state):
        self.st = state
        key = state.cfg.api_key
        self.key = key.encode() if key else None

    async def _check(self, context) -> None:
        """The HTTP rule: `authorization: Bearer KEY` (or `x-api-key: KEY`) when the server has a key."""
        if self.key is None:
            return
        md = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        given, auth = md.get("x-api-key", ""), md.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        if not hmac.compare_digest(given.encode(), self.key):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid or missing API key (metadata "
                                "'authorization: Bearer KEY')")  # fmt: skip

    def _served(self, name: str) -> Served:
        """The model `name` names ('' = the default), or APIError (404: unknown; 503: loading)."""
        s = pick(self.st, name)
        self.st.models.release(s)
        return s

    async def _abort(self, context, e: P.APIError):
        await context.abort(_CODES.get(e.status, grpc.StatusCode.INTERNAL), e.message)

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=ready(self.st))

    async def ModelReady(self, request, context):
        await self._check(context)
        try:
            self._served(request.name)
        except P.APIError as e:
            if e.status == 404:
                await self._abort(context, e)
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    async def ModelMetadata(self, request, context):
        await self._check(context)
        try:
            name = self._served(request.name).name
        except P.APIError as e:
            await self._abort(context, e)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=name,
            platform="bitnet-lm",
            inputs=[tensor(name=INPUT, datatype="BYTES", shape=[-1])],
            outputs=[tensor(name=OUTPUT, datatype="BYTES", shape=[-1])],
        )

    async def _submit(self, name: str, prompts: list[str], params: dict) -> tuple[Run, Any, int]:
        """Check the options as a completions body and submit: (run, model name, prompt tokens)."""
        unknown = sorted(
            set(params) & {"prompt", "model", "stream", "stream_options", "n", "echo", "logprobs"}
        )
        if unknown:
            raise P.APIError(
                400, f"Unsupported parameter(s): {', '.join(map(repr, unknown))}", param=unknown[0]
            )
        if len(prompts) > self.st.cfg.max_prompts:
            raise P.APIError(400, f"at most {self.st.cfg.max_prompts} prompts per request", param=INPUT)
        req = P.parse_request(P.CompletionRequest, {"prompt": prompts, **params})
        m = pick(self.st, name)
        try:  # held until submitted: a swap stops the old engine only once nobody is about to submit to it
            ids = await self.st.offload.encode(m.tokenizer, prompts)
            run = Run(m.engine)
            self.st.runs.add(run)
            run.submit(ids, _params(req, req.max_tokens, False, 0), 1)
        finally:
            self.st.models.release(m)
        return run, m.name, sum(map(len, ids))

    async def ModelInfer(self, request, context):
        await self._check(context)
        run = None
        try:
            prompts, raw = _prompts(request)
            params = {k: _param(v) for k, v in request.parameters.items()}
            run, name, _ = await self._submit(request.model_name, prompts, params)
            texts = [""] * len(prompts)
            async for i, ev in _events(run):
                if isinstance(ev, Chunk):
                    texts[i] += ev.text
                elif isinstance(ev, Failed):
                    raise P.APIError(ev.status, ev.message)
        except P.APIError as e:
            await self._abort(context, e)
        finally:
            if run is not None and run.open:  # failed, or the client went away (the task is cancelled)
                run.cancel()
        out = pb.ModelInferResponse.InferOutputTensor(name=OUTPUT, datatype="BYTES", shape=[len(texts)])
        data = [t.encode("utf-8") for t in texts]
        resp = pb.ModelInferResponse(model_name=name, id=request.id, outputs=[out])
        if raw:
            resp.raw_output_contents.append(b"".join(struct.pack("<I", len(b)) + b for b in data))
        else:
            resp.outputs[0].contents.bytes_contents.extend(data)
        return resp

    async def Generate(self, request, context):
        await self._check(context)
        run = None
        try:
            params = {k: _param(v) for k, v in request.parameters.items()}
            run, name, n_prompt = await self._submit(request.model_name, [request.text_input], params)
            finish = ""
            async for _, ev in _events(run):
                if isinstance(ev, Chunk):
                    finish = ev.finish_reason or finish
                    if ev.text:
                        yield pb.GenerateResponse(model_name=name, text_output=ev.text)
                elif isinstance(ev, Finished):
                    yield pb.GenerateResponse(
                        model_name=name,
                        finish_reason=finish,
                        prompt_tokens=n_prompt,
                        completion_tokens=ev.completion_tokens,
                    )
                elif isinstance(ev, Failed):
                    raise P.APIError(ev.status, ev.message)
        except P.APIError as e:
            await self._abort(context, e)
        finally:
            if run is not None and run.open:
                run.cancel()


async def _events(run: Run) -> AsyncIterator[tuple[int, Any]]:
    """(prompt index, event) until every group of `run` ended (the caller cancels the run if it stops early)."""
    while run.open:
        i, ev = await run.queue.get()
        if i is CUT:
            yield 0, ev
            return
        if isinstance(ev, (Finished, Failed)):
            run.open -= 1
        yield i, ev


async def start_grpc(state, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """A started gRPC server on (host, port) serving `state`'s models; ValueError naming the address when it
    cannot listen. Returns it and its port (the one picked when `port` is 0)."""
    addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if port:  # a port in use named in one line here, before gRPC's own log line about it
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            try:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
                probe.bind((host, port))
            except OSError as e:
                raise ValueError(f"cannot listen on {addr} (gRPC): {e.strerror or e}") from None
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(state), server)
    try:
        bound = server.add_insecure_port(addr)
    except RuntimeError as e:
        bound, why = 0, str(e).splitlines()[0] if str(e) else "cannot bind"
    else:
        why = "address in use or not available"
    if not bound:
        raise ValueError(f"cannot listen on {addr} (gRPC): {why}")
    await server.start()
    return server, bound
