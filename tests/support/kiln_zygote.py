"""A kiln interpreter with its modules already imported, forked once per command
(tests/support/kiln_process.py): ``python -m tests.support.kiln_zygote``.

Why: a build's child spent ~1.7 s of CPU importing kiln, libcst's matchers and the command's
modules before doing anything (hundreds of children in a run of the suite). A fork of this
process starts with them imported and nothing else done: no command has run here, no cache,
catalogue or setting has been read (kiln reads its environment when a command runs, never at
import), so each child starts as ``build.py`` would, with the request's argv, environment,
working directory and output files.

This process is single-threaded (a fork copies only the calling thread: a lock held by another
thread would stay held in the child), dies with the pytest worker that started it, and handles one
request at a time. Protocol, one line each: request (JSON: argv, env, cwd, out, err) in; the
child's pid out; then its exit code as ``subprocess`` gives it (negative: killed by that signal).
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import signal
import sys
import tempfile

from tests.support.kiln_process import BUILD_PY

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _preload() -> None:
    """What a command imports before doing anything: kiln's command modules (each imports what
    its command runs), and libcst's matchers, which every patch module imports."""
    import kiln.commands

    for name in kiln.commands.COMMANDS:
        importlib.import_module(f"kiln.commands.{name}")
    importlib.import_module("kiln.patch.model")


def _child(request: dict, replies: int, requests) -> None:
    """In the forked child: become ``build.py ARGV`` in the request's environment, then run it.
    Never returns: ``entry`` raises SystemExit, which ends this interpreter as it ends build.py's
    (atexit handlers, threads joined, streams flushed)."""
    os.close(replies)
    requests.close()
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["out"], os.O_WRONLY | os.O_TRUNC),
                            (2, request["err"], os.O_WRONLY | os.O_TRUNC)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # $TMPDIR is the request's
    sys.argv = [str(BUILD_PY), *request["argv"]]
    guard = request["env"].get("KILN_TEST_OFFLINE")
    if guard:  # what offline_site/sitecustomize.py does at a fresh interpreter's start
        from tests.support import netguard

        netguard.guard_child(guard)
    from kiln.commands import entry

    entry("build.py")


def serve() -> None:
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(2, 1)  # anything printed here goes to the worker's stderr, not into the protocol
    os.close(null)
    _preload()
    os.write(replies, b"ready\n")
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request, replies, requests)
        os.write(replies, f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(replies, f"{os.waitstatus_to_exitcode(status)}\n".encode())


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the worker stops us
    _die_with_parent()
    serve()
