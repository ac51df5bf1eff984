"""The warm tests' project: the build tests' fixture base in the session's real registry."""

from __future__ import annotations

import pytest

from tests.image.test_build_e2e import Project
from tests.support.registry import VLLM_VERSION


@pytest.fixture
def project(tmp_path, registry_plain) -> Project:
    return Project(tmp_path, registry_plain, registry_plain.digest_of(f"vllm/vllm-openai:v{VLLM_VERSION}"))
