"""The chat page at / in a real headless Chromium (Debian's `chromium`, driven by playwright).

Needs `apt-get install -y chromium` (scripts/install_system_deps.sh) and `pip install playwright`.
"""

from __future__ import annotations

import collections
import os
import struct
import zlib

import pytest
from serve_parts import tiny_model_and_tokenizer

from bitnetlm.generate import SamplingParams, generate
from bitnetlm.serve import start

CHROMIUM = os.environ.get("BITNET_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-dev-shm-usage",
    "--disable-extensions",
    "--no-first-run",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_web_chat_streams_a_reply(tmp_path):
    from playwright.sync_api import sync_playwright

    model, tok = tiny_model_and_tokenizer(max_len=256)
    msg = "Hello, who are you?"
    # the page sends its settings (temperature 0, 24 tokens) and the running chat as messages
    ref = generate(
        model, tok, [{"role": "user", "content": msg}], SamplingParams(max_tokens=24, temperature=0)
    )
    assert str(ref).strip(), "the oracle reply must have visible text for this test to mean anything"
    with start(model, tok, port=0, log_level="warning", api_key="k3y") as h, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 900, "height": 600})
            # count the response chunks the page's stream reader hands it: how the bytes arrived decides how
            # often a streaming page can redraw (a fast reply under load can come in one or two chunks)
            page.add_init_script(
                """(() => { window.__chunks = 0; const read = ReadableStreamDefaultReader.prototype.read;
                   ReadableStreamDefaultReader.prototype.read = function () {
                       return read.call(this).then((r) => { if (!r.done && r.value && r.value.length)
                           window.__chunks++; return r; }); }; })()"""
            )
            page.goto(h.url + "/")
            page.fill("#key", "k3y")
            page.dispatch_event("#key", "change")
            page.wait_for_function(
                "document.getElementById('model').textContent === 'bitnet'", timeout=30_000
            )
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "24")
            # count how often the reply bubble changes while it streams, and record the bubble's states:
            # "streaming" can last less than playwright's polling interval, so waiting for it could miss it
            page.evaluate(
                """() => { window.__updates = 0; window.__states = [];
                   new MutationObserver((ms) => {
                       for (const m of ms) if (m.type === 'attributes') window.__states.push(m.target.dataset.state);
                       if (ms.some((m) => m.type !== 'attributes')) window.__updates++; })
                   .observe(document.getElementById('messages'), {subtree: true, childList: true,
                            characterData: true, attributes: true, attributeFilter: ['data-state']}); }"""
            )
            page.fill("#input", msg)
            page.click("#send")
            page.wait_for_selector(".msg.assistant[data-state=done]", timeout=60_000)
            assert page.evaluate("window.__states") == ["streaming", "done"]
            reply = page.eval_on_selector(
                ".msg.assistant", "e => e.firstChild ? e.firstChild.textContent : ''"
            )
            assert page.inner_text(".msg.user") == msg
            assert page.query_selector(".msg.error") is None
            assert reply == str(ref)
            # streamed, not delivered at once: the page redraws the bubble as chunks arrive, about once a chunk
            # (22-23 chunks and updates here); a page that drew only at the end would make ~3 updates. Half the
            # chunks leaves room for chunks that end mid-event or carry only the role or the usage.
            chunks, updates = page.evaluate("window.__chunks"), page.evaluate("window.__updates")
            assert chunks >= 1 and updates >= chunks // 2 + 1, (chunks, updates)
            assert "tokens" in page.inner_text(".msg.assistant .stats")
            shot = page.screenshot(path=str(tmp_path / "chat.png"), full_page=True)
        finally:
            browser.close()
    _check_screenshot(shot)


def _png_pixels(png: bytes) -> tuple[int, int, list[tuple[int, int, int]]]:
    """Decode an 8-bit RGB/RGBA non-interlaced PNG (what Chromium writes) with zlib: (width, height, pixels)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, hdr = 8, b"", None
    while pos < len(png):
        n = struct.unpack(">I", png[pos : pos + 4])[0]
        kind, data = png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            hdr = struct.unpack(">IIBBBBB", data)
        elif kind == b"IDAT":
            idat += data
        pos += 12 + n
    w, h, depth, ctype, _, _, interlace = hdr
    assert depth == 8 and ctype in (2, 6) and interlace == 0, hdr
    bpp = 3 if ctype == 2 else 4
    raw, stride = zlib.decompress(idat), w * bpp
    rows, prev = [], bytearray(stride)
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(line)
        prev = line
    px = [tuple(r[x * bpp : x * bpp + 3]) for r in rows for x in range(w)]
    return w, h, px


def _check_screenshot(png: bytes) -> None:
    """The screenshot is a real rendering: right size, and not blank (many distinct colours, the blue bubble)."""
    w, h, px = _png_pixels(png)
    assert w == 900 and h >= 600
    colours = collections.Counter(px)
    assert len(colours) > 50  # anti-aliased text, borders, the user's bubble
    blue = sum(n for (r, g, b), n in colours.items() if b > 200 and r < 80)  # user bubble #2f6fed
    assert blue > 500
    dark = sum(n for (r, g, b), n in colours.items() if r + g + b < 200)  # rendered text
    assert dark > 200


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
