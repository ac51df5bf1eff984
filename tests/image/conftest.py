"""Fixtures the build's end-to-end tests share: the project (a base in a real registry) and a
count of the patchings a build ran (a cache hit runs none)."""

from __future__ import annotations

import pytest

import kiln.image.prepare as prepare_module
from tests.image.test_build_e2e import Project
from tests.support.registry import VLLM_VERSION


@pytest.fixture
def project(tmp_path, registry_plain) -> Project:
    return Project(tmp_path, registry_plain, registry_plain.digest_of(f"vllm/vllm-openai:v{VLLM_VERSION}"))


@pytest.fixture
def patch_runs(monkeypatch, project) -> list[int]:
    """How many times a build ran the patch selection (a cache hit runs none): counted in this
    process, so the project's builds run in it."""
    project.in_process = True
    calls: list[int] = []
    real = prepare_module.patched_selection

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(prepare_module, "patched_selection", counted)
    return calls
