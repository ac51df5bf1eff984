"""Shared bits of the benchmark scripts: timing subprocesses and updating docs/BENCHMARKS.md.

Each benchmark owns one section of BENCHMARKS.md, delimited by HTML comments, and rewrites
only that section, so benchmarks can be re-run independently.
"""

from __future__ import annotations

import os
import platform
import resource
import shutil
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
    cpu: float = 0.0  # user + system seconds of the process and every descendant it waited for


def measured(cmd: list[str], env: dict | None = None, cwd: Path = REPO) -> Measured:
    """One run of ``cmd``: wall time, output, its own peak RSS and its CPU time (with its children's).

    The RSS comes from GNU time (``/usr/bin/time -f %M``), a small process: ``wait4`` on a
    child forked from this (large) benchmark process reports at least this process's own RSS
    at the fork, because Linux carries the high-water mark of the forked copy across exec.
    """
    time_bin = shutil.which("time") or "/usr/bin/time"
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile(suffix=".rss") as rss:
        wrapped = [time_bin, "-f", "%M", "-o", rss.name, *cmd] if Path(time_bin).is_file() else cmd
        start = time.perf_counter()
        proc = subprocess.Popen(wrapped, cwd=cwd, env={**os.environ, **(env or {})}, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        kib = usage.ru_maxrss
        if wrapped is not cmd:
            text = Path(rss.name).read_text().split()
            kib = int(text[-1]) if text and text[-1].isdigit() else kib
        return Measured(wall, proc.returncode, out.read().decode(errors="replace"),
                        err.read().decode(errors="replace"), kib / 1024, usage.ru_utime + usage.ru_stime)


def median_of(cmd: list[str], runs: int, env: dict | None = None) -> float:
    return statistics.median(timed(cmd, env)[0] for _ in range(runs))


def peak_child_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def machine() -> str:
    # Python's bytecode cache: a fresh install writes it (pip compiles, or the first run does); a
    # machine that sets PYTHONDONTWRITEBYTECODE compiles every module it imports in every process
    bytecode = "not written (PYTHONDONTWRITEBYTECODE set)" if os.environ.get("PYTHONDONTWRITEBYTECODE") else "written"
    return f"{os.cpu_count()} cores, Python {platform.python_version()}, {platform.machine()}, bytecode {bytecode}"


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
