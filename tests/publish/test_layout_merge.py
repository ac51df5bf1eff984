"""``build --oci DIR`` adds to a shared OCI layout: nothing already in it is lost.

Layouts are read back with skopeo (never kiln's own layout code): every named image must be
copyable out of the layout whole, so an entry whose blobs went missing fails the check too.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support import TEST_IMAGES
from tests.support.faultproxy import Fault, FaultProxy
from tests.support.registry import VLLM_VERSION
from tests.support.reliability_checks import (
    assert_one_line_error,
    copy_out,
    layout_refs,
    run_build,
    run_cli,
)

pytestmark = [pytest.mark.registry, pytest.mark.reliability]

def skopeo_into(layout: Path, source: str, ref: str) -> None:
    subprocess.run(["skopeo", "copy", "--quiet", source, f"oci:{layout}:{ref}"], check=True, capture_output=True)


def _pins(root: Path, registry) -> Path:
    path = root / "pins.toml"
    digest = registry.digest_of(f"vllm/vllm-openai:v{VLLM_VERSION}")
    path.write_text('[pins."v0.20.1"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:v0.20.1"\n'
                    f'vllm = "{VLLM_VERSION}"\ncuda = "cu130"\ndigest = "{digest}"\n')
    return path


def build(root: Path, registry, sm: int, *extra: str, mirror: str | None = None, in_process: bool = False):
    """A build in a process of its own, or in this one for a test that replaces a function of kiln's."""
    return (run_cli if in_process else run_build)(["--pins", str(_pins(root, registry)), "--images", str(TEST_IMAGES), "build", "--image", "e2e-p65",
                    "--pin", "v0.20.1", "--sm", str(sm), "--mirror", mirror or registry.mirror, "--json", *extra])


def tag(sm: int) -> str:
    return f"cu130-sm{sm}-v{VLLM_VERSION}"


@pytest.fixture
def shared_layout(tmp_path, base_layout) -> tuple[Path, dict[str, str]]:
    """An OCI layout holding two images that are not kiln's, copied in with skopeo."""
    layout = tmp_path / "images"
    skopeo_into(layout, base_layout.oci("novllm"), "keepme")
    skopeo_into(layout, base_layout.oci("arm64"), "other-tag")
    refs = layout_refs(layout)
    assert set(refs) == {"keepme", "other-tag"}
    return layout, refs


def test_build_into_an_existing_layout_keeps_its_images(tmp_path, registry_plain, shared_layout):
    layout, before = shared_layout
    result = build(tmp_path, registry_plain, 120, "--oci", str(layout)).result
    refs = layout_refs(layout)
    assert set(refs) == {"keepme", "other-tag", tag(120)}
    for ref, digest in before.items():  # the images already there: same digests, still whole
        assert refs[ref] == digest
        assert copy_out(layout, ref, tmp_path) == digest
    assert copy_out(layout, tag(120), tmp_path) == result["manifest_digest"]


def test_builds_for_two_sms_into_one_layout_keep_both(tmp_path, registry_plain):
    layout = tmp_path / "matrix"
    first = build(tmp_path, registry_plain, 86, "--oci", str(layout)).result
    second = build(tmp_path, registry_plain, 120, "--oci", str(layout)).result
    assert first["manifest_digest"] != second["manifest_digest"]
    assert layout_refs(layout) == {tag(86): first["manifest_digest"], tag(120): second["manifest_digest"]}
    assert copy_out(layout, tag(86), tmp_path) == first["manifest_digest"]
    assert copy_out(layout, tag(120), tmp_path) == second["manifest_digest"]
    # building the same SM again replaces only its own entry (same digest: a reproducible build)
    again = build(tmp_path, registry_plain, 86, "--oci", str(layout)).result
    assert layout_refs(layout) == {tag(86): again["manifest_digest"], tag(120): second["manifest_digest"]}
    assert again["manifest_digest"] == first["manifest_digest"]


def _artifacts(layout: Path) -> list[dict]:
    return [m for m in json.loads((layout / "index.json").read_text())["manifests"] if "artifactType" in m]


def test_replacing_a_tag_removes_the_replaced_images_referrers(tmp_path, registry_plain, monkeypatch):
    """Two real builds of one tag into one layout, the second as by another kiln commit (its
    revision label differs, so its digest does): the first image's SBOM and provenance leave
    index.json with it, said in one warning; the layout lists only artifacts of images it lists."""
    import kiln.image.prepare

    layout = tmp_path / "replaced"
    first = build(tmp_path, registry_plain, 120, "--oci", str(layout), in_process=True).result
    assert {m["annotations"]["io.kiln.subject"] for m in _artifacts(layout)} == {first["manifest_digest"]}
    monkeypatch.setattr(kiln.image.prepare, "kiln_revision", lambda: ("0" * 40, False))
    run = build(tmp_path, registry_plain, 120, "--oci", str(layout), in_process=True)
    assert run.code == 0, run.err
    second = run.result["manifest_digest"]
    assert second != first["manifest_digest"]
    assert layout_refs(layout) == {tag(120): second}
    artifacts = _artifacts(layout)
    assert len(artifacts) == 2 and {m["annotations"]["io.kiln.subject"] for m in artifacts} == {second}
    for entry in artifacts:  # each artifact's own subject is the listed image
        body = json.loads((layout / "blobs/sha256" / entry["digest"].split(":")[1]).read_bytes())
        assert body["subject"]["digest"] == second
    [warning] = [w for w in run.result["warnings"] if "replaced" in w]
    assert (f"{tag(120)} replaced {first['manifest_digest']} with {second}; removed its 2 referrer(s) "
            "from index.json") in warning and "\n" not in warning
    assert copy_out(layout, tag(120), tmp_path) == second
    # a third, whose push fails after the layout was merged: the rollback puts the second's
    # entry and its referrers back, index.json as it was
    index_before = json.loads((layout / "index.json").read_bytes())
    monkeypatch.setattr(kiln.image.prepare, "kiln_revision", lambda: ("1" * 40, False))
    proxy = FaultProxy(registry_plain.host)
    try:
        proxy.add(Fault("PUT", r"/manifests/", "status", status=503, times=None))
        failed = build(tmp_path, registry_plain, 120, "--oci", str(layout), "--push",
                       "--repository", f"{proxy.host}/test/layout-replaced", "--insecure-registry", proxy.host,
                       mirror=proxy.mirror, in_process=True)
    finally:
        proxy.stop()
    assert_one_line_error(failed, "HTTP 503")
    assert sorted(json.loads((layout / "index.json").read_bytes())["manifests"], key=json.dumps) == \
        sorted(index_before["manifests"], key=json.dumps)
    assert copy_out(layout, tag(120), tmp_path) == second


def test_failed_push_leaves_a_shared_layout_as_it_was(tmp_path, registry_plain, shared_layout):
    """The layout is committed before the manifest PUT; when the PUT fails it is rolled back:
    the index is byte-identical to before, every image in it is still whole."""
    layout, before = shared_layout
    index_before = (layout / "index.json").read_bytes()
    proxy = FaultProxy(registry_plain.host)
    try:
        proxy.add(Fault("PUT", r"/manifests/", "status", status=503, times=None))
        run = build(tmp_path, registry_plain, 120, "--oci", str(layout), "--push",
                    "--repository", f"{proxy.host}/test/layout-rollback", "--insecure-registry", proxy.host,
                    mirror=proxy.mirror)
    finally:
        proxy.stop()
    assert_one_line_error(run, "HTTP 503")
    assert json.loads((layout / "index.json").read_bytes()) == json.loads(index_before)
    for ref, digest in before.items():
        assert copy_out(layout, ref, tmp_path) == digest
    assert [p.name for p in tmp_path.iterdir() if ".kiln-" in p.name] == []


def test_a_directory_that_is_not_a_layout_is_refused_before_any_work(tmp_path, registry_plain):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "todo.txt").write_text("mine\n")
    proxy = FaultProxy(registry_plain.host)
    try:
        run = build(tmp_path, registry_plain, 120, "--oci", str(out), mirror=proxy.mirror)
        assert proxy.requests() == []  # refused before the first request
    finally:
        proxy.stop()
    assert_one_line_error(run, f"--oci {out}", "neither empty nor an OCI layout")
    assert sorted(p.name for p in out.iterdir()) == ["todo.txt"]


class _Blobs:
    def __init__(self, root: Path):
        self.root = root

    def path(self, descriptor) -> Path:
        return self.root / descriptor.digest.split(":")[1]


class _FakeImage:
    """What ``LayoutPublisher.stage`` reads of a built image: one config blob and a manifest."""

    attestations: list = []  # none here: tests/attest/ covers the artifacts a layout gets

    def __init__(self, root: Path, name: str):
        from kiln.oci.manifest import Descriptor, Manifest
        from kiln.oci.mediatypes import OCI_CONFIG, OCI_MANIFEST

        root.mkdir(parents=True, exist_ok=True)
        config = json.dumps({"kiln-test": name}).encode()
        digest = "sha256:" + __import__("hashlib").sha256(config).hexdigest()
        (root / digest.split(":")[1]).write_bytes(config)
        descriptor = Descriptor(OCI_CONFIG, digest, len(config))
        data = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": descriptor.to_json(),
                           "layers": []}).encode()
        self.manifest = Manifest(data, OCI_MANIFEST, "sha256:" + __import__("hashlib").sha256(data).hexdigest())
        self.model = type("Model", (), {"blobs": lambda _self: [descriptor]})()
        self.blobs = _Blobs(root)


def test_rolling_back_a_new_layout_keeps_what_another_build_added_since(tmp_path):
    """Build A creates the layout, build B merges into it, then A's push fails: A's rollback
    removes A's entry only; B's image stays. Alone, A's rollback removes the layout it created."""
    from kiln.publish.layout import LayoutPublisher

    dest = tmp_path / "out"
    a, b = _FakeImage(tmp_path / "a", "a"), _FakeImage(tmp_path / "b", "b")
    stage_a = LayoutPublisher(dest, "tag-a").stage(a)
    stage_b = LayoutPublisher(dest, "tag-b").stage(b)
    stage_a.commit()
    stage_b.commit()
    stage_b.finish()
    assert layout_refs(dest) == {"tag-a": a.manifest.digest, "tag-b": b.manifest.digest}
    stage_a.rollback()
    assert layout_refs(dest) == {"tag-b": b.manifest.digest}
    assert (dest / "blobs/sha256" / b.manifest.digest.split(":")[1]).read_bytes() == b.manifest.data

    alone = tmp_path / "alone"
    stage = LayoutPublisher(alone, "tag-a").stage(a)
    stage.commit()
    assert layout_refs(alone) == {"tag-a": a.manifest.digest}
    stage.rollback()
    assert not alone.exists()


def test_dead_stages_beside_an_output_are_removed_live_ones_kept(tmp_path):
    """``check_output_path`` (run before any work) removes the stages of processes that are gone;
    a stage of a running process, and names that only look alike, stay."""
    import os
    import subprocess
    import sys

    from kiln.publish import check_output_path

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead_dir = tmp_path / f".oci.kiln-{gone.pid}-a1b2"
        (dead_dir / "blobs").mkdir(parents=True)
        dead_file = tmp_path / f".image.tar.kiln-{gone.pid}-c3d4"
        dead_file.write_bytes(b"half an archive")
        live = tmp_path / f".oci.kiln-{alive.pid}-e5f6"
        live.mkdir()
        lookalike = tmp_path / ".oci.kiln-notapid"
        lookalike.mkdir()
        assert check_output_path(tmp_path / "oci", "--oci", directory=True) == (tmp_path / "oci").resolve()
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, lookalike.name])
    finally:
        alive.kill()
        alive.wait()
    assert os.path.isdir(live)


def test_a_layout_broken_after_the_check_is_refused_at_commit_not_a_traceback(tmp_path):
    """Checked again under the lock at commit: a ``blobs`` turned into a file since the check
    (another writer) is one line naming it, not NotADirectoryError; the index stays as it was."""
    from kiln.errors import KilnError
    from kiln.publish.layout import LayoutPublisher

    dest = tmp_path / "out"
    first = LayoutPublisher(dest, "tag-a").stage(_FakeImage(tmp_path / "a", "a"))
    first.commit()
    first.finish()
    index = (dest / "index.json").read_bytes()
    second = LayoutPublisher(dest, "tag-b").stage(_FakeImage(tmp_path / "b", "b"))
    import shutil

    shutil.rmtree(dest / "blobs")
    (dest / "blobs").write_text("a file now\n")
    with pytest.raises(KilnError, match=r"--oci .*/out: blobs is not a directory"):
        second.commit()
    second.discard()
    assert (dest / "index.json").read_bytes() == index


def test_a_held_layout_lock_does_not_keep_a_build_past_its_deadline(tmp_path, registry_plain):
    """Another build that hangs while holding the layout's lock (here: this test holds it) used to
    keep this one waiting forever, whatever ``--deadline`` said; now the wait ends at the
    deadline with one line naming the lock, and the layout is not written."""
    import fcntl
    import math
    import os
    import threading
    import time

    cold_start = time.monotonic()
    assert build(tmp_path, registry_plain, 120, "--oci", str(tmp_path / "warm")).code == 0  # fills the cache
    cold = time.monotonic() - cold_start
    deadline = math.ceil(1.5 * cold + 5)  # the build below is warm: well under two thirds of it
    shared = tmp_path / "shared"
    shared.mkdir()
    holder = os.open(shared, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    runs = []
    worker = threading.Thread(target=lambda: runs.append(
        build(tmp_path, registry_plain, 120, "--oci", str(shared / "images"), "--deadline", f"{deadline}s")))
    started = time.monotonic()
    worker.start()
    worker.join(timeout=deadline + 60)
    waited = time.monotonic() - started
    os.close(holder)  # releases the lock: a build still waiting for it goes on
    worker.join()
    assert waited < deadline + 60, "the build waited for the layout's lock past its deadline"
    assert_one_line_error(runs[0], f"--oci: waiting for the lock on {shared}", f"deadline of {deadline} s")
    assert not (shared / "images").exists()
    assert [p.name for p in shared.iterdir()] == []


def test_nothing_is_committed_once_the_deadline_has_passed(tmp_path):
    """Every output staged, then the deadline checked before the first commit: past it, the
    stages are discarded, the destination untouched (it used to be committed whatever the time)."""
    from kiln.oci.limits import Budget, LimitExceeded, Limits
    from kiln.publish import publish
    from kiln.publish.layout import LayoutPublisher

    dest = tmp_path / "out"
    spent = Budget(Limits(deadline=0.0))
    with pytest.raises(LimitExceeded, match="publish .*: the build ran past its deadline of 0 s"):
        publish(_FakeImage(tmp_path / "a", "a"), [LayoutPublisher(dest, "tag-a")], spent)
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir() if ".kiln-" in p.name] == []
