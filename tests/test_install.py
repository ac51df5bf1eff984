"""What a fresh machine's pip resolves, ignoring this machine's pip configuration.

The machine running the tests may have local wheels and indexes (a CPU torch no user has):
``PIP_CONFIG_FILE=/dev/null`` and ``--isolated`` leave only PyPI, as on a new user's machine.
``--dry-run`` resolves against the real index (metadata only, nothing installed).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from kiln import paths

pytestmark = pytest.mark.network


def _resolve(tmp_path, *requirements: str) -> dict[str, dict]:
    report = tmp_path / "report.json"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PIP_")}, "PIP_CONFIG_FILE": os.devnull}
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed", "--quiet",
         "--disable-pip-version-check", "--report", str(report), *requirements],
        cwd=paths.REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return {item["metadata"]["name"].lower(): item for item in json.loads(report.read_text())["install"]}


def test_the_readme_install_resolves_and_needs_no_torch(tmp_path):
    readme = (paths.REPO / "README.md").read_text()
    command = re.search(r"\.venv/bin/pip install (-e \S+)", readme)
    assert command and command.group(1) == "-e .", "README's set-up command changed: update this test"
    resolved = _resolve(tmp_path, "-e", ".")
    assert {"kiln", "libcst", "requests", "packaging", "jsonschema"} <= set(resolved)
    # zstd base layers: the stdlib's compression.zstd from 3.14, its backport before
    assert ("backports.zstd" in resolved) == (sys.version_info < (3, 14))
    # what `build` fetches per pin (Triton) comes later, into kiln's cache; torch never
    assert not {"torch", "triton", "numpy"} & set(resolved)


def test_the_test_dependencies_resolve_together_on_pypi_alone(tmp_path):
    resolved = _resolve(tmp_path, "-e", ".[test]")
    torch = resolved["torch"]["metadata"]
    triton = resolved["triton"]["metadata"]["version"]
    # the Triton torch itself requires on Linux, where PyPI has torch's CUDA build only
    wanted = [Requirement(r) for r in torch.get("requires_dist", []) if r.startswith("triton")]
    linux = [r for r in wanted if r.marker is None or r.marker.evaluate({"platform_system": "Linux",
                                                                         "platform_machine": "x86_64",
                                                                         "sys_platform": "linux"})]
    assert all(r.specifier.contains(triton) for r in linux), (torch["version"], [str(r) for r in linux], triton)
    pinned = {Requirement(r).name: Requirement(r) for r in _test_extra()}
    assert pinned["torch"].specifier.contains(torch["version"].split("+")[0])
    assert pinned["triton"].specifier.contains(triton)


def _test_extra() -> list[str]:
    import tomllib

    return tomllib.loads((paths.REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]


def test_a_selection_of_ci_test_skips_pip_and_ruff_once_the_venv_is_current():
    """`ci/test -k NAME` runs one test, not apt, pip and ruff first (3 min 25 s for one test, once):
    pip is skipped when .venv was installed from this pyproject.toml, ruff for any selection."""
    repo = Path(__file__).resolve().parent.parent
    argv = ["bash", str(repo / "ci" / "test"), str(Path(__file__).resolve()), "-q", "-k", "no_test_has_this_name"]
    runs = [subprocess.run(argv, cwd=repo, capture_output=True, text=True, timeout=900) for _ in range(2)]
    for run in runs:
        assert run.returncode == 5, run.stdout[-2000:] + run.stderr[-2000:]  # pytest: no test selected
    second = runs[1].stdout + runs[1].stderr
    assert "no pip, no ruff for a selection" in second, second[-2000:]
    assert "All checks passed" not in second  # ruff did not run
    stamp = (repo / ".venv" / ".kiln-installed").read_text().strip()
    assert stamp == hashlib.sha256((repo / "pyproject.toml").read_bytes()).hexdigest()
