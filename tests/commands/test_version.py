"""``build.py --version``: kiln's version from its package metadata and the git commit it runs from."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

from kiln import paths
from kiln.image.provenance import kiln_revision


def test_version_prints_the_package_version_and_the_commit():
    done = subprocess.run([sys.executable, "build.py", "--version"], cwd=paths.REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=paths.REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=paths.REPO).returncode != 0
    assert done.stdout == f"kiln {version('kiln')} (commit {head}{', dirty' if dirty else ''})\n"


def test_outside_a_git_checkout_the_commit_is_unknown(tmp_path):
    assert kiln_revision(tmp_path) == (None, False)
