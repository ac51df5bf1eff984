"""The one error type kiln shows to users (a single line naming the culprit), and ``Interrupted``."""

import errno
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

from kiln.secrets import scrub


class KilnError(Exception):
    """A user-facing failure. ``str(err)`` is one line naming the file, field or patch at fault.

    Its text is scrubbed of every known secret (``kiln.secrets``): it may quote a server's answer.
    """

    def __init__(self, message: str):
        super().__init__(scrub(" ".join(message.split("\n"))))


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT told the command to stop (``kiln.lifeline``): unwinds like Ctrl-C."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(signal.Signals(self.signum).name)


# A full disk (or quota): the errors a write may meet that say "no space", not "kiln is broken".
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def is_no_space(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in NO_SPACE


def _bytes(n: int) -> str:
    return f"{n} bytes"


def no_space(err: OSError, path, needed: int | None = None, what: str | None = None) -> OSError:
    """``err`` (ENOSPC/EDQUOT from a write) as an OSError naming ``path`` and what the write needed.

    Stays an ``OSError`` (whatever cleans up on one still does); ``kiln.commands.main`` prints it
    as one line (``no_space_line``), exit 2. ``needed`` is the size of the whole write when known.
    """
    new = OSError(err.errno, err.strerror or os.strerror(err.errno), str(path))
    new.kiln_needed = needed if needed is not None else getattr(err, "kiln_needed", None)
    new.kiln_what = what or getattr(err, "kiln_what", None)
    return new


@contextmanager
def writing(path, needed: int | None = None, what: str | None = None) -> Iterator[None]:
    """A write to ``path`` (a file, or a directory being filled): ENOSPC inside names it."""
    try:
        yield
    except OSError as err:
        if not is_no_space(err) or getattr(err, "kiln_named", False):
            raise
        new = no_space(err, path, needed, what)
        new.kiln_named = True
        raise new from None


def _free(path: str) -> int | None:
    probe = path
    while probe:
        try:
            stat = os.statvfs(probe)
            return stat.f_bavail * stat.f_frsize
        except OSError:
            parent = os.path.dirname(probe)
            if parent == probe:
                return None
            probe = parent
    return None


def no_space_line(err: OSError, fallback: list | tuple = ()) -> str:
    """One line for a full disk: the path written, the bytes needed (when known) and free there.

    ``fallback``: directories the command writes under, named (the fullest first) when the
    error carries no path (a plain ``write()`` on an open file does not say which).
    """
    path = err.filename2 or err.filename  # (shutil's copies name the source first, the target second)
    if path is None:
        candidates = [(free, str(p)) for p in fallback if p is not None and (free := _free(str(p))) is not None]
        if candidates:
            path = min(candidates)[1]
    where = f"writing {path}" if path is not None else "writing (the path was not reported)"
    detail: list[str] = []
    needed = getattr(err, "kiln_needed", None)
    what = getattr(err, "kiln_what", None)
    if needed is not None:
        detail.append(f"{_bytes(needed)} needed")
    elif what:
        detail.append(f"while writing {what}")
    free = _free(str(path)) if path is not None else None
    if free is not None:
        detail.append(f"{free} free there")
    reason = "no space left on device" if err.errno == errno.ENOSPC else "disk quota exceeded"
    line = f"{reason} {where}"
    if what and needed is not None:
        line = f"{what}: {line}"
    return line + (f" ({'; '.join(detail)})" if detail else "")
