"""Shared fixtures: the real pristine vLLM trees of every pin and candidate, the catalogue, and
the real registry (``tests/support/registry.py``).

The trees come from the release wheels on PyPI through kiln's own `WheelSource` (sha256
checked against the index), cached under the kiln cache, so the first run downloads them.

Tests marked ``registry`` or ``isolated`` run with an empty kiln cache of their own and no
access to the developer's credentials or mirrors (``isolated_registry_env``).
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
from packaging.version import Version

from kiln import paths
from kiln.patch.catalog import load_catalogue
from kiln.patch.engine import Session
from kiln.pins import load_pins
from kiln.source.wheel import WheelSource
from tests.support import netguard
from tests.support.registry import (  # noqa: F401  (fixtures, shared by every test package)
    TOOLCHAIN_CACHE,
    base_layout,
    registry_basic,
    registry_plain,
    registry_token,
    release_multi,
    start_registry,
    vllm_wheel,
    vllm_wheel_aarch64,
)

# Every source the record covers: label -> vLLM release whose wheel holds its pristine source.
# The pins come from pins.toml, so after `pin bump --write` the new pin is checked (record,
# golden diffs, idempotence) and the dropped one no longer is; candidates are listed here.
CANDIDATES: dict[str, str] = {}  # e.g. {"vllm-0.34.0": "0.34.0"} while a release is evaluated unpinned
SOURCES = {name: str(pin.vllm) for name, pin in load_pins(paths.PINS).items()} | CANDIDATES


# Commands run as before plain progress lines existed (stderr is not a terminal here): tests that
# check progress ask for it with --progress (tests/commands/test_progress.py). Set for the whole
# session, not per test: module-scoped fixtures run their commands before any per-test fixture.
os.environ["KILN_PROGRESS"] = "quiet"
# Under pytest-xdist each worker is one of several processes sharing the machine's cores: a build
# in it patches and compiles in one process (kiln/jobs.py) rather than forking a worker per core.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("KILN_JOBS", "1")

# -- the `network` marker, kept true ------------------------------------------------------------
# A test that uses one of these fixtures (directly or through another fixture) reads real vLLM
# wheels from PyPI on a machine whose kiln cache lacks them: it is marked `network` at collection.
# A test that reaches any other host without the marker fails (the audit hook below), so
# `-m "not network and not registry"` is an offline lane by construction, not by convention.
# every tree, session and registry fixture uses trees or vllm_wheel; every `toolchain` fixture (and
# test_imagekey's `pinned`) makes a Triton toolchain from PyPI's wheel (kiln/triton/toolchain.py)
NETWORK_FIXTURES = frozenset({"trees", "vllm_wheel", "vllm_wheel_aarch64", "release_multi", "toolchain", "pinned"})
_unmarked: dict = {"test": None, "reached": []}  # the running test when it is not marked network
# Every Python process a test starts loads the guard too (tests/support/netguard.py says how): its
# folder is on PYTHONPATH for the whole session, the guard armed only while an unmarked test runs.
os.environ["PYTHONPATH"] = os.pathsep.join([str(netguard.SITE), *filter(None, [os.environ.get("PYTHONPATH")])])


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if NETWORK_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.network)


def _audit(event: str, args: tuple) -> None:
    if _unmarked["test"] is None or not event.startswith("socket."):
        return
    host = netguard.host_of(event, args)
    if netguard.outside(host):
        _unmarked["reached"].append(host)
        raise netguard.refusal(_unmarked["test"], host)


sys.addaudithook(_audit)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """From the test's first fixture to its last teardown (a module fixture set up for it counts)."""
    marked = item.get_closest_marker("network") is not None
    _unmarked.update(test=None if marked else item.nodeid, reached=[])
    if not marked:  # the file its children record refused hosts in
        fd, record = tempfile.mkstemp(prefix="pytest-offline-reached-")
        os.close(fd)
        os.environ[netguard.ENV] = f"{item.nodeid}\n{record}"
    try:
        yield
    finally:
        _unmarked["test"] = None
        os.environ.pop(netguard.ENV, None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that swallowed the refused connection still fails: the marker is what is wrong."""
    report = (yield).get_result()
    if call.when == "teardown":
        _unmarked["reached"] += netguard.reached_by_children(os.environ.get(netguard.ENV))
    if call.when == "teardown" and _unmarked["reached"] and report.passed:
        report.outcome = "failed"
        report.longrepr = (f"reached {sorted(set(_unmarked['reached']))} without the network marker: "
                           "mark the test (or give it a fixture of NETWORK_FIXTURES, tests/conftest.py)")


@pytest.fixture(autouse=True)
def isolated_registry_env(request, tmp_path, tmp_path_factory, monkeypatch):
    """No registry test may read the developer's credentials, mirrors or cache."""
    if request.node.get_closest_marker("registry") is None and request.node.get_closest_marker("isolated") is None:
        return
    for name in ("REGISTRY_AUTH_FILE", "KILN_REGISTRY_USER", "KILN_REGISTRY_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker-config"))
    monkeypatch.setenv("KILN_REGISTRIES", str(tmp_path / "registries.toml"))
    # not the machine's podman/skopeo mirrors (an empty file outside the test's own tmp_path, which
    # some tests list)
    containers_conf = tmp_path_factory.getbasetemp() / "empty-containers-registries.conf"
    containers_conf.touch()
    monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF", str(containers_conf))
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kiln-cache"))
    # the Triton toolchains (~190 MB each) are fetched once for all tests, not once per test
    monkeypatch.setenv("KILN_TRITON_TOOLCHAINS", str(TOOLCHAIN_CACHE / "triton" / "toolchains"))


@pytest.fixture(scope="session")
def catalogue():
    return load_catalogue(paths.PATCHSETS)


@pytest.fixture(scope="session")
def trees():
    """label -> SourceTree, fetched lazily and once per test session."""
    cache: dict = {}

    def get(label: str):
        if label not in cache:
            cache[label] = WheelSource(Version(SOURCES[label])).fetch()
        return cache[label]

    return get


@pytest.fixture(scope="session")
def sessions(trees):
    """label -> engine Session (parsed modules shared across tests)."""
    cache: dict = {}

    def get(label: str):
        if label not in cache:
            cache[label] = Session(trees(label))
        return cache[label]

    return get


@pytest.fixture(scope="session")
def tree_0201(trees):
    return trees("v0.20.1")


@pytest.fixture(scope="session")
def tree_0330(trees):
    return trees("v0.33.0")
