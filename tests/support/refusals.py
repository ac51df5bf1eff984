"""What tests of refusals before any work share: a Docker Hub that records what it is sent
(nothing, when kiln refuses first), a workspace with inputs of its own, and the check.

    hub, workspace                       fixtures (import them into a conftest.py)
    build(workspace, hub, *argv) -> CliRun    ``build`` of e2e-p65 from the workspace's inputs
    snapshot(root) -> {path: bytes | None}
    assert_refused(run, hub, root, before, *expected) -> the error line
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import TEST_IMAGES
from tests.support.faultproxy import FaultProxy
from tests.support.reliability_checks import CliRun, assert_one_line_error, run_cli

DIGEST = "sha256:" + "ab" * 32
PINS = ('[pins."v0.20.1"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:v0.20.1"\n'
        f'vllm = "0.20.1"\ncuda = "cu130"\ndigest = "{DIGEST}"\n')


@pytest.fixture
def hub():
    """Docker Hub as far as kiln knows: a listener that records every request (none expected)."""
    proxy = FaultProxy("127.0.0.1:9")  # would forward to the discard port; nothing should arrive
    yield proxy
    proxy.stop()


@pytest.fixture
def workspace(tmp_path, monkeypatch) -> Path:
    """``tmp_path/ws`` holding ``pins.toml`` and a copy of the test image definitions
    (``defs/``); the cache, registries file and auth file are the isolated ones of
    ``tests/conftest.py`` (under ``tmp_path``, not created)."""
    root = tmp_path / "ws"
    root.mkdir()
    (root / "pins.toml").write_text(PINS)
    (root / "defs").mkdir()
    for definition in TEST_IMAGES.glob("*.toml"):
        (root / "defs" / definition.name).write_bytes(definition.read_bytes())
    monkeypatch.chdir(root)
    return root


def build(workspace: Path, hub, *extra: str) -> CliRun:
    return run_cli(["--pins", str(workspace / "pins.toml"), "--images", str(workspace / "defs"), "build",
                    "--image", "e2e-p65", "--pin", "v0.20.1", "--sm", "120", "--mirror", hub.mirror, *extra])


def snapshot(root: Path) -> dict[Path, bytes | None]:
    """Every path under ``root`` with its bytes (None for anything but a regular file)."""
    return {p: p.read_bytes() if p.is_file() and not p.is_symlink() else None for p in root.rglob("*")
            if not p.is_fifo()}


def assert_refused(run: CliRun, hub, root: Path, before: dict, *expected: str) -> str:
    """Exit 2 with one line holding ``expected``; no request sent; nothing under ``root``
    created, changed or removed (not even the cache directory)."""
    line = assert_one_line_error(run, *expected)
    assert hub.requests() == [], [s.path for s in hub.requests()]
    assert snapshot(root) == before
    return line
