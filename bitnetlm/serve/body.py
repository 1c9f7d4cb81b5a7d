"""Request bodies: read up to a size limit (`read_body`), parsed (`parse_json`) as standard JSON no deeper
than MAX_DEPTH, with no lone surrogates in any string.

Python's json module accepts what a client can send but the rest of the server cannot use: NaN and Infinity
(not JSON), nesting up to the interpreter's recursion limit (a RecursionError), and "\\ud800" escapes that make
a string no UTF-8 can encode (the tokenizer, and every JSON response naming it, would fail). Each is a 400 here.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.requests import ClientDisconnect, Request

from bitnetlm.serve.protocol import APIError

log = logging.getLogger("bitnetlm.serve")
MAX_DEPTH = 64  # nesting of JSON arrays and objects; no request of the API needs more than 4


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body: 413 beyond `limit` bytes; a client gone before its end is one log line and a 499."""
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise APIError(413, f"request body is {cl} bytes; the limit is {limit}", code="request_too_large")
    buf = bytearray()
    try:
        async for part in request.stream():
            buf += part
            if len(buf) > limit:
                raise APIError(
                    413, f"request body exceeds the limit of {limit} bytes", code="request_too_large"
                )
    except ClientDisconnect:
        client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        log.info("%s went away after %d bytes of its %s body", client, len(buf), request.url.path)
        raise APIError(499, "the client closed the connection during the request body") from None
    return bytes(buf)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def parse_json(raw: bytes) -> Any:
    """`raw` as standard JSON no deeper than MAX_DEPTH with no lone surrogates, else APIError(400)."""
    try:
        obj = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN / Infinity
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    check_json(obj)
    return obj


def _too_deep() -> APIError:
    return APIError(400, f"request body nests JSON arrays and objects deeper than {MAX_DEPTH} levels")


def _name(key: str) -> str:
    # a key may itself hold the surrogate: name it in escapes any response can carry
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def _check_text(s: str, path: list[str]) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        where = ".".join(path) or "body"
        bad = ascii(s[e.start])[1:-1]
        raise APIError(
            400,
            f"Invalid value for '{where}': a lone surrogate ({bad}) is not a character; "
            "encode text as UTF-8 (a pair of \\u escapes for characters beyond U+FFFF)",
            param=where,
        ) from None


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _texts_ok(texts) -> bool:
    texts = list(texts)
    return all(map(str.isascii, texts)) or all(map(_utf8, texts))


def _clean(obj: Any) -> bool:
    """True when `obj` nests no deeper than MAX_DEPTH and every string and key encodes as UTF-8. Scans each
    container's members with C-level map()s: a 1 MB list of token ids takes milliseconds, not a Python loop
    per element on the event loop."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            return False
        if type(node) is dict:
            if not _texts_ok(node.keys()):
                return False
            node = list(node.values())
        kinds = set(map(type, node))
        if str in kinds and not _texts_ok(v for v in node if type(v) is str):
            return False
        if dict in kinds or list in kinds:
            stack.extend((v, depth + 1) for v in node if type(v) in (dict, list))
    return True


def check_json(obj: Any) -> None:
    """APIError(400) for a parsed body nesting deeper than MAX_DEPTH or holding a lone surrogate in a string
    or key, naming where (found by a second, slower walk that keeps the path)."""
    if isinstance(obj, (dict, list)) and _clean(obj):
        return
    stack: list[tuple[Any, list[str]]] = [(obj, [])]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            _check_text(node, path)
            continue
        if not isinstance(node, (dict, list)):
            continue
        if len(path) >= MAX_DEPTH:
            raise _too_deep()
        if isinstance(node, dict):
            for k, v in node.items():
                _check_text(k, [*path, _name(k)])
                stack.append((v, [*path, _name(k)]))
        else:
            stack.extend((v, [*path, str(i)]) for i, v in enumerate(node))
