"""A request's CPU work off the event loop: parsing its body, rendering the chat template, tokenizing and
detokenizing, on a bounded pool of threads (as vLLM's tokenizer executor).

On the loop, a 1 MB prompt's tokenization stalls every stream and /health for the whole of it, and eight of them
for eight times as long. On the pool the loop keeps running: the tokenizer's `encode_batch` releases the GIL
while it works (its `encode` holds it throughout, so every encode here goes through `encode_batch`), and Python
work (JSON checks, the template) gives the GIL back at every switch interval. The pool's size bounds how much
of it runs at once beside the engine's thread; more waits in the pool's queue.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bitnetlm.serve import protocol as P
from bitnetlm.serve.body import parse_json
from bitnetlm.serve.tools import Tools, supports_tools, template_messages


class Offload:
    """The pool (`threads` workers) and the work the routes hand it."""

    def __init__(self, threads: int):
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="bitnet-offload")

    async def run(self, fn, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def json(self, raw: bytes) -> Any:
        # a small body costs less than the trip through the pool
        return parse_json(raw) if len(raw) < 16384 else await self.run(parse_json, raw)

    async def encode(self, tokenizer, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return await self.run(tokenizer.encode_batch, texts, add_special_tokens) if texts else []

    async def chat(
        self,
        tokenizer,
        messages: list[P.ChatMessage],
        add_generation_prompt: bool,
        tools: Tools | None = None,
    ) -> list[int]:
        return await self.run(_chat_ids, tokenizer, messages, add_generation_prompt, tools)

    async def decode(self, tokenizer, ids: list[int]) -> str:
        return await self.run(tokenizer.decode, ids)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _chat_ids(
    tokenizer, messages: list[P.ChatMessage], add_generation_prompt: bool, tools: Tools | None = None
) -> list[int]:
    """The template's text encoded without added special tokens: what apply_chat_template(tokenize=True) gives.
    Tools go to a template that renders them, else into a system message (serve/tools.py)."""
    native = supports_tools(tokenizer.chat_template)
    msgs = template_messages(messages, tools, native)
    funcs = [{"type": "function", "function": f} for f in tools.functions] if tools and native else None
    try:
        text = tokenizer.apply_chat_template(
            msgs, add_generation_prompt=add_generation_prompt, tokenize=False, tools=funcs
        )
    except Exception as ex:  # template errors (raise_exception) are the caller's fault
        raise P.APIError(400, f"chat template: {ex}", param="messages") from None
    return tokenizer.encode_batch([text], add_special_tokens=False)[0]
