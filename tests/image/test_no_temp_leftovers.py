"""A build leaves nothing in the temporary directory: every scratch tree kiln (or a tool it runs)
makes under $TMPDIR is gone when the command ends. ci/test removes pytest's own trees."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.publish.test_helm_values import IMAGE, Project
from tests.support.kiln_process import run_kiln

pytestmark = pytest.mark.registry


def test_build_push_leaves_the_temp_dir_empty(tmp_path, registry_plain):
    (tmp_path / "project").mkdir()
    project = Project(tmp_path / "project", registry_plain)
    private_tmp = tmp_path / "tmp"  # this command's own: no other test writes here
    private_tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(private_tmp), KILN_PROGRESS="quiet")
    argv = ["--pins", str(project.pins), "--images", str(project.root / "images"), "build", "--image", IMAGE,
            "--pin", "v0.20.1", "--sm", "120", "--mirror", registry_plain.mirror,
            "--repository", f"{registry_plain.host}/{project.dest}", "--push", "--oci", str(tmp_path / "layout")]
    result = subprocess.CompletedProcess(argv, *run_kiln(*argv, env=env, timeout=900))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "layout" / "index.json").is_file()  # the build did its work
    assert sorted(p.name for p in private_tmp.iterdir()) == []
