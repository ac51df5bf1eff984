"""Fixtures for kiln's OCI tests: see ``registry_fixtures`` for what each one yields."""

import pytest
from registry_fixtures import (  # noqa: F401  (re-exported fixtures)
    base_layout,
    registry_basic,
    registry_plain,
    registry_token,
    start_registry,
    vllm_wheel,
)


@pytest.fixture(autouse=True)
def isolated_registry_env(tmp_path, monkeypatch):
    """No test may read the developer's credentials, mirrors or cache."""
    for name in ("REGISTRY_AUTH_FILE", "KILN_REGISTRY_USER", "KILN_REGISTRY_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker-config"))
    monkeypatch.setenv("KILN_REGISTRIES", str(tmp_path / "registries.toml"))
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kiln-cache"))
