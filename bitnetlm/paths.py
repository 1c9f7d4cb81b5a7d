"""Where bitnet-lm keeps what it fetches and what it measures: $BITNET_CACHE, else ~/.cache/bitnetlm."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    base = os.environ.get("BITNET_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "bitnetlm"
    )
    return Path(base)
