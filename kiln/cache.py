"""The on-disk cache: content-addressed entries filled under a lock and renamed into place.

Two processes filling the same entry must never see (or leave) a half-written one: each fill
happens in a private temporary directory beside the final path, guarded by an flock, and
becomes visible with a single atomic ``os.rename``.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_root() -> Path:
    """``$KILN_CACHE_DIR``, else ``$XDG_CACHE_HOME/kiln``, else ``~/.cache/kiln``."""
    explicit = os.environ.get("KILN_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "kiln"


@contextmanager
def file_lock(lock_path: Path) -> Iterator[None]:
    """An exclusive advisory lock held for the duration of the block (across processes)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def install_dir(final: Path, fill: Callable[[Path], None]) -> Path:
    """Return ``final``, creating it with ``fill(tmpdir)`` first if absent.

    ``fill`` writes into an empty private directory; on success it is renamed to ``final``
    in one step. On failure nothing is left behind.
    """
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(final.parent / f".{final.name}.lock"):
        if final.is_dir():  # another process finished it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{final.name}-"))
        try:
            fill(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file and rename, so readers never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name}-")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
