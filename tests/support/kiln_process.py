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
guard (tests/support/netguard.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BUILD_PY = Path(__file__).resolve().parents[2] / "build.py"


def run_kiln(*argv, timeout: float = 900) -> tuple[int, str, str]:
    """``build.py *argv`` in a child interpreter: (exit code, stdout, stderr)."""
    done = subprocess.run([sys.executable, str(BUILD_PY), *map(str, argv)], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout)
    return done.returncode, done.stdout, done.stderr
