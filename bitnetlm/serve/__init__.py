"""OpenAI-compatible serving: protocol (pydantic), engine (continuous batching), app (HTTP), metrics, web page.

`serve(model_path, ...)` runs the server in the foreground; `start(...)` runs one on a background thread.
"""


def __getattr__(name):
    # lazy: importing bitnetlm.serve.engine must not pull in FastAPI
    if name in ("serve", "start"):
        from bitnetlm.serve import server

        return getattr(server, name)
    raise AttributeError(f"module 'bitnetlm.serve' has no attribute {name!r}")


__all__ = ["serve", "start"]
