"""The served models: a registry of named models, each with its own engine, swapped and unloaded while serving.

A request picks a model by its `model` field (none or "" = the default) and holds it until the request ends
(`acquire` / `release`). Loading a name that is served already swaps it: the new engine takes every request
that picks the name from then on, while the requests holding the old one finish on it; then the old engine
stops and its model is freed (`_retire`). Loading runs on a thread, off the event loop; a load that fails leaves
the registry as it was. Everything else runs on the event loop's thread, so the counts need no lock.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bitnetlm.serve import protocol as P

log = logging.getLogger("bitnetlm.serve")
Loader = Callable[[], tuple[Any, Any]]  # () -> (model, tokenizer)


@dataclass(eq=False)
class Served:
    """One served model: its engine and tokenizer, where it came from (`loader`: None for an in-memory model,
    which cannot be reloaded) and how many requests hold it."""

    name: str
    engine: Any
    tokenizer: Any
    loader: Loader | None = None
    source: str | None = None  # the path or zoo name it was loaded from, as given
    created: int = field(default_factory=lambda: int(time.time()))
    users: int = 0

    def card(self) -> dict:
        """The /v1/models entry."""
        return {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "bitnet-lm",
            "max_model_len": self.engine.max_model_len,
        }


class Registry:
    """The server's models by name; `build(name, model, tokenizer)` makes an engine (called on a loading thread)."""

    def __init__(self, default: str, max_models: int, build: Callable[[str, Any, Any], Any]):
        self.default, self.max_models, self.build = default, max_models, build
        self.models: dict[str, Served] = {}
        self.retiring: set[Served] = set()  # swapped out or unloaded, finishing their running requests
        self._tasks: set[asyncio.Task] = set()
        self._lock: asyncio.Lock | None = None  # one load or unload at a time (made on the loop)

    # ---- picking (the event loop) --------------------------------------------------------------
    def get(self, name: str | None) -> Served | None:
        return self.models.get(name or self.default)

    def acquire(self, name: str | None) -> Served:
        """The model `name` names, held until `release`; 404 naming the served models for an unknown name."""
        s = self.get(name)
        if s is None:
            if not name or name == self.default:  # loading, or failed to: the caller says which
                raise LookupError(self.default)
            names = ", ".join(repr(n) for n in self.models)
            raise P.APIError(
                404, f"The model {name!r} does not exist; this server serves {names}.",
                type="not_found_error", param="model", code="model_not_found",
            )  # fmt: skip
        s.users += 1
        return s

    @staticmethod
    def release(s: Served) -> None:
        s.users -= 1

    def add(self, s: Served) -> Served | None:
        """Serve `s` under its name; returns the model it replaced (now retiring), if any."""
        old = self.models.get(s.name)
        self.models[s.name] = s
        return old

    def engines(self) -> list:
        return [s.engine for s in [*self.models.values(), *self.retiring]]

    # ---- loading and unloading (the event loop; the work on threads) ----------------------------
    def _locked(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def load(self, name: str, loader: Loader, source: str | None = None) -> tuple[Served, bool]:
        """Load `loader`'s model as `name` on a thread and serve it: (the new entry, whether it replaced one).
        ValueError with one line when it cannot load or the budget is full; the served models stay as they were."""
        async with self._locked():
            if name not in self.models and len(self.models) >= self.max_models:
                raise ValueError(
                    f"cannot load {name!r}: {len(self.models)} models are served, the most this server holds "
                    f"(--max-models {self.max_models}); unload one first"
                )
            s = await asyncio.to_thread(self._make, name, loader, source)
            old = self.add(s)
            if old is not None:
                self._retire(old)
            log.info("model %s %s from %s", name, "swapped in" if old else "loaded", source)
            return s, old is not None

    def _make(self, name: str, loader: Loader, source: str | None) -> Served:
        try:
            model, tokenizer = loader()
            engine = self.build(name, model, tokenizer)
        except Exception as e:
            log.debug("loading %s failed", name, exc_info=True)
            raise ValueError(f"cannot load {name!r} from {source}: {reason(e)}") from None
        return Served(name, engine, tokenizer, loader, source)

    async def reload(self, name: str | None = None) -> tuple[Served, bool]:
        """Load model `name` (the default) again from where it came from."""
        s = self.get(name)
        if s is None or s.loader is None:
            raise ValueError(f"cannot reload {name or self.default!r}: it was not loaded from a path")
        return await self.load(s.name, s.loader, s.source)

    async def unload(self, name: str) -> None:
        """Stop serving `name`: new requests get 404; running ones finish, then its engine stops."""
        async with self._locked():
            if name == self.default:
                raise ValueError(
                    f"cannot unload the default model {name!r}; load another model under its name to replace it"
                )
            s = self.models.pop(name, None)
            if s is None:
                raise LookupError(name)
            self._retire(s)

    def _retire(self, s: Served) -> None:
        self.retiring.add(s)
        task = asyncio.get_running_loop().create_task(self._drain(s))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self, s: Served) -> None:
        """Once no request holds `s`, stop its engine (every request it took has ended by then) and free it."""
        while s.users:
            await asyncio.sleep(0.01)
        engine, s.engine = s.engine, None
        await asyncio.to_thread(engine.shutdown, True, None)
        self.retiring.discard(s)
        del engine
        gc.collect()  # (the engine holds reference cycles: its metrics' gauges)
        _free_device_memory()
        log.info("model %s (from %s) stopped and freed", s.name, s.source)

    async def close(self, drain_s: float) -> None:
        """Stop every engine (at server shutdown), letting running requests finish within `drain_s`."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(asyncio.to_thread(e.shutdown, True, drain_s) for e in self.engines() if e))


def _free_device_memory() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def reason(e: BaseException) -> str:
    """A failure as one line: the message of the errors a user can fix, else the type and its first line."""
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    if isinstance(e, (ValueError, OSError)) and first:
        return first
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


# ---- the model a request names, for the routes and the other protocols --------------------------------
def ready(st) -> bool:
    """The server takes requests: its default model is loaded and it is not shutting down."""
    return st.engine is not None and st.engine.accepting


def pick(st, name: str | None) -> Served:
    """The served model `name` names (None or '' = the default), held until `Registry.release`; APIError: 503
    while the default loads, failed to load or the server shuts down, 404 for an unknown name."""
    try:
        s = st.models.acquire(name)
    except LookupError:
        msg = f"model failed to load: {st.error}" if st.error else "model is loading"
        raise P.APIError(
            503, msg, type="server_error", code="model_loading", headers={"Retry-After": "5"}
        ) from None
    if not s.engine.accepting:  # (only at shutdown: a swapped-out engine is no longer picked)
        st.models.release(s)
        raise P.APIError(503, "server is shutting down", type="server_error", code="shutting_down")
    return s


def hold(request, name: str | None) -> Served:
    """`pick` for an HTTP request: released when the request ends, its response body (a stream) sent
    (`ReleaseAtEnd`)."""
    s = pick(request.app.state.bitnet, name)
    request.scope["bitnet.held"].append(s)
    return s


class ReleaseAtEnd:
    """ASGI middleware: releases the models an HTTP request held (`hold`) once the app is done with it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held = scope["bitnet.held"] = []
        try:
            await self.app(scope, receive, send)
        finally:
            for s in held:
                Registry.release(s)
