"""Locate test assets fetched by scripts/fetch_assets.py. Missing asset: skip locally, FAIL under CI."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ASSETS = Path(os.environ.get("BITNETLM_ASSETS", ROOT / ".assets"))


def asset(name: str) -> Path:
    p = ASSETS / name
    if not p.exists():
        msg = f"test asset {name!r} missing at {p}; run: python scripts/fetch_assets.py {name}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return p
