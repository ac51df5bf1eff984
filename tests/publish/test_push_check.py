"""A push destination is checked before any work: an unreachable registry, or one that refuses
the push, fails in one line naming ``--repository`` before the base is pulled or patched (it
used to fail only after the whole build); a registry that takes the push still gets the image."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.image.test_build_e2e import TAG, Project, _tag_exists
from tests.support.cli import one_line_error
from tests.support.registry import VLLM_VERSION, free_port

pytestmark = pytest.mark.registry


@pytest.fixture
def project(tmp_path, registry_plain) -> Project:
    return Project(tmp_path, registry_plain, registry_plain.digest_of(f"vllm/vllm-openai:v{VLLM_VERSION}"))


def _no_work_done() -> None:
    cache = Path(os.environ["KILN_CACHE_DIR"])
    # no blob pulled, no source read, no build folder made
    assert not any((cache / part).exists() for part in ("blobs", "sources", "build", "images")), \
        sorted(p.name for p in cache.iterdir()) if cache.exists() else None


def test_an_unreachable_repository_fails_in_one_line_before_the_pull(project, capsys):
    dest = f"127.0.0.1:{free_port()}/test/nowhere"  # a closed port
    start = time.monotonic()
    code, _, err = project.build(capsys, "--progress", "plain", "--push", "--repository", dest)
    took = time.monotonic() - start
    assert code == 2
    line = one_line_error(err)  # the only line on stderr: no stage, no transfer was reported
    assert line.startswith(f"error: --push to {dest}: cannot push there: ") and "unreachable" in line, line
    assert took < 20, took
    _no_work_done()


def test_a_repository_that_refuses_the_push_fails_before_the_pull(project, capsys, registry_basic):
    dest = f"{registry_basic.host}/{project.dest}"  # no credentials given
    code, _, err = project.build(capsys, "--progress", "plain", "--push", "--repository", dest,
                                 "--insecure-registry", registry_basic.host)
    assert code == 2
    line = one_line_error(err)
    assert line.startswith(f"error: --push to {dest}: cannot push there: "), line
    _no_work_done()


def test_a_reachable_repository_still_gets_the_image(project, capsys, start_registry):
    other = start_registry("plain")
    dest = f"{other.host}/{project.dest}"
    code, result, err = project.build(capsys, "--push", "--repository", dest, "--insecure-registry", other.host)
    assert code == 0, err
    assert result["outputs"]["push"] == f"{dest}:{TAG}@{result['manifest_digest']}"
    assert _tag_exists(other, project.dest, TAG)
