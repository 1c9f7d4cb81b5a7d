"""`POST /v1/admin/models`: load, unload and list the served models while serving.

    {"action": "list"}
    {"action": "load", "name": "NAME", "path": "PATH or zoo name"}   # a served NAME is swapped
    {"action": "unload", "name": "NAME"}

Loads run on a thread with the server's runtime options; a load that fails is a 400 with one line and leaves
every model serving as before. With an API key the route needs it like every route; without one it answers 403
unless the server was started with --allow-admin (an open server should not load files on request).
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request

from bitnetlm.serve import protocol as P
from bitnetlm.serve.body import read_body

admin_router = APIRouter()


class AdminRequest(P._Strict):
    action: Literal["load", "unload", "list"]
    name: str | None = None
    path: str | None = None


def _loader(path: str, runtime):
    def load():
        from bitnetlm.loading import load_for_generation

        return load_for_generation(path, runtime)

    return load


def _listing(st) -> list[dict]:
    out = []
    for s in st.models.models.values():
        stats = s.engine.stats()
        out.append(
            {**s.card(), "path": s.source, "default": s.name == st.cfg.model_name,
             "running": stats["running"], "waiting": stats["waiting"]}
        )  # fmt: skip
    return out


@admin_router.post("/v1/admin/models")
async def admin_models(request: Request):
    st = request.app.state.bitnet
    if st.cfg.api_key is None and not st.cfg.allow_admin:
        raise P.APIError(
            403, "the admin routes need an API key (--api-key) or --allow-admin", type="permission_error",
            code="admin_disabled",
        )  # fmt: skip
    if st.engine is None:  # (a load now would race the default model's own)
        raise P.APIError(
            503, "the default model is not loaded yet", type="server_error", code="model_loading"
        )
    body = await st.offload.json(await read_body(request, st.cfg.max_body_bytes))
    req = P.parse_simple(AdminRequest, body)
    if req.action == "list":
        return {"object": "list", "data": _listing(st)}
    if not req.name:
        raise P.APIError(400, f"action {req.action!r} needs a model 'name'", param="name")
    if req.action == "unload":
        try:
            await st.models.unload(req.name)
        except LookupError:
            names = ", ".join(repr(n) for n in st.models.models)
            raise P.APIError(
                404, f"The model {req.name!r} does not exist; this server serves {names}.",
                type="not_found_error", param="name", code="model_not_found",
            ) from None  # fmt: skip
        except ValueError as e:
            raise P.APIError(400, str(e), param="name") from None
        return {"status": "unloaded", "name": req.name, "data": _listing(st)}
    if not req.path:
        raise P.APIError(
            400, "action 'load' needs a 'path' (a model directory, .gguf file or zoo name)", param="path"
        )
    try:
        s, replaced = await st.models.load(req.name, _loader(req.path, st.cfg.runtime), req.path)
    except ValueError as e:
        raise P.APIError(400, str(e), param="path", code="model_load_failed") from None
    return {"status": "swapped" if replaced else "loaded", "name": s.name, "data": _listing(st)}
