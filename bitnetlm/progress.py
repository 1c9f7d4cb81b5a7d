"""Progress bars: one policy for every long operation (loading, dequantizing, converting, evaluating, ...).

A bar is a tqdm bar on stderr, shown only when stderr is a terminal and bars are not turned off: `bitnet CMD
--no-progress` turns them off for the command, as `with progress.disabled():` does for library code. Off, a bar
is tqdm's disabled one: it iterates and counts at no cost and writes nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator

_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("bitnetlm_progress", default=True)


def enabled() -> bool:
    """Whether a bar started now would be drawn: bars are on and stderr is a terminal."""
    if not _ON.get():
        return False
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


@contextlib.contextmanager
def disabled(off: bool = True) -> Iterator[None]:
    """Inside: no bars (off=False leaves the policy as it is, for `with disabled(args.no_progress):`)."""
    token = _ON.set(False) if off else None
    try:
        yield
    finally:
        if token is not None:
            _ON.reset(token)


def bar(
    iterable=None,
    *,
    desc: str | None = None,
    total: int | None = None,
    initial: int = 0,
    unit: str = "it",
    unit_scale: bool = False,
    show: bool = True,
):
    """A tqdm bar on stderr under the policy above (`show=False` keeps it off whatever the policy); use it as
    tqdm: iterate over it, or `update()` it in a `with` block."""
    from tqdm import tqdm

    return tqdm(
        iterable,
        desc=desc,
        total=total,
        initial=initial,
        unit=unit,
        unit_scale=unit_scale,
        leave=False,
        file=sys.stderr,
        dynamic_ncols=True,
        disable=not (show and enabled()),
    )


def add_argument(parser) -> None:
    """The `--no-progress` flag (`bitnetlm.cli` applies it around the command)."""
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (they are drawn on stderr, and only when it is a terminal)",
    )
