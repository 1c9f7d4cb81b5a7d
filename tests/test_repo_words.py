"""The repository speaks of the product: no tracked text file refers to how its work was organised (work-log
entries, the machines or tools it was built with) instead of versions, dates and machines."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PATTERN = re.compile(
    r"\bstops? \d+\b|\bstop-\d+\b|\bdevice[ -](?:machine|tool)s?\b|\blent\b|\bCEO\b|\bsessions?\b",
    re.IGNORECASE,
)
ALLOWED = (
    'scope="session"',  # pytest's fixture scope
    "session-scoped",
    '"session.qdq_',  # onnxruntime's session option keys
)
TEXT = (
    ".py",
    ".md",
    ".sh",
    ".c",
    ".h",
    ".toml",
    ".yaml",
    ".yml",
    ".txt",
    ".cfg",
    ".ini",
    ".html",
    ".js",
    ".css",
)


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.fail("git ls-files failed: this test reads the repository's tracked files")
    me = Path(__file__).resolve().relative_to(ROOT).as_posix()  # (this file spells the words out)
    return [
        ROOT / f for f in out.splitlines() if f != me and (f.endswith(TEXT) or "/" not in f and "." not in f)
    ]


def test_no_work_log_words_in_tracked_files():
    found = []
    for path in _tracked():
        if not path.is_file():
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if any(a in line for a in ALLOWED):
                continue
            m = PATTERN.search(line)
            if m:
                found.append(f"{path.relative_to(ROOT)}:{i}: {m.group(0)!r}")
    assert found == [], "\n".join(found[:50])


def test_the_pattern_catches_what_it_must():
    for bad in (
        "as stop 55 measured",
        "Stops 13-65",
        "the device machine lends",
        "lent to us",
        "this session",
    ):
        assert PATTERN.search(bad), bad
    for good in ('scope="session"', "stop_token_ids", "the stop string", "non-stop"):
        assert not PATTERN.search(good) or any(a in good for a in ALLOWED), good
