"""Shared bits of the benchmark scripts: timing subprocesses and updating docs/BENCHMARKS.md.

Each benchmark owns one section of BENCHMARKS.md, delimited by HTML comments, and rewrites
only that section, so benchmarks can be re-run independently.
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "docs" / "BENCHMARKS.md"


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, int]:
    """Wall seconds and exit code of one run of ``cmd`` (output discarded)."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - start
    if proc.returncode not in (0, 1):
        sys.exit(f"benchmark command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr.decode()}")
    return elapsed, proc.returncode


@dataclass
class Measured:
    wall: float  # seconds
    returncode: int
    stdout: str
    stderr: str
    max_rss_mib: float  # peak resident set of the process (and the children it waited for)


def measured(cmd: list[str], env: dict | None = None, cwd: Path = REPO) -> Measured:
    """One run of ``cmd``: wall time, output and its own peak RSS (``wait4``, not the whole
    benchmark's RUSAGE_CHILDREN maximum)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **(env or {})}, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Measured(wall, proc.returncode, out.read().decode(errors="replace"),
                        err.read().decode(errors="replace"), usage.ru_maxrss / 1024)


def median_of(cmd: list[str], runs: int, env: dict | None = None) -> float:
    return statistics.median(timed(cmd, env)[0] for _ in range(runs))


def peak_child_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def machine() -> str:
    return f"{os.cpu_count()} cores, Python {platform.python_version()}, {platform.machine()}"


def write_section(name: str, body: str) -> None:
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = BENCHMARKS.read_text() if BENCHMARKS.exists() else "# Benchmarks\n\nFigures measured by the scripts in `ci/`; each section says how to reproduce it.\n"
    block = f"{start}\n{body.strip()}\n{end}"
    if start in text:
        before, rest = text.split(start, 1)
        after = rest.split(end, 1)[1]
        text = before + block + after
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    BENCHMARKS.parent.mkdir(exist_ok=True)
    BENCHMARKS.write_text(text)
