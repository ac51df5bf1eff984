"""Processes a build starts die with it; SIGTERM and SIGINT stop a build cleanly.

A build runs other processes: the patching's forked workers (``kiln.patch.memo``), the Triton
kernel workers and pip (``kiln.triton``), credential helpers (``kiln.oci.credentials``). None
may outlive it. A forked worker left behind blocks forever on its pool's pipe and keeps the
descriptors it inherited, the cache's shared users lock among them, so no later run would ever
find the cache unused and remove a killed build's temporary entries.

Public API:
    child_of(parent_pid)    first call in a forked worker (a pool's initializer): SIGKILL when
                            the parent dies (``PR_SET_PDEATHSIG``; a watchdog thread where
                            there is no prctl), SIGTERM default, SIGINT ignored (the parent stops it)
    run(argv, input=None, env=None, cwd=None, timeout=None, started=None) -> CompletedProcess
                            ``subprocess.run`` (text, output captured) for a child exec'd through
                            a launcher that sets the same death signal first; killed on interrupt
    stop_on_signals()       context manager for a command: SIGTERM/SIGINT kill the children
                            ``run`` started and raise ``Interrupted`` in the main thread, so every
                            ``finally`` runs (pools shut down, stages removed); a second signal
                            exits at once (128 + signal)
    uninterrupted()         a block a signal never cuts in half (acted on when it ends)
    check()                 raises ``Interrupted`` once the command was told to stop (helper
                            threads call it between steps: only the main thread gets the signal)

The death signal is tied to the thread that forked the child, not the process: every caller
here forks from a thread that waits for the child (a pool's submitting thread waits for its
results; ``run`` waits in ``communicate``), so the thread outlives the child's useful life. The
parent may die between the fork and the prctl: the child checks ``getppid()`` afterwards.
A death signal is not inherited across fork, so a child's own children need theirs: the Triton
kernel worker arms it in each process it starts (``ptxas``; ``kiln.triton.worker.children_die_with_me``).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kiln.errors import Interrupted

_PR_SET_PDEATHSIG = 1
_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Exec'd as ``python -I -S -c _LAUNCHER PARENT PROGRAM ARGS...``: nothing but the stdlib, no site.
_LAUNCHER = (
    "import ctypes, os, sys\n"
    "try:\n"
    f"    ctypes.CDLL(None, use_errno=True).prctl({_PR_SET_PDEATHSIG}, {int(signal.SIGKILL)}, 0, 0, 0)\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(137)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)

_stop = threading.Event()  # set by the first SIGTERM/SIGINT of a command
_children: set[subprocess.Popen] = set()
_children_lock = threading.RLock()  # reentrant: the handler may run while the main thread holds it
_state = {"signum": 0, "depth": 0, "pending": 0}  # the signal received; deferral (main thread)


def _set_death_signal() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def child_of(parent_pid: int) -> None:
    """In a freshly forked worker: die with ``parent_pid``, leave signals to the parent."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's handler was inherited
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the parent stops us
    armed = _set_death_signal()
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        os._exit(137)
    if not armed:
        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(0.2)
            os._exit(137)

        threading.Thread(target=watch, name="kiln-parent-watch", daemon=True).start()


def check() -> None:
    """Raise ``Interrupted`` when the command was told to stop (for helper threads)."""
    if _stop.is_set():
        raise Interrupted(_state["signum"] or signal.SIGTERM)


def _kill_children() -> None:
    with _children_lock:
        children = list(_children)
    for child in children:
        try:
            child.kill()
        except OSError:
            pass


def run(argv: list[str], input: str | None = None, env: dict[str, str] | None = None, cwd=None,
        timeout: float | None = None, started: Callable[[], None] | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, ...)`` for a child that dies with us.

    ``argv[0]`` is looked up on ``PATH`` here (``FileNotFoundError`` as subprocess raises it);
    ``started()``, when given, is called once the child runs (a crash test's pause point).
    Raises ``Interrupted`` instead of returning when the command was told to stop meanwhile.
    """
    check()
    program = argv[0]
    if os.sep not in program:
        program = shutil.which(program, path=(env if env is not None else os.environ).get("PATH"))
        if program is None:
            raise FileNotFoundError(2, "No such file or directory", argv[0])
    launcher = [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(os.getpid()), program, *argv[1:]]
    with subprocess.Popen(launcher, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd, text=True) as child:
        with _children_lock:
            _children.add(child)
        try:
            if _stop.is_set():  # the signal came between the start and the line above
                child.kill()
            if started is not None:
                started()
            out, err = child.communicate(input, timeout=timeout)
        except BaseException:  # a timeout, Interrupted: the child does not go on alone
            child.kill()
            raise
        finally:
            with _children_lock:
                _children.discard(child)
    check()
    return subprocess.CompletedProcess(argv, child.returncode, out, err)


def _handler(signum: int, frame) -> None:
    first = not _stop.is_set()
    _state["signum"] = signum
    _stop.set()
    _kill_children()
    if not first:
        os._exit(128 + signum)  # told twice: no more cleaning up (the next run removes the rest)
    if _state["depth"]:
        _state["pending"] = signum
        return
    raise Interrupted(signum)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise ``Interrupted`` inside the block (main thread only; else a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _stop.clear()  # (a command run earlier in this process may have been interrupted)
    _state.update(signum=0, depth=0, pending=0)
    previous = {signum: signal.getsignal(signum) for signum in _SIGNALS}
    for signum in _SIGNALS:
        signal.signal(signum, _handler)
    try:
        yield
    finally:  # ``_stop`` stays set: a thread the command could not join still stops at its next check()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def uninterrupted() -> Iterator[None]:
    """A signal arriving inside the block raises ``Interrupted`` when it ends, not halfway."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
        pending = _state["pending"]
        if not _state["depth"] and pending:
            _state["pending"] = 0
            raise Interrupted(pending)
