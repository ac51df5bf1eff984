"""vLLM's x86_64 and aarch64 wheels carry the same source, and verdicts are computed once for both.

Both pins' real wheels come from PyPI through ``WheelSource`` (``platform`` picks the wheel,
each checked against the index's sha256 and cached under ``sources/sha256-<digest>``). Seen:
0.20.1 (``vllm-0.20.1-1-cp38-abi3-manylinux_2_35_{x86_64,aarch64}.whl``) 1,723 ``.py`` files and
0.33.0 (``manylinux_2_28``) 3,231, every one byte-identical between the two platforms; the files
kiln patches (those present on each release) among them.
"""

from __future__ import annotations

import shutil

import pytest
from packaging.version import Version

from kiln.patch.memo import patched_selection
from kiln.patch.outcome import BuildTarget, Verdict
from kiln.patch.platforms import differing_files, patched_files, platform_verdicts
from kiln.report import Recorder
from kiln.source.tree import SourceTree
from kiln.source.wheel import WheelSource

# releases' wheels from PyPI on a machine whose kiln cache lacks them (tests/conftest.py keeps this true)
pytestmark = pytest.mark.network

PINS = ("0.20.1", "0.33.0")
PLATFORMS = ("linux/amd64", "linux/arm64")


def _trees(version: str) -> dict[str, SourceTree]:
    return {platform: WheelSource(version, platform=platform).fetch() for platform in PLATFORMS}


def _py(tree: SourceTree) -> set[str]:
    return {p.relative_to(tree.package).as_posix() for p in tree.package.rglob("*.py")}


@pytest.mark.parametrize("version", PINS)
def test_the_files_kiln_patches_are_identical_in_the_x86_64_and_aarch64_wheels(catalogue, version):
    trees = _trees(version)
    amd64, arm64 = trees.values()
    assert "x86_64.whl" in amd64.origin and "aarch64.whl" in arm64.origin, (amd64.origin, arm64.origin)
    assert amd64.identity != arm64.identity  # two wheels were read, each by its own sha256
    files = patched_files(catalogue)
    present = [rel for rel in files if amd64.exists(rel) or arm64.exists(rel)]
    assert len(present) >= 20 and all(amd64.exists(rel) == arm64.exists(rel) for rel in present)
    assert differing_files(trees, files) == []
    # and the whole package: the same files, the same bytes
    assert _py(amd64) == _py(arm64)
    assert differing_files(trees, sorted(_py(amd64))) == []


def _selection_verdicts(catalogue, version: str, calls: list):
    target = BuildTarget(Version(version), 90, "turboquant_k8v4", ("Qwen3_5ForConditionalGeneration",))

    def compute(tree: SourceTree) -> dict:
        calls.append(tree.identity)
        return patched_selection(catalogue, tree, target, ["P65", "PN33"], None, jobs=1).outcomes
    return compute


def test_identical_sources_get_their_verdicts_computed_once(catalogue):
    calls: list = []
    reporter = Recorder()
    trees = _trees("0.33.0")
    result = platform_verdicts(trees, patched_files(catalogue), _selection_verdicts(catalogue, "0.33.0", calls),
                               reporter)
    assert result.shared and calls == [trees["linux/amd64"].identity] and reporter.warnings == []
    assert result.by_platform == {} and result.of("linux/arm64") is result.outcomes
    assert result.outcomes["P65"].verdict is Verdict.APPLIES


def test_a_patched_file_that_differs_gets_verdicts_per_platform_and_one_warning(catalogue, tmp_path):
    """The aarch64 tree with P65's target edited (its anchor gone): verdicts per platform, both
    kept, one warning line naming the platforms and the file."""
    trees = _trees("0.33.0")
    arm64 = trees["linux/arm64"]
    copy = tmp_path / "arm64"
    shutil.copytree(arm64.root, copy)
    [rel] = catalogue.get("P65").targets
    (copy / "vllm" / rel).write_text("# an aarch64 build of its own\n")
    trees["linux/arm64"] = SourceTree(copy, arm64.vllm_version, "edited-arm64", "the aarch64 wheel, P65's file edited")
    calls: list = []
    reporter = Recorder()
    result = platform_verdicts(trees, patched_files(catalogue), _selection_verdicts(catalogue, "0.33.0", calls),
                               reporter)
    assert not result.shared and result.differing == (rel,)
    assert calls == [trees["linux/amd64"].identity, "edited-arm64"]
    assert set(result.by_platform) == set(PLATFORMS)
    assert result.of("linux/amd64")["P65"].verdict is Verdict.APPLIES
    assert result.of("linux/arm64")["P65"].verdict is not Verdict.APPLIES
    assert len(reporter.warnings) == 1 and "\n" not in reporter.warnings[0]
    assert "linux/amd64, linux/arm64" in reporter.warnings[0] and rel in reporter.warnings[0]
