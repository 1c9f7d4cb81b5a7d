"""The weight layout to decode with on this machine (runtime weights_layout "auto").

cpu-base3-v1 reads 20% fewer bytes a token than cpu-2bit-v2 and spends more instructions unpacking them, so it wins
where decode waits on memory and loses where it waits on the cores. That depends on the memory bandwidth per core
and on whether the weights stay in the last-level cache, which no instruction-set flag tells; so weights that
outgrow the cache are timed both ways at load, on the model's own matrices, and those that fit keep 2-bit. The
timing reads the weights about six times and holds a base-3 copy of up to twice the cache's size meanwhile (2B4T on
a 2-vCPU VM: 1.4-3.1 s); `weights_layout="2bit"` or `"base3"` skips it. The answer is kept per machine (CPU
model, instruction set, threads, cache size) in $BITNET_CACHE/cpu_weights_layout.json, so one load pays the timing.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from bitnetlm.kernels.cpu import BACKEND, BACKEND_BASE3

ROUNDS = 2  # timed passes a layout, alternating; the best of each counts
# base-3 must be clearly faster to be chosen: near a tie 2-bit stays (its prefill is faster, and the choice steadier
# from one load to the next on a noisy machine)
MARGIN = 0.9


def last_level_cache_bytes() -> int:
    """The largest cache this CPU reports (Linux sysfs), else 32 MiB."""
    best = 0
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * mult)
    return best or 32 << 20


def _pass(mats, xs) -> float:
    """Seconds for one decode-shaped (one token) product with every matrix of `mats`."""
    from bitnetlm.kernels.cpu import ops  # registers the custom ops: on first use

    t0 = time.perf_counter()
    for (packed, scale, n, code), x in zip(mats, xs):
        ops.ternary_linear(x, packed, scale, n, code)
    return time.perf_counter() - t0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine_key(llc: int) -> str:
    from bitnetlm.kernels.cpu import get_isa, get_num_threads

    return f"{_cpu_model()} | {get_isa()} | {get_num_threads()} threads | {llc >> 20} MiB cache"


def _cache_file() -> Path:
    from bitnetlm.paths import cache_root

    return cache_root() / "cpu_weights_layout.json"


def _remembered() -> dict:
    try:
        got = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}  # (none yet, or unreadable: timed again and rewritten)
    return got if isinstance(got, dict) else {}


def _remember(key: str, layout: str) -> None:
    """Best effort: a cache that cannot be written only costs the next load its timing."""
    path = _cache_file()
    table = {**_remembered(), key: layout}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".cpu_weights_layout.")
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


def choose_layout(lins) -> str:
    """ "2bit" or "base3" for the inference BitLinears `lins` on the C kernels (see the module docstring)."""
    total = sum(m.out_features * m.in_features for m in lins) // 4
    llc = last_level_cache_bytes()
    if total <= llc:
        return "2bit"
    key = _machine_key(llc)
    known = _remembered().get(key)
    if known in ("2bit", "base3"):
        return known
    layout = _timed(lins, llc)
    _remember(key, layout)
    return layout


def _timed(lins, llc: int) -> str:
    """Both layouts timed on a prefix of `lins` (see the module docstring)."""
    # time a prefix of the matrices twice the cache's size: enough to stream from memory, bounded extra memory
    chosen, size = [], 0
    for m in lins:
        chosen.append(m)
        size += m.out_features * m.in_features // 4
        if size >= 2 * llc:
            break
    two, three = [], []
    for m in chosen:
        shape = (m.out_features, m.in_features)
        p2 = m.packed if m.kernel is BACKEND else BACKEND.repack(m.packed, m.layout, shape)
        p3 = m.packed if m.kernel is BACKEND_BASE3 else BACKEND_BASE3.repack(m.packed, m.layout, shape)
        two.append((p2, m.weight_scale, shape[0], BACKEND.code))
        three.append((p3, m.weight_scale, shape[0], BACKEND_BASE3.code))
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, m.in_features, generator=gen) for m in chosen]
    best = {"2bit": float("inf"), "base3": float("inf")}
    _pass(two, xs), _pass(three, xs)  # warm-up: the pool's threads, first touches
    for _ in range(ROUNDS):
        best["2bit"] = min(best["2bit"], _pass(two, xs))
        best["base3"] = min(best["base3"], _pass(three, xs))
    return "base3" if best["base3"] <= MARGIN * best["2bit"] else "2bit"
