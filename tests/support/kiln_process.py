"""kiln's command line in a process of its own: ``build.py`` with the argv a test would give
``kiln.commands.main``; its exit code, stdout and stderr.

End-to-end builds and checks run here rather than in the pytest worker: a build's memory (a
patched vLLM tree, parsed modules, layer buffers) goes with its process instead of accumulating in
a worker that runs hundreds of tests, and nothing a build leaves in module state (caches, imported
patch modules, settings read once) reaches the next test in the same xdist worker. Fast
command-line tests (argument errors, refusals before any work) and tests that replace a function
of kiln's (monkeypatch) stay in-process: there an interpreter's start (~0.5 s) would be most of
the time, or the replacement would not reach the child.

The child inherits the test's environment (monkeypatch.setenv applies: KILN_CACHE_DIR,
DOCKER_CONFIG, KILN_PROGRESS, KILN_JOBS), its working directory and the `network` marker's
guard (tests/support/netguard.py). It is forked from a zygote (tests/support/kiln_zygote.py:
kiln's modules imported, no command run), not a fresh interpreter: the imports were ~1.7 s of CPU
a child. Tests that signal or kill a build mid-way start ``build.py`` themselves
(tests/support/build_processes.py).
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from tests.support import netguard

BUILD_PY = Path(__file__).resolve().parents[2] / "build.py"
REPO = BUILD_PY.parent
# KILN_TEST_FRESH_CHILDREN=1: every child a fresh interpreter (``python build.py``), as before the zygote
FRESH = "KILN_TEST_FRESH_CHILDREN"


class _Zygote:
    """This worker's ``tests/support/kiln_zygote.py`` of one kind: started on first use, once, and
    again if it died."""

    def __init__(self, kind: str):
        self.kind = kind
        self.lock = threading.Lock()
        self.process: subprocess.Popen | None = None

    def start(self) -> subprocess.Popen:
        if self.process is None or self.process.poll() is not None:
            env = {k: v for k, v in os.environ.items() if k != netguard.ENV}  # the guard is per child
            self.process = subprocess.Popen([sys.executable, "-m", "tests.support.kiln_zygote", self.kind], cwd=REPO,
                                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            if self.process.stdout.readline() != b"ready\n":
                raise RuntimeError(f"the {self.kind} zygote did not start (exit {self.process.wait()})")
        return self.process

    def run(self, what: dict, env: dict, cwd: str, timeout: float, argv: list[str]) -> tuple[int, str, str]:
        """A forked child for the request ``what`` (kiln_zygote's argv or call): its exit code,
        stdout and stderr; ``argv`` names it in a TimeoutExpired."""
        process = self.start()
        with tempfile.TemporaryDirectory(prefix="kiln-child-") as work:
            out, err = Path(work, "out"), Path(work, "err")
            out.touch()
            err.touch()
            request = {**what, "env": env, "cwd": cwd, "out": str(out), "err": str(err)}
            process.stdin.write(json.dumps(request).encode() + b"\n")
            process.stdin.flush()
            pid = int(process.stdout.readline())
            with selectors.DefaultSelector() as wait:
                wait.register(process.stdout, selectors.EVENT_READ)
                if not wait.select(timeout):
                    os.kill(pid, 9)
                    process.stdout.readline()
                    raise subprocess.TimeoutExpired(argv, timeout)
            code = int(process.stdout.readline())
            return code, out.read_text(), err.read_text()

    def forked(self, what: dict, env: dict, cwd: str, timeout: float, argv: list[str]) -> tuple[int, str, str] | None:
        """``run``, unless this zygote is busy (a test running children from threads) or
        ``$KILN_TEST_FRESH_CHILDREN`` is set: then None, and the caller starts a fresh interpreter."""
        if os.environ.get(FRESH) or not self.lock.acquire(blocking=False):
            return None
        try:
            return self.run(what, env, cwd, timeout, argv)
        finally:
            self.lock.release()


_ZYGOTES = {kind: _Zygote(kind) for kind in ("kiln", "in-child")}


def run_forked(kind: str, what: dict, argv: list[str], timeout: float, env: dict | None = None,
               cwd=None) -> tuple[int, str, str]:
    """A child of this worker's ``kind`` zygote for ``what``, else (zygote busy, or
    ``$KILN_TEST_FRESH_CHILDREN``) ``argv`` run by a fresh interpreter: (exit code, stdout, stderr).
    ``env`` replaces the test's environment, ``cwd`` its working directory."""
    env = dict(os.environ) if env is None else dict(env)
    cwd = os.path.abspath(cwd if cwd is not None else os.getcwd())
    done = _ZYGOTES[kind].forked(what, env, cwd, timeout, argv)
    if done is not None:
        return done
    fresh = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout, env=env,
                           cwd=cwd)
    return fresh.returncode, fresh.stdout, fresh.stderr


def run_kiln(*argv, timeout: float = 900, env: dict | None = None, cwd=None) -> tuple[int, str, str]:
    """``build.py *argv`` in a child process: (exit code, stdout, stderr); ``env`` replaces the
    test's environment, ``cwd`` its working directory. The child is a fork of this worker's zygote
    (kiln imported, nothing run); when the zygote is busy (a test running children from threads)
    or ``$KILN_TEST_FRESH_CHILDREN`` is set, a fresh interpreter."""
    argv = [str(arg) for arg in argv]
    return run_forked("kiln", {"argv": argv}, [sys.executable, str(BUILD_PY), *argv], timeout, env, cwd)
