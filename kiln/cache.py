"""The on-disk cache: content-addressed entries filled under a lock and renamed into place.

Two processes filling the same entry must never see (or leave) a half-written one: each fill
happens in a private temporary directory beside the final path, guarded by an flock, and
becomes visible with a single atomic ``os.rename``.

A process killed mid-fill (SIGKILL, power loss) leaves its ``.tmp-*`` entry behind, never a
final one. ``cache_root()`` registers the calling process as a user of the cache (a shared
flock on ``<root>/.users.lock``, held until it exits); the first user to arrive while no other
holds it takes it exclusively for a moment and removes those leftovers, which then belong to
no live process.
"""

from __future__ import annotations

import fcntl
import glob
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kiln.staging import is_stage_name


def cache_dir() -> Path:
    """``$KILN_CACHE_DIR``, else ``$XDG_CACHE_HOME/kiln``, else ``~/.cache/kiln``; not created."""
    explicit = os.environ.get("KILN_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kiln"


def cache_root() -> Path:
    """``cache_dir()``, claimed (created, and this process registered as a user)."""
    root = cache_dir()
    claim_cache(root)
    return root


_claims: dict[Path, int] = {}  # cache root -> the descriptor holding its shared users lock


def claim_cache(root: Path) -> None:
    """Hold a shared lock on ``root`` for the life of this process; clean up if first user."""
    key = root.absolute()
    if key in _claims:
        return
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / ".users.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pass  # other kiln processes use the cache: their temporary entries are live
    else:
        remove_leftovers(root)
    fcntl.flock(fd, fcntl.LOCK_SH)  # a downgrade after cleaning; waits while another cleans
    _claims[key] = fd


def remove_leftovers(root: Path, depth: int = 3) -> list[Path]:
    """Delete the ``.tmp-*`` entries within ``depth`` levels of ``root``; returns them.

    Only safe while no other process uses the cache (``claim_cache`` holds it exclusively).
    Entries live at most three levels down (``blobs/sha256/.tmp-…``, ``verdicts/ab/.tmp-…``);
    the source trees below are final, never scanned.
    """
    removed = []
    level = [root]
    for _ in range(depth):
        below = []
        for directory in level:
            try:
                children = list(os.scandir(directory))
            except OSError:
                continue
            for child in children:
                path = Path(child.path)
                if child.name.startswith(".tmp-") or is_stage_name(child.name):
                    if child.is_dir(follow_symlinks=False):
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        path.unlink(missing_ok=True)
                    removed.append(path)
                elif child.is_dir(follow_symlinks=False) and not child.name.startswith(("image-", "sha256-")):
                    below.append(path)
        level = below
    return removed


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


def _remove_dead_fills(final: Path) -> None:
    """Remove ``.tmp-<final name>-*`` beside ``final``: call only holding its lock (``install_dir``).

    Whoever fills one holds that flock until it is renamed or removed, and the kernel drops the
    lock when its holder dies: so while we hold it, every such directory belongs to a killed
    process. This also cleans where ``claim_cache`` does not reach (a toolchain directory
    shared through ``$KILN_TRITON_TOOLCHAINS``) or cannot (a cache another process uses).
    """
    dead = re.compile(rf"^\.tmp-{re.escape(final.name)}-[a-z0-9_]{{8}}$")  # mkdtemp's names
    try:
        entries = [e for e in os.scandir(final.parent) if dead.match(e.name)]
    except OSError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            Path(entry.path).unlink(missing_ok=True)


def install_dir(final: Path, fill: Callable[[Path], None]) -> Path:
    """Return ``final``, creating it with ``fill(tmpdir)`` first if absent.

    ``fill`` writes into an empty private directory; on success it is renamed to ``final``
    in one step. On failure nothing is left behind; what a killed process was filling is
    removed by the next call that takes the lock (``_remove_dead_fills``).
    """
    lock_path = final.parent / f".{final.name}.lock"
    if final.is_dir():
        if any(final.parent.glob(f".tmp-{glob.escape(final.name)}-*")):
            with open(lock_path, "a+") as handle:  # only when nobody fills it now
                try:
                    fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return final
                _remove_dead_fills(final)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(lock_path):
        _remove_dead_fills(final)
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
