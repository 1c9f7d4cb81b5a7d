"""POST /v1/embeddings on a loopback server: embedding throughput, and what it costs a generation stream beside it.

    python benchmarks/serve_embeddings.py -m MODEL [--inputs 1,16,64] [--clients 1,4] [--threads 2] [--device cpu]

- throughput: inputs/s and tokens/s of /v1/embeddings for requests of --inputs texts (Austen sentences) from
  --clients concurrent clients (the official openai client, base64 vectors, as it asks by default);
- interference (decoders): one greedy completion stream's tokens/s alone, and beside clients sending embedding
  requests all the while (a decoder's embedding forwards run on its engine thread between generation steps).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import common

SENTENCES = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
    "the rightful property of some one or other of their daughters."
).split(", ")


def _texts(n: int, k: int) -> list[str]:
    return [f"{SENTENCES[(k + i) % len(SENTENCES)]} ({k}.{i})" for i in range(n)]


async def throughput(client, inputs: int, clients: int, seconds: float) -> tuple[float, float]:
    """(inputs/s, tokens/s) of `clients` clients each sending requests of `inputs` texts for `seconds`."""
    done, tokens, stop = [0], [0], time.perf_counter() + seconds

    async def worker(w):
        k = 0
        while time.perf_counter() < stop:
            r = await client.embeddings.create(model="m", input=_texts(inputs, 1000 * w + k))
            done[0] += len(r.data)
            tokens[0] += r.usage.prompt_tokens
            k += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(clients)))
    wall = time.perf_counter() - t0
    return done[0] / wall, tokens[0] / wall


async def stream_speed(client, max_tokens: int) -> float:
    """Completion tokens/s of one greedy stream (from its first token to its last)."""
    s = await client.completions.create(
        model="m", prompt="It is a truth", max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    first, n = None, 0
    async for chunk in s:
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter()
            n += 1
    return (n - 1) / (time.perf_counter() - first)


async def interference(client, max_tokens: int, clients: int, inputs: int) -> tuple[float, float]:
    """(stream tokens/s alone, beside `clients` clients embedding requests of `inputs` texts)."""
    alone = await stream_speed(client, max_tokens)
    busy = [True]

    async def embedder(w):
        k = 0
        while busy[0]:
            await client.embeddings.create(model="m", input=_texts(inputs, 1000 * w + k))
            k += 1

    tasks = [asyncio.ensure_future(embedder(w)) for w in range(clients)]
    await asyncio.sleep(0.5)
    beside = await stream_speed(client, max_tokens)
    busy[0] = False
    await asyncio.gather(*tasks)
    return alone, beside


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True, help="model directory, .gguf file or zoo name")
    ap.add_argument("--inputs", type=common.int_list, default=[1, 16, 64], help="texts per request (1,16,64)")
    ap.add_argument("--clients", type=common.int_list, default=[1, 4], help="concurrent clients (1,4)")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds per throughput row (default: 5)")
    ap.add_argument(
        "--max-tokens", type=int, default=128, help="the stream's completion tokens (default: 128)"
    )
    ap.add_argument("--threads", type=int, default=None, help="server --threads")
    ap.add_argument("--device", default=None, help="server --device")
    args = ap.parse_args(argv)
    common.use_checkout()
    import openai

    from bitnetlm.models.bert import Encoder
    from bitnetlm.serve import start

    rt = {k: v for k, v in (("threads", args.threads), ("device", args.device)) if v is not None}
    with start(path=args.model, model_name="m", port=0, log_level="warning", **rt) as h:
        while h.engine is None:
            time.sleep(0.1)
        encoder = isinstance(h.engine.model, Encoder)

        async def run():
            async with openai.AsyncOpenAI(
                base_url=h.url + "/v1", api_key="-", max_retries=0, timeout=600
            ) as c:
                rows = []
                for n in args.inputs:
                    for k in args.clients:
                        per_s, tok_s = await throughput(c, n, k, args.seconds)
                        rows.append([str(n), str(k), f"{per_s:.1f}", f"{tok_s:.0f}"])
                side = None if encoder else await interference(c, args.max_tokens, max(args.clients), 16)
                return rows, side

        rows, side = asyncio.run(run())
    common.header(
        "POST /v1/embeddings on a loopback server",
        gpu=(args.device or "").startswith("cuda"),
        details=f"model {args.model}; texts of ~10-40 tokens; {args.seconds:g} s per row",
    )
    print(common.table(["inputs / request", "clients", "inputs/s", "tokens/s"], rows, [True] * 4))
    if side is not None:
        print(
            f"\nA greedy stream of {args.max_tokens} tokens: {side[0]:.1f} tokens/s alone, {side[1]:.1f} tokens/s "
            f"beside {max(args.clients)} clients sending 16-text embedding requests."
        )


if __name__ == "__main__":
    main()
