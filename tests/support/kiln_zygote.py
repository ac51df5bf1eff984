"""An interpreter with its modules already imported, forked once per request
(tests/support/kiln_process.py): ``python -m tests.support.kiln_zygote [KIND]``.

KIND ``kiln`` (the default) is for kiln's command line: a build's child spent ~1.7 s of CPU
importing kiln, libcst's matchers and the command's modules before doing anything (hundreds of
children in a run of the suite). A fork of this process starts with them imported and nothing else
done: no command has run here, no cache, catalogue or setting has been read (kiln reads its
environment when a command runs, never at import), so each child starts as ``build.py`` would, with
the request's argv, environment, working directory and output files.

KIND ``in-child`` is for ``tests.support.vllm_modules.in_child``: torch imported (~4 s of CPU a
child here, and every test of real vLLM modules imports it) and nothing run with it (no tensor op:
no OpenMP pool exists to be copied half-held), then each request's test run as the fresh
interpreter ran it.

This process is single-threaded in Python (a fork copies only the calling thread: a lock held by
another thread would stay held in the child; torch's import starts one native thread, which holds
nothing while no op has run, as its DataLoader workers forked after the import rely on), dies with
the pytest worker that started it, and handles one request at a time. Protocol, one line each:
request (JSON: env, cwd, out, err, and argv or call) in; the child's pid out; then its exit code
as ``subprocess`` gives it (negative: killed by that signal).
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


def _preload_kiln() -> None:
    """What a command imports before doing anything: kiln's command modules (each imports what
    its command runs), and libcst's matchers, which every patch module imports."""
    import kiln.commands

    for name in kiln.commands.COMMANDS:
        importlib.import_module(f"kiln.commands.{name}")
    importlib.import_module("kiln.patch.model")


def _preload_in_child() -> None:
    """What ``in_child``'s tests import before their own code: the child's half of in_child, and
    torch. Not Triton (nor Dynamo, which imports it): a test may set ``TRITON_INTERPRET`` in its
    child, and Triton imported before that runs kernels compiled, not interpreted."""
    from kiln.schema import skip_format_grammars

    skip_format_grammars()  # as _run_in_child does first
    for name in ("tests.support.vllm_modules", "tests.conftest", "kiln.source.wheel", "torch"):
        importlib.import_module(name)
    if "triton" in sys.modules:
        raise RuntimeError("the in-child zygote imported Triton: its children could not interpret kernels")


def _run_kiln(request: dict) -> None:
    sys.argv = [str(BUILD_PY), *request["argv"]]
    from kiln.commands import entry

    entry("build.py")


def _run_in_child(request: dict) -> None:
    """As ``python -m tests.support.vllm_modules CALL`` ends: 0, or 1 with the traceback on stderr."""
    import traceback

    from tests.support.vllm_modules import _run_in_child as run

    try:
        run(request["call"])
    except BaseException:  # noqa: BLE001 (the fresh interpreter's exit: any exception, its traceback)
        traceback.print_exc()
        raise SystemExit(1) from None
    raise SystemExit(0)


KINDS = {"kiln": (_preload_kiln, _run_kiln), "in-child": (_preload_in_child, _run_in_child)}


def _child(request: dict, replies: int, requests, run) -> None:
    """In the forked child: take the request's environment, then ``run`` it (``build.py ARGV``, or
    an in_child test). Never returns: ``run`` raises SystemExit, which ends this interpreter as it
    ends a fresh one (atexit handlers, threads joined, streams flushed)."""
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
    guard = request["env"].get("KILN_TEST_OFFLINE")
    if guard:  # what offline_site/sitecustomize.py does at a fresh interpreter's start
        from tests.support import netguard

        netguard.guard_child(guard)
    run(request)


def serve(kind: str) -> None:
    preload, run = KINDS[kind]
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(2, 1)  # anything printed here goes to the worker's stderr, not into the protocol
    os.close(null)
    preload()
    os.write(replies, b"ready\n")
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request, replies, requests, run)
        os.write(replies, f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(replies, f"{os.waitstatus_to_exitcode(status)}\n".encode())


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the worker stops us
    _die_with_parent()
    serve(sys.argv[1] if len(sys.argv) > 1 else "kiln")
