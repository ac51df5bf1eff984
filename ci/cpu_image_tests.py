"""vLLM's own tests of the files an image patches, run by the image's Python in its rootfs.

    .venv/bin/python ci/cpu_image_tests.py SPEC.json        (ci/serve_check writes SPEC and runs it)

The live part of ``ci/upstream_tests.py`` inside ``ci/serve_check``: the serve check has unpacked
the kiln image and its pristine base, so vLLM's CPU environment is there twice, patched and not.

1. The release's sdist (``upstream_tests.sdist_tests``: from the index, sha256-checked, cached
   under ``<kiln cache>/upstream-tests/``).
2. The selection: ``upstream_tests.select_tests`` with the files the image's
   ``/opt/kiln/manifest.json`` lists as patched, kept to the spec's ``only`` prefixes
   (``tests/parser``: the test files of the parser engine K1 patches).
3. Each side, the two at once: the sdist's ``tests/`` and ``pyproject.toml`` copied into the rootfs
   (``/tmp/vllm-tests``); from there, the image's ``/opt/venv/bin/python`` must find ``vllm`` in the
   image's venv (never in the tests' folder), then runs ``pytest --junitxml`` on the selection with
   ``VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1``. The command runs
   through the spec's ``in_root`` prefix for that rootfs (serve_check's ``in_chroot``: a chroot
   in its own PID and mount namespaces) with ``kiln.lifeline``, so it dies with this process.
4. The verdict: ``upstream_tests.junit_results`` reads each report, ``upstream_tests.compare`` compares
   them. A test passing on pristine and failing (or missing) patched is a regression.

The whole run is bounded (the spec's ``timeout``). Prints the evidence (JSON) and exits 0; on a
regression, a side that ran nothing, a side past the bound or bad input, one line
``error: vllm tests: <why>`` and exit 1 (serve_check turns it into its ``vllm tests`` step).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import upstream_tests as upstream  # ci/upstream_tests.py, beside this script: sdist, selection, reports, verdict
from packaging.version import Version

from kiln import lifeline
from kiln.cache import cache_dir
from kiln.errors import KilnError

TESTS_DIR = "/tmp/vllm-tests"  # in each rootfs
PYTHON = "/opt/venv/bin/python"  # the image's
VENV = "/opt/venv/"
ENV = {"PATH": "/opt/venv/bin:/usr/bin:/bin", "HOME": "/root", "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
       "PYTHONDONTWRITEBYTECODE": "1"}
# where the image's Python finds vLLM, seen from the tests' folder (the cwd is on sys.path)
FIND_VLLM = "import importlib.util as u; print(u.find_spec('vllm').origin)"

# run_in_root(rootfs, cwd, env, argv, timeout) -> (exit status, stdout + stderr): argv run in the
# rootfs with that cwd and only that env (paths as the rootfs sees them)
RunInRoot = Callable[[Path, str, dict, list, float], tuple[int, str]]


class Failed(Exception):
    """The step failed: the message is serve_check's one line after ``vllm tests: ``."""


def patched_rels(manifest: dict) -> dict[str, str]:
    """The manifest's patched files as ``select_tests`` takes them: path under ``vllm/`` -> ""."""
    site = manifest["site_dir"].strip("/")
    rels = {}
    for path in manifest["files"]:
        rel = path.strip("/").removeprefix(site + "/")
        if rel.startswith("vllm/"):
            rels[rel.removeprefix("vllm/")] = ""
    return rels


def selection(tests_root: Path, manifest: dict, only: list[str]) -> list[str]:
    chosen = upstream.select_tests(tests_root, patched_rels(manifest))
    files = sorted(f for f in chosen if any(f.startswith(prefix) for prefix in only))
    if not files:
        raise Failed(f"no test file of vLLM's under {', '.join(only)} imports a file the image patches "
                     f"({len(chosen)} elsewhere)")
    return files


def run_side(side: str, rootfs: Path, tests_root: Path, files: list[str], run_in_root: RunInRoot,
             deadline: float, venv: str = VENV) -> dict:
    """One side: the tests copied into ``rootfs``, vLLM found in the image's venv, pytest run."""
    started = time.monotonic()
    dest = rootfs / TESTS_DIR.lstrip("/")
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(tests_root / "tests", dest / "tests", symlinks=True)
    shutil.copy(tests_root / "pyproject.toml", dest / "pyproject.toml")

    def in_root(argv: list[str]) -> tuple[int, str]:
        left = deadline - time.monotonic()
        if left <= 0:
            raise subprocess.TimeoutExpired(argv, 0)
        return run_in_root(rootfs, TESTS_DIR, ENV, argv, left)

    status, out = in_root([PYTHON, "-c", FIND_VLLM])
    origin = out.strip().splitlines()[-1] if out.strip() else ""
    if status != 0 or not origin.startswith(venv):
        raise Failed(f"the {side} image's Python finds vllm at {origin or '(nothing)'}, not in its venv {venv} "
                     f"(exit {status})")
    report = dest / "junit.xml"
    status, out = in_root([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=line",
                           f"--junitxml={TESTS_DIR}/junit.xml", "-o", "junit_family=xunit1", *files])
    if not report.is_file():
        lines = [line for line in out.splitlines() if line.strip()]
        raise Failed(f"pytest on the {side} side wrote no report (exit {status}: {lines[-1] if lines else 'no output'})")
    try:
        results = upstream.junit_results(report)
    except ET.ParseError as err:
        raise Failed(f"the {side} side's report {report}: {err}") from None
    return {"results": results, "seconds": round(time.monotonic() - started, 1), "vllm_from": origin,
            "pytest_exit": status}


def check(tests_root: Path, files: list[str], roots: dict[str, Path], run_in_root: RunInRoot, timeout: float,
          venv: str = VENV) -> dict:
    """Both sides at once (separate processes: on 2 cores, one side's time), then the verdict."""
    started = time.monotonic()
    deadline = started + timeout
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {side: pool.submit(run_side, side, roots[side], tests_root, files, run_in_root, deadline, venv)
                   for side in ("pristine", "patched")}
        sides = {}
        for side, future in futures.items():
            try:
                sides[side] = future.result()
            except subprocess.TimeoutExpired:
                raise Failed(f"the {side} side did not finish within the {timeout:.0f} s bound "
                             f"({len(files)} test files)") from None
    verdict = upstream.compare(sides["pristine"]["results"], sides["patched"]["results"])
    evidence = {
        "files": files, "timeout_s": timeout, "seconds": round(time.monotonic() - started, 1),
        "sides": {side: {"tests": len(s["results"]),
                         "passed": sum(r["outcome"] == "passed" for r in s["results"].values()),
                         "seconds": s["seconds"], "pytest_exit": s["pytest_exit"], "vllm_from": s["vllm_from"]}
                  for side, s in sides.items()},
        "regressions": verdict["regressions"], "not_runnable": len(verdict["not_runnable"]),
        "skipped": len(verdict["skipped"]), "passing_only_when_patched": verdict["passing_only_when_patched"]}
    if verdict["regressions"]:
        raise Failed(f"{len(verdict['regressions'])} of vLLM's tests pass on pristine and fail patched: "
                     + ", ".join(verdict["regressions"]))
    if not evidence["sides"]["pristine"]["passed"]:
        first = verdict["not_runnable"][0]["why"] if verdict["not_runnable"] else "no test collected"
        raise Failed(f"no test passed on pristine ({evidence['sides']['pristine']['tests']} ran; {first}): "
                     f"the image cannot run them, so they prove nothing")
    return evidence


def chroot_runner(prefixes: dict[str, list[str]]) -> RunInRoot:
    """Each rootfs's command prefix (serve_check's ``in_chroot``), run niced through kiln.lifeline:
    the child gets SIGKILL when the thread that started it (and so this process) dies, and a
    timeout kills it too; the prefix's namespaces take every process the tests started with it."""
    def run_in_root(rootfs: Path, cwd: str, env: dict, argv: list, timeout: float) -> tuple[int, str]:
        command = ["nice", *prefixes[str(rootfs)], "/usr/bin/env", "-i", "-C", cwd,
                   *(f"{key}={value}" for key, value in env.items()), *argv]
        done = lifeline.run(command, timeout=timeout)
        return done.returncode, done.stdout + done.stderr

    return run_in_root


def main(argv: list[str] | None = None, run_in_root: RunInRoot | None = None) -> int:
    """SPEC: {"vllm", "only", "timeout", "manifest", "sides": {"pristine"|"patched": {"rootfs", "in_root"}}};
    ``run_in_root`` (a test's) in place of the spec's ``in_root`` prefixes."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if len(argv) != 1:
            raise KilnError("usage: cpu_image_tests.py SPEC.json")
        spec = json.loads(Path(argv[0]).read_text())
        home = cache_dir() / "upstream-tests"
        home.mkdir(parents=True, exist_ok=True)
        tests_root = upstream.sdist_tests(Version(spec["vllm"]), home)
        files = selection(tests_root, json.loads(Path(spec["manifest"]).read_text()), spec["only"])
        roots = {side: Path(entry["rootfs"]) for side, entry in spec["sides"].items()}
        runner = run_in_root or chroot_runner({entry["rootfs"]: entry["in_root"] for entry in spec["sides"].values()})
        evidence = check(tests_root, files, roots, runner, float(spec["timeout"]))
    except Failed as err:
        print(f"error: vllm tests: {err}", file=sys.stderr)
        return 1
    except (KilnError, OSError, KeyError, ValueError, requests.RequestException) as err:
        print(f"error: vllm tests: {type(err).__name__}: {err}".splitlines()[0], file=sys.stderr)
        return 1
    evidence["sdist"] = {"file": f"vllm-{spec['vllm']}.tar.gz", "sha256": tests_root.name.removeprefix("sdist-sha256-")}
    evidence["only"] = spec["only"]
    print(json.dumps(evidence, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
