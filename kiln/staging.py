"""Writing files and directories so that nobody ever sees half of one.

Every output kiln writes (the OCI layout, the docker-archive, the Dockerfile context, the Helm
values, the patched tree, ``pins.toml``, the verdict record, cache entries) goes through here:

- ``write_atomic(path, data)``: a temporary file beside ``path``, fsynced, renamed over it.
- ``Staged``: a complete output written beside its destination under a private name, not yet
  visible; ``commit()`` swaps it in (keeping what it replaces aside), ``rollback()`` puts the
  previous state back, ``finish()`` drops what was kept aside, ``discard()`` removes the stage.
- ``commit_all(stages)``: commit several outputs together; when one fails, those already
  committed are rolled back, so a set of outputs lands whole or not at all.
- ``streamed_file(directory, prefix)``: a file written as a stream (its name known only at the
  end, e.g. by its digest) in a private temporary beside it, landed with one rename or removed.
- ``remove_dead_stages(parent)``: staging entries whose owner process is gone (a build killed
  mid-write) are removed by the next run that writes beside them.

Staged entries are named ``.<dest name>.kiln-<pid>.<start>-<random>``: the pid and the process's
start time (clock ticks after boot, ``/proc/<pid>/stat``) say whose they are, so a pid reused by
another process does not keep a dead build's stage alive (``.kiln-<pid>-<random>``, as older kiln
wrote them and where ``/proc`` is missing, is judged by the pid alone).
New files and directories follow the umask (``mkstemp``/``mkdtemp`` would make them private).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import writing
from kiln.lifeline import uninterrupted

_STAGE = re.compile(r"^\..+\.kiln-(\d+)(?:\.(\d+))?-[A-Za-z0-9_]+$")
_umask_lock = threading.Lock()


def umask() -> int:
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks after boot); None where ``/proc`` cannot tell."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = stat.rpartition(b")")[2].split()  # the name before it may hold spaces and ")"
    return fields[19].decode() if len(fields) > 19 else None


def _stage_prefix(dest: Path) -> str:
    pid = os.getpid()
    start = start_time(pid)
    return f".{dest.name}.kiln-{pid}.{start}-" if start else f".{dest.name}.kiln-{pid}-"


def stage_file(dest: Path) -> Path:
    """An empty file beside ``dest`` (same filesystem, so the final rename is atomic)."""
    fd, name = tempfile.mkstemp(dir=dest.parent, prefix=_stage_prefix(dest))
    os.fchmod(fd, 0o666 & ~umask())
    os.close(fd)
    return Path(name)


def stage_dir(dest: Path) -> Path:
    """An empty directory beside ``dest``."""
    path = Path(tempfile.mkdtemp(dir=dest.parent, prefix=_stage_prefix(dest)))
    os.chmod(path, 0o777 & ~umask())
    return path


class StreamedFile:
    """A private temporary file being written; ``land(final)`` closes it and renames it there."""

    def __init__(self, fd: int, path: Path):
        self.path = path
        self.handle = os.fdopen(fd, "wb")
        self.landed: Path | None = None

    def land(self, final: Path) -> Path:
        self.handle.close()
        os.replace(self.path, final)
        self.landed = final
        return final


@contextmanager
def streamed_file(directory: Path, prefix: str, suffix: str = "") -> Iterator[StreamedFile]:
    """A file streamed into ``directory`` under ``prefix`` (the cache's ``.tmp-`` entries are
    removed by the next run when their writer died); whatever is not landed is removed. Its mode
    follows the umask like any new file (an OCI layout output hard-links cache blobs)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=suffix)
    os.fchmod(fd, 0o666 & ~umask())
    out = StreamedFile(fd, Path(name))
    try:
        yield out
    finally:
        try:
            out.handle.close()
        except OSError:  # (a full disk flushing the rest: the error being raised says so; landed, close did not fail)
            if out.landed is not None:
                raise
        if out.landed is None:
            out.path.unlink(missing_ok=True)


def is_stage_name(name: str) -> bool:
    return bool(_STAGE.match(name))


def stage_bytes(dest: Path, data: bytes, check: Callable[[Path], None] | None = None) -> Staged:
    """``data`` staged beside ``dest`` (fsynced, ``dest``'s mode kept); ``check(path)`` may refuse it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = stage_file(dest)
    try:
        with writing(dest, len(data)), open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if dest.exists():
            os.chmod(tmp, dest.stat().st_mode & 0o7777)
        if check is not None:
            check(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return Staged(tmp, dest)


def write_atomic(path: Path, data: bytes, check: Callable[[Path], None] | None = None) -> None:
    """Replace ``path`` with ``data`` in one step (an existing file's mode is kept)."""
    commit_all([stage_bytes(path, data, check)])


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@dataclass
class Staged:
    """A complete output at ``path``, to become ``dest`` (``path`` None: nothing local is staged).

    ``commit`` moves an existing ``dest`` aside (``replaced``) before renaming, so
    ``rollback`` can restore it; ``finish`` deletes it once every output of a run committed.
    ``on_commit``, when set, replaces the rename (an output merged into something shared,
    like an OCI layout's index); it returns a function that undoes it.
    """

    path: Path | None
    dest: Path | None
    on_commit: Callable[[], Callable[[], None]] | None = None
    replaced: Path | None = None
    committed: bool = False
    _undo: Callable[[], None] | None = None

    def commit(self) -> Path:
        if self.on_commit is not None:
            self._undo = self.on_commit()
        else:
            with uninterrupted():  # SIGTERM between the renames would lose what ``dest`` held
                if self.dest.exists() or self.dest.is_symlink():
                    self.replaced = stage_dir(self.dest) / "previous"
                    os.rename(self.dest, self.replaced)
                os.rename(self.path, self.dest)
                self.committed = True
            return self.dest
        self.committed = True
        return self.dest

    def rollback(self) -> None:
        if not self.committed:
            self.discard()
            return
        with uninterrupted():
            if self._undo is not None:
                self._undo()
            else:
                _remove(self.dest)
                if self.replaced is not None:
                    os.rename(self.replaced, self.dest)
                    shutil.rmtree(self.replaced.parent, ignore_errors=True)
                    self.replaced = None
            self.committed = False

    def finish(self) -> None:
        if self.replaced is not None:
            shutil.rmtree(self.replaced.parent, ignore_errors=True)
            self.replaced = None
        self.discard()

    def discard(self) -> None:
        if self.path is not None and (self.path.exists() or self.path.is_symlink()):
            _remove(self.path)


def commit_all(stages: Iterable[Staged]) -> list[Path | None]:
    """Commit every stage in order; on any failure roll back those already committed."""
    stages = list(stages)
    try:
        for stage in stages:
            stage.commit()
    except BaseException:
        with uninterrupted():  # a signal now stops the build after the rollback, not inside it
            for stage in reversed(stages):
                if stage.committed:
                    stage.rollback()
            for stage in stages:
                stage.discard()
        raise
    for stage in stages:
        stage.finish()
    return [stage.dest for stage in stages]


def discard_all(stages: Iterable[Staged]) -> None:
    for stage in stages:
        stage.discard()


def _alive(pid: int, start: str | None) -> bool:
    """Whether the process that wrote ``.kiln-<pid>[.<start>]-`` still runs (not a reuse of its pid)."""
    if pid != os.getpid():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # somebody else's live process: its start time still tells
    if start is None:
        return True
    now = start_time(pid)
    return now is None or now == start


def remove_dead_stages(parent: Path) -> list[Path]:
    """Remove the staging entries in ``parent`` whose owner process no longer runs (safe at any
    time: a live owner's entries are kept, whatever else runs)."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        match = _STAGE.match(entry.name)
        if match and not _alive(int(match.group(1)), match.group(2)):
            path = Path(entry.path)
            _remove(path)
            removed.append(path)
    return removed
