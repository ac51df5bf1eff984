"""A full disk at each stage of a real build: one line naming the path, exit 2, nothing half-written.

The cache (``KILN_CACHE_DIR``) -- or, separately, the ``--oci`` output -- lies on a 64 MiB tmpfs
mounted by the test (root only; skipped with the reason where mounting is refused), filled by a
filler file so that a chosen stage meets the full disk:

- the pull: the filler leaves less than the first layer (the blob cache's copy fills), or every
  blob and half the extracted source tree (measured on a reference build of the same image);
- later stages: the build is held at a pause point (``KILN_TEST_PAUSE_AT``), the disk filled to
  the last byte, and the build let go (``KILN_TEST_RESUME``): ``patching`` -> the selection's
  cache record, ``patch`` -> kiln's layer in the work directory, ``bake`` -> the image's config
  and attestation blobs there, ``kernels`` (``e2e-kill``, a Triton kernel worker compiling beside
  the patching) -> whichever of the two writes first;
- the ``--oci`` layout on the tmpfs, with one page or half the layout free.

kiln promises (issue 39, item 4): exit 2, exactly one ``error:`` line saying "no space left on
device writing PATH" with PATH on the full filesystem (and the bytes needed where they are
known), no ``Traceback``, no output directory, no ``.tmp-*`` entry in the cache, no stage beside
the output. (The Triton kernel cache itself is compiled under ``/tmp/kiln-triton`` and the work
directory; the toolchain wheel kept for ``--cache-to`` is the one other local write: both meet
the central handler in ``kiln.commands.main``, not driven here.)
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.image.test_killed_builds import KillWorkspace
from tests.support.build_processes import Workspace, finish, wait_for_pause

pytestmark = [pytest.mark.registry, pytest.mark.reliability]

PIN, SM = "v0.20.1", 120
PAGE = 4096


def _pages(path: Path) -> int:
    """Bytes ``path``'s files take on a tmpfs (whole pages)."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()]
    return sum(-(-p.stat().st_size // PAGE) * PAGE for p in files)


@pytest.fixture
def tmpfs(tmp_path):
    """A fresh 64 MiB tmpfs; ``fill(left)`` writes a filler leaving ``left`` bytes free."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        def fill(left: int) -> None:
            stat = os.statvfs(mount)
            filler = stat.f_bavail * stat.f_frsize - max(left, 0)
            with open(mount / "filler", "wb") as handle:
                handle.truncate(0)
                while filler > 0:
                    chunk = min(filler, 1 << 20)
                    handle.write(b"\0" * chunk)
                    filler -= chunk
            stat = os.statvfs(mount)
            assert abs(stat.f_bavail * stat.f_frsize - left) <= PAGE

        yield mount, fill
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, registry_plain) -> tuple[Workspace, dict]:
    """The workspace, and the bytes a clean build writes: per cache directory, and its layout."""
    root = tmp_path_factory.mktemp("nospace")
    workspace = Workspace.create(root / "ws", registry_plain)
    finish(workspace.start(root / "cache", PIN, SM, root / "out", "test/nospace-reference"))
    sizes = {p.name: _pages(p) for p in (root / "cache").iterdir()}
    sizes["layout"] = _pages(root / "out")
    return workspace, sizes


def _build(workspace: Workspace, cache: Path, out: Path) -> subprocess.CompletedProcess:
    process = workspace.start(cache, PIN, SM, out, f"test/nospace-{uuid.uuid4().hex[:8]}")
    stdout, stderr = process.communicate(timeout=600)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _assert_one_line(done: subprocess.CompletedProcess, under: Path) -> str:
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    [line] = errors
    assert "no space left on device writing " in line, line
    assert f"writing {under}" in line, line
    return line


def _cache_budget(sizes: dict, stage: str) -> int:
    return {
        "pull": PAGE * 64,  # not even the first (top) layer: the blob cache's copy fills
        "tree": sizes["blobs"] + sizes["sources"] // 2,  # every blob, half the extracted source tree
    }[stage]


@pytest.mark.parametrize(("stage", "named"), [("pull", "blobs/sha256/"), ("tree", "sources/.tmp-image-")],
                         ids=["pull", "tree"])
def test_a_full_cache_disk_is_one_line_naming_the_path(reference, tmpfs, tmp_path, stage, named):
    workspace, sizes = reference
    mount, fill = tmpfs
    cache, out = mount / "cache", tmp_path / "out"
    fill(_cache_budget(sizes, stage))
    done = _build(workspace, cache, out)
    line = _assert_one_line(done, mount)
    assert f"writing {cache}/{named}" in line and " bytes needed" in line, line
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if ".kiln-" in p.name] == []
    assert [str(p.relative_to(cache)) for p in cache.rglob(".tmp-*")] == []


@pytest.mark.parametrize("left", ["none", "half"])
def test_a_full_output_disk_is_one_line_naming_the_path(reference, tmpfs, tmp_path, left):
    workspace, sizes = reference
    mount, fill = tmpfs
    cache, out = tmp_path / "cache", mount / "out"
    fill(PAGE if left == "none" else sizes["layout"] // 2)
    done = _build(workspace, cache, out)
    line = _assert_one_line(done, mount)
    assert line.startswith(f"error: --oci {out}: no space left on device writing {out} (") and " bytes needed" in line, line
    assert not out.exists()
    assert [p.name for p in mount.iterdir() if p.name != "filler"] == []
    assert [str(p.relative_to(cache)) for p in cache.rglob(".tmp-*")] == []


# (pause point, the image, what the next write is): held there, the disk filled, then let go
FILLED_AT = [
    ("patching", "e2e-p65", "selections/"),  # the patched selection's cache record
    ("patch", "e2e-p65", "build/.tmp-"),  # kiln's layer, in the work directory
    ("bake", "e2e-p65", "build/.tmp-"),  # the config and attestation blobs, before the layout
    ("kernels", "e2e-kill", ""),  # a kernel worker compiling beside the patching: whichever writes first
]


@pytest.mark.parametrize(("point", "image", "named"), FILLED_AT, ids=[p for p, _, _ in FILLED_AT])
def test_a_cache_disk_filled_at_a_stage_is_one_line_naming_the_path(reference, registry_plain, tmpfs, tmp_path,
                                                                     monkeypatch, point, image, named):
    workspace, _ = reference
    mount, fill = tmpfs
    cache, out, resume = mount / "cache", tmp_path / "out", tmp_path / "resume"
    monkeypatch.setenv("KILN_TEST_RESUME", str(resume))
    dest = f"test/nospace-{point}"
    if image == "e2e-kill":
        process = KillWorkspace.create(tmp_path / "kill-ws", registry_plain).start(cache, out, dest, pause_at=point)
    else:
        process = workspace.start(cache, PIN, SM, out, dest, pause_at=point)
    try:
        wait_for_pause(process, point)
        fill(0)
        resume.touch()
        stdout, stderr = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    line = _assert_one_line(done, mount)
    assert f"writing {cache}/{named}" in line, line
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if ".kiln-" in p.name] == []
    assert [str(p.relative_to(cache)) for p in cache.rglob(".tmp-*")] == []
