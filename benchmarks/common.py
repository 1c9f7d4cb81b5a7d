"""What every benchmark script shares: this checkout's package on the path, the machine's name, the date, markdown
tables, comma-separated arguments, held-out text, and the CPU's memory bandwidth and a random-weight checkpoint.

Scripts run as `python benchmarks/NAME.py` (so this folder is first on sys.path) and call `use_checkout()` before
importing bitnetlm, so that they time this tree's package, not an installed one. Nothing here imports bitnetlm or
touches CUDA at import time: `--help` works anywhere.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / ".assets"


def use_checkout(root: str | os.PathLike = ROOT) -> None:
    """Put `root`'s bitnetlm (default: this checkout's) first on sys.path."""
    root = str(root)
    if sys.path[:1] != [root]:
        sys.path.insert(0, root)


def int_list(text: str) -> list[int]:
    """ "1,8,64" -> [1, 8, 64] (argparse type)."""
    return [int(v) for v in text.split(",") if v.strip()]


def str_list(text: str) -> list[str]:
    """ "bf16,int8" -> ["bf16", "int8"] (argparse type)."""
    return [v.strip() for v in text.split(",") if v.strip()]


def cpu_name() -> str:
    """The CPU's model name (x86 family and model, AMD's core generation), its logical cores and the OS."""
    use_checkout()
    from bitnetlm.bench import cpu_model_name

    return f"{cpu_model_name()}, {os.cpu_count()} logical cores, {platform.system()} {platform.machine()}"


def gpu_name(index: int = 0) -> str:
    """The GPU's name, memory and SM count (CUDA must be available)."""
    import torch

    p = torch.cuda.get_device_properties(index)
    return f"{p.name} ({p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs)"


def commit(root: str | os.PathLike = ROOT) -> str:
    """The commit of this checkout (or `root`'s): short hash, '+' when the tree has changes; '' outside git."""
    try:
        run = lambda *a: subprocess.run(  # noqa: E731
            ["git", *a], cwd=root, capture_output=True, text=True, timeout=10
        )
        head = run("rev-parse", "--short", "HEAD").stdout.strip()
        dirty = run("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+" if head and dirty else "")


def machine(gpu: bool = False) -> str:
    """One line naming the machine: the GPU (when `gpu`) and the host CPU, torch's version, the date and the
    commit measured."""
    import torch

    parts = [f"GPU {gpu_name()}"] if gpu else []
    parts += [f"CPU {cpu_name()}", f"torch {torch.__version__}"]
    if gpu:
        try:
            import triton

            parts.append(f"Triton {triton.__version__}")
        except ImportError:
            pass
    parts.append(f"date {datetime.date.today().isoformat()}")
    rev = commit()
    if rev:
        parts.append(f"commit {rev}")
    return "; ".join(parts)


def header(title: str, gpu: bool = False, details: str = "") -> None:
    """A table's heading: its title, the machine line, and what the rows measured."""
    print(f"\n### {title}\n\n{machine(gpu)}" + (f"\n\n{details}" if details else "") + "\n", flush=True)


def table(columns: Sequence[str], rows: Iterable[Sequence], right: Sequence[bool] | None = None) -> str:
    """A markdown table; `right[i]` right-aligns column i (default: every column but the first)."""
    right = right if right is not None else [i > 0 for i in range(len(columns))]
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join(" ---: " if r else " --- " for r in right) + "|",
    ]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def heldout(tok, texts: str | os.PathLike, tokens: int) -> list[list[int]]:
    """The last `tokens` token ids of each text file in `texts` (sorted by name): held-out text that no training
    run of ours reads."""
    out = []
    files = sorted(Path(texts).glob("*.txt"))
    if not files:
        raise FileNotFoundError(
            f"{texts}: no .txt files (the held-out texts; scripts/fetch_assets.py fetches them)"
        )
    for f in files:
        out.append(tok.encode(f.read_text(encoding="utf-8"))[-tokens:])
    return out


# ---- CPU: memory bandwidth, resident memory, the random-weight checkpoint --------------------------------------
def best_seconds(fn, reps: int) -> float:
    """The fastest of `reps` calls of fn() in seconds (a shared machine's other load only ever slows a call)."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(threads: int, mib: int = 512, reps: int = 5) -> float:
    """GB/s of the C library's parallel memcpy on `threads` threads, bytes read + written (STREAM's copy)."""
    use_checkout()
    import torch

    from bitnetlm.kernels import cpu

    cpu.set_num_threads(threads)
    src = torch.ones(mib << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    lib = cpu._lib.load()
    t = best_seconds(lambda: lib.bn_parallel_copy(dst.data_ptr(), src.data_ptr(), src.numel()), reps)
    return 2 * src.numel() / t / 1e9


def read_bandwidth(threads: int, mib: int = 512, reps: int = 5) -> float:
    """GB/s of the C library's parallel read-only sweep (a sum of 64-bit words) on `threads` threads: decode's own
    access pattern, so its ceiling. Worth measuring next to each row: a VM's bandwidth drifts by tens of percent."""
    use_checkout()
    import torch

    from bitnetlm.kernels import cpu

    cpu.set_num_threads(threads)
    src = torch.ones(mib << 20, dtype=torch.uint8)
    lib = cpu._lib.load()
    t = best_seconds(lambda: lib.bn_parallel_read(src.data_ptr(), src.numel()), reps)
    return src.numel() / t / 1e9


def rss_bytes(peak: bool = False) -> int:
    """This process's resident memory now, or its peak (Linux; 0 elsewhere). The peak is the kernel's VmHWM, not
    getrusage's ru_maxrss, which a child process inherits from the parent that forked it."""
    key = "VmHWM:" if peak else "VmRSS:"
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def shape_checkpoint(path: str | os.PathLike, shape: str, tokenizer: str | os.PathLike) -> Path:
    """A checkpoint of `shape` with random weights in the real packed HF format at `path` (written by
    make_checkpoint.py when absent) with `tokenizer`'s files copied beside it."""
    import shutil

    from make_checkpoint import write_checkpoint

    path = write_checkpoint(path, shape)
    if not (path / "tokenizer.json").is_file():
        src = Path(tokenizer)
        if not (src / "tokenizer.json").is_file():
            raise SystemExit(f"--tokenizer {src}: no tokenizer.json there (python scripts/fetch_assets.py)")
        for f in src.iterdir():
            if f.is_file():
                shutil.copy(f, path / f.name)
    return path


def records_schema(min_items: int, max_items: int | None = None) -> dict:
    """The JSON schema the structured-output benchmarks enforce: an array of records of a bounded string, an
    integer in a range and an enum."""
    bounds = {"minItems": min_items} | ({"maxItems": max_items} if max_items is not None else {})
    return {
        "type": "array",
        **bounds,
        "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "year": {"type": "integer", "minimum": 1800, "maximum": 2100},
                "kind": {"enum": ["novel", "poem", "letter"]},
            },
            "required": ["name", "year", "kind"],
            "additionalProperties": False,
        },
    }
