"""The served model a request names: its engine and tokenizer, for the protocols beside the HTTP routes."""

from __future__ import annotations

from bitnetlm.serve import protocol as P


def ready(st) -> bool:
    """The server takes requests: its model is loaded and it is not shutting down."""
    return st.engine is not None and st.engine.accepting


def served(st, name: str | None):
    """(engine, tokenizer, model name) for `name` (None or '' = the default), else APIError: 503 while loading
    or shutting down, 404 naming the served model for an unknown name."""
    if st.engine is None:
        msg = f"model failed to load: {st.error}" if st.error else "model is loading"
        raise P.APIError(503, msg, type="server_error", code="model_loading", headers={"Retry-After": "5"})
    if not st.engine.accepting:
        raise P.APIError(503, "server is shutting down", type="server_error", code="shutting_down")
    if name not in (None, "", st.cfg.model_name):
        raise P.APIError(
            404, f"The model {name!r} does not exist; this server serves {st.cfg.model_name!r}.",
            type="not_found_error", param="model", code="model_not_found",
        )  # fmt: skip
    return st.engine, st.tokenizer, st.cfg.model_name
