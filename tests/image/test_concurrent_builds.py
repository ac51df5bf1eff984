"""Two ``build.py build`` processes sharing one cache directory at the same time.

Both must succeed, give exactly what a build alone in a fresh cache gives (manifest digest,
extracted source trees), and leave the shared cache consistent: every blob and manifest hashes
to its name, every source record points at a complete tree, no temporary entry is left over.
"""

from __future__ import annotations

import pytest

from tests.support.build_processes import (
    Workspace,
    check_cache,
    finish,
    layout_digest,
    source_trees,
    tag_digest,
)
from tests.support.reliability_checks import copy_out, layout_refs

pytestmark = [pytest.mark.registry, pytest.mark.reliability]


@pytest.fixture
def workspace(tmp_path, registry_plain) -> Workspace:
    return Workspace.create(tmp_path / "ws", registry_plain)


def _together(workspace: Workspace, cache, jobs: list[tuple[str, int, str, str]], tmp_path) -> list[dict]:
    """Start every job before waiting on any (both cold: they pull, extract and push at once);
    return their JSON summaries in order."""
    processes = [workspace.start(cache, pin, sm, tmp_path / out, dest) for pin, sm, out, dest in jobs]
    return [finish(p) for p in processes]


@pytest.mark.parametrize("jobs", [
    pytest.param([("v0.20.1", 120, "a", "test/conc-same"), ("v0.20.1", 120, "b", "test/conc-same")], id="same-pin-same-sm"),
    pytest.param([("v0.20.1", 86, "a", "test/conc-mixed-a"), ("ovl", 120, "b", "test/conc-mixed-b")], id="different-pins-and-sms"),
])
def test_two_builds_share_one_cache(workspace, tmp_path, registry_plain, jobs):
    # what each build gives alone, each in a fresh cache
    alone = []
    for i, (pin, sm, _, dest) in enumerate(jobs):
        cache = tmp_path / f"alone-{i}"
        result = workspace.run(cache, pin, sm, tmp_path / f"alone-out-{i}", dest + "-alone")
        alone.append((result, source_trees(cache)))

    shared = tmp_path / "shared-cache"
    together = _together(workspace, shared, jobs, tmp_path)

    for (pin, sm, out, dest), result, (reference, trees) in zip(jobs, together, alone, strict=True):
        assert result["manifest_digest"] == reference["manifest_digest"], (pin, sm)
        assert layout_digest(tmp_path / out) == reference["manifest_digest"]
        assert tag_digest(registry_plain, dest, result["tag"]) == reference["manifest_digest"]
        shared_trees = source_trees(shared)
        for name, files in trees.items():  # the shared cache holds the same trees, byte for byte
            assert shared_trees[name] == files, name
    check_cache(shared)
    assert len(source_trees(shared)) == len({j[0] for j in jobs})  # one tree per base, never two


def test_two_builds_writing_one_oci_layout_both_land(workspace, tmp_path, registry_plain):
    """sm86 and sm120 started together, both with ``--oci`` on the same directory (a CI matrix
    writing one layout): the layout ends with both images, each whole (skopeo copies it)."""
    out = tmp_path / "matrix"
    jobs = [("v0.20.1", 86, "matrix", "test/conc-layout"), ("v0.20.1", 120, "matrix", "test/conc-layout")]
    together = _together(workspace, tmp_path / "cache", jobs, tmp_path)
    assert layout_refs(out) == {result["tag"]: result["manifest_digest"] for result in together}
    assert len(together) == 2 and together[0]["tag"] != together[1]["tag"]
    for result in together:
        assert copy_out(out, result["tag"], tmp_path) == result["manifest_digest"]
    assert [p.name for p in tmp_path.iterdir() if ".kiln-" in p.name] == []  # no staging left beside it
