"""FastAPI's /openapi.json and /docs on a real server: served, and guarded by the API key like every route."""

from __future__ import annotations

import httpx
import pytest
from serve_parts import tiny_model_and_tokenizer

from bitnetlm.serve import start

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("key", [None, "s3cret"])
def test_openapi_and_docs_are_served_and_need_the_key(key):
    model, tok = tiny_model_and_tokenizer(max_len=64)
    with start(model, tok, port=0, api_key=key, log_level="warning") as h:
        ok = {"Authorization": f"Bearer {key}"} if key else {}
        if key:
            for path in ("/openapi.json", "/docs"):
                r = httpx.get(h.url + path)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
                assert httpx.get(h.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        schema = httpx.get(h.url + "/openapi.json", headers=ok)
        assert schema.status_code == 200
        assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(schema.json()["paths"])
        page = httpx.get(h.url + "/docs", headers=ok)
        assert page.status_code == 200 and "swagger" in page.text.lower() and "/openapi.json" in page.text
