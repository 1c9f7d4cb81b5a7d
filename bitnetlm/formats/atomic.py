"""Atomic writes: a temporary file or directory beside the output, then one rename.

Temporaries are named `.<output name>.bitnetlm-tmp-XXXXXXXX` and hold an exclusive `flock` for as long as their
writer lives. A writer killed mid-way (SIGKILL, OOM, power loss) cannot clean up after itself, so every new
temporary first removes the ones in its directory whose lock is free: debris never outlives the next write, and a
concurrent writer's temporary is left alone. Where `flock` is unavailable nothing is ever removed.

Temporaries start private (tempfile makes 0600 files and 0700 directories, and safetensors' `save_file` writes
0600 too); `commit` gives the output the permissions a plain open() or mkdir() would, under the process umask.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

TAG = ".bitnetlm-tmp-"

try:
    import fcntl
except ImportError:  # Windows: no flock, so no stale temporary is ever taken for dead
    fcntl = None


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def default_permissions(path: str | os.PathLike) -> None:
    """chmod `path` (and, for a directory, everything under it) to 0666 / 0777 minus the umask."""
    mask = umask()
    path = Path(path)
    if path.is_dir():
        for root, dirs, files in os.walk(path):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o777 & ~mask)
            for f in files:
                os.chmod(os.path.join(root, f), 0o666 & ~mask)
        os.chmod(path, 0o777 & ~mask)
    else:
        os.chmod(path, 0o666 & ~mask)


def _try_lock(path: Path) -> tuple[int | None, bool]:
    """(fd holding an exclusive flock on `path`, True) or (None, False) if it is held elsewhere or unsupported."""
    if fcntl is None:
        return None, False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None, False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None, False
    return fd, True


def remove_stale(directory: str | os.PathLike) -> list[Path]:
    """Remove the temporaries in `directory` whose writer is gone (nobody holds their lock); returns them."""
    removed = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return removed
    for p in entries:
        if not (p.name.startswith(".") and TAG in p.name) or p.is_symlink():
            continue
        fd, locked = _try_lock(p)
        if not locked:
            continue
        try:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _make_locked(out: Path, directory: bool) -> tuple[Path, int | None]:
    prefix = f".{out.name}{TAG}"
    for _ in range(8):
        if directory:
            tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
        else:
            fd, name = tempfile.mkstemp(prefix=prefix, dir=out.parent)
            os.close(fd)
            tmp = Path(name)
        fd, locked = _try_lock(tmp)
        if not locked:
            return tmp, None  # no flock here: the temporary is simply never taken for stale
        # a cleaner may have removed it between creation and lock: then make another
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino == os.stat(tmp).st_ino:
                return tmp, fd
        os.close(fd)
    raise OSError(f"{out.parent}: could not create a temporary beside {out.name}")


@contextlib.contextmanager
def _temporary(out: str | os.PathLike, directory: bool) -> Iterator[Path]:
    out = Path(out)
    remove_stale(out.parent)
    tmp, fd = _make_locked(out, directory)
    try:
        yield tmp
    finally:
        try:
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
        finally:
            if fd is not None:
                os.close(fd)


def temp_file(out: str | os.PathLike):
    """Context manager: the path of a fresh, locked temporary file beside `out` (which must be renamed onto `out`
    with `commit` inside the block); removed when the block ends without that."""
    return _temporary(out, directory=False)


def temp_dir(out: str | os.PathLike):
    """As `temp_file`, for a directory output."""
    return _temporary(out, directory=True)


def commit(tmp: str | os.PathLike, out: str | os.PathLike) -> None:
    """Give `tmp` the usual permissions and rename it onto `out` (a file, or a directory that does not exist)."""
    default_permissions(tmp)
    os.replace(tmp, out)
