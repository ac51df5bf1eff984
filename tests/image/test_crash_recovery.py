"""A build killed with SIGKILL -- at each phase, and at random moments -- then run again.

After the kill: no tag names an incomplete image, the output directory does not exist, and
every final cache entry is verified (temporary entries may remain: nothing ran to remove them).
The re-run completes, re-uses what the killed build verified and cached, gives the same
manifest digest as an uninterrupted build, and leaves no temporary entry behind.

Phases are hit deterministically with ``KILN_TEST_PAUSE_AT`` (``kiln/pausepoint.py``): the
build prints ``kiln: paused at <phase>`` and sleeps there until it is killed.
"""

from __future__ import annotations

import random
import signal
import time

import pytest

from tests.support.build_processes import (
    Workspace,
    check_cache,
    finish,
    layout_digest,
    tag_digest,
    wait_for_pause,
)
from tests.support.reliability_checks import tag_state

pytestmark = [pytest.mark.registry, pytest.mark.reliability]

PIN, SM = "v0.20.1", 120


@pytest.fixture(scope="module")
def reference(tmp_path_factory, registry_plain) -> tuple[Workspace, dict]:
    """The workspace, and what an uninterrupted build in a fresh cache gives."""
    root = tmp_path_factory.mktemp("crash")
    workspace = Workspace.create(root / "ws", registry_plain)
    return workspace, workspace.run(root / "cache", PIN, SM, root / "out", "test/crash-reference")


def _killed_then_rerun(workspace: Workspace, reference: dict, tmp_path, dest: str, kill) -> dict:
    cache, out = tmp_path / "cache", tmp_path / "out"
    process = workspace.start(cache, PIN, SM, out, dest, pause_at=kill if isinstance(kill, str) else None)
    if isinstance(kill, str):
        wait_for_pause(process, kill)
    else:
        time.sleep(kill)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)

    tagged = tag_digest(workspace.registry, dest, reference["tag"])
    state = tag_state(workspace.registry.host, dest, reference["tag"])  # skopeo copies a tagged image whole
    if isinstance(kill, str):  # every phase comes before the manifest PUT
        assert process.returncode == -signal.SIGKILL
        assert tagged is None and state == "absent"
        assert not out.exists()
    else:  # a random moment: no tag, or one naming the complete image; the same for the layout
        assert tagged in (None, reference["manifest_digest"])
        assert not out.exists() or layout_digest(out) == reference["manifest_digest"]
    if cache.exists():
        check_cache(cache, allow_leftovers=True)
    leftovers = sorted(p.relative_to(cache).parts[0] for p in cache.rglob(".tmp-*")) if cache.exists() else []

    again = finish(workspace.start(cache, PIN, SM, out, dest))
    assert again["manifest_digest"] == reference["manifest_digest"]
    assert layout_digest(out) == reference["manifest_digest"]
    assert tag_digest(workspace.registry, dest, reference["tag"]) == reference["manifest_digest"]
    assert tag_state(workspace.registry.host, dest, reference["tag"]) == "complete"
    check_cache(cache)  # verified entries only, and the killed build's temporary ones are gone
    again["leftovers_after_kill"] = leftovers
    return again


@pytest.mark.parametrize("phase", ["pull", "patch", "bake", "push"])  # (the rest: test_killed_builds.py)
def test_killed_at_each_phase_then_rerun(reference, tmp_path, phase, base_layout):
    workspace, first = reference
    dest = f"test/crash-{phase}"
    again = _killed_then_rerun(workspace, first, tmp_path, dest, phase)
    sizes = base_layout.layer_sizes
    # what the kill left, and the re-run removed: the half-extracted tree / the bake work dir
    expected_leftover = {"pull": "sources", "patch": None, "bake": "build", "push": "build"}[phase]
    if expected_leftover:
        assert expected_leftover in again["leftovers_after_kill"], again["leftovers_after_kill"]
    if phase == "pull":  # the top (app) layer was verified and cached: only what is below is fetched
        assert sizes["vllm"] <= again["bytes_pulled"] <= first["bytes_pulled"] - sizes["app"]
    elif phase in ("patch", "bake"):  # the source tree was complete: its layers are not fetched again
        assert again["bytes_pulled"] <= first["bytes_pulled"] - sizes["vllm"] - sizes["app"]
    else:  # push: the layout was staged, so every base blob was cached; nothing is downloaded,
        assert again["bytes_pulled"] == 0
        assert again["blobs_uploaded"] == 0  # and every blob reached the registry: none is uploaded


def test_killed_at_random_moments_then_rerun(reference, tmp_path):
    workspace, first = reference
    rng = random.Random(20260101)
    total = first["timings"]["total"]
    for i, delay in enumerate(sorted(rng.uniform(0.2, total + 1.0) for _ in range(3))):
        _killed_then_rerun(workspace, first, tmp_path / f"kill-{i}", f"test/crash-random-{i}", delay)


def test_staging_left_by_a_killed_build_is_removed_by_the_next(reference, tmp_path):
    """Killed at ``push``: the OCI layout is staged beside ``out`` (``.out.kiln-<pid>.<start>-…``), never
    committed. The next build writing there removes it (its process is gone) and commits its own."""
    workspace, first = reference
    cache, out = tmp_path / "cache", tmp_path / "out"
    process = workspace.start(cache, PIN, SM, out, "test/crash-staging", pause_at="push")
    wait_for_pause(process, "push")
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    [stage] = [p for p in tmp_path.iterdir() if p.name.startswith(f".out.kiln-{process.pid}.")]
    assert (stage / "index.json").is_file() and not out.exists()
    again = finish(workspace.start(cache, PIN, SM, out, "test/crash-staging"))
    assert again["manifest_digest"] == first["manifest_digest"]
    assert layout_digest(out) == first["manifest_digest"]
    assert [p.name for p in tmp_path.iterdir() if ".kiln-" in p.name] == []
