"""The Triton kernel worker's process rules, in the worker's own terms: standard library only,
imported by ``worker.py`` under the toolchain's Python (as ``worker_process``, from its folder)
and by ``aot.py`` in kiln (as ``kiln.triton.worker_process``).

Public API:
    children_die_with_me()         every process the worker starts dies with it (SIGKILL too)
    exit_on_no_space(main, argv)   runs ``main(argv)``; a full disk becomes one marked stderr line
    no_space_in(returncode, stderr) -> (errno, path) | None   that line, read back by kiln

The marked line is the worker's protocol with kiln, not output for a person: kiln turns it into
its own one-line error (``kiln.errors.no_space``).
"""

from __future__ import annotations

import os
import sys

NO_SPACE = (28, 122)  # ENOSPC, EDQUOT
NO_SPACE_MARK, NO_SPACE_EXIT = "kiln-worker-no-space: ", 28


def children_die_with_me() -> None:
    """Every process this worker starts (Triton runs ``ptxas`` for each kernel) dies with it.

    The worker itself dies with the build (kiln's launcher sets its ``PR_SET_PDEATHSIG``), but a
    death signal is not inherited across fork: a ``ptxas`` running when the build was SIGKILLed
    lived on, orphaned, until it finished (seconds under load: issue 39). Each child now arms its
    own SIGKILL-on-parent-death between fork and exec, and exits at once when the worker died
    before it could (its parent is then another process).
    """
    import ctypes
    import subprocess

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # no prctl here: children are left as they were
        return
    worker = os.getpid()
    start = subprocess.Popen.__init__

    def armed(previous):
        def preexec() -> None:
            prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
            if os.getppid() != worker:
                os._exit(137)
            if previous is not None:
                previous()
        return preexec

    def __init__(self, *args, preexec_fn=None, **kwargs):
        start(self, *args, preexec_fn=armed(preexec_fn), **kwargs)

    subprocess.Popen.__init__ = __init__


def exit_on_no_space(main, argv: list[str]) -> None:
    try:
        sys.exit(main(argv))
    except OSError as err:  # a full disk: one line kiln turns into its own (kiln.triton.aot)
        if err.errno not in NO_SPACE:
            raise
        sys.stderr.write(f"{NO_SPACE_MARK}{err.errno} {err.filename2 or err.filename or ''}\n")
        sys.exit(NO_SPACE_EXIT)


def no_space_in(returncode: int, stderr: str | None) -> tuple[int, str] | None:
    last = (stderr or "").strip().splitlines()[-1:] or [""]
    if returncode != NO_SPACE_EXIT or not last[0].startswith(NO_SPACE_MARK):
        return None
    errno_, _, path = last[0][len(NO_SPACE_MARK):].partition(" ")
    return int(errno_), path
