"""``--oci DIR`` naming an existing layout: the layout is checked as a reader (skopeo, crane)
would need it before any work, and refused naming the file and the field; nothing in it changes.

It used to be accepted as it was: an index entry with ``"digest": 5`` or an index of
``schemaVersion: 3`` was written into, and a ``blobs`` that is a file failed with
NotADirectoryError at commit, after the pull, the patching and the bake.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.refusals import assert_refused, build, snapshot

pytestmark = [pytest.mark.reliability, pytest.mark.isolated]

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
ENTRY = {"mediaType": MANIFEST, "digest": "sha256:" + "cd" * 32, "size": 3,
         "annotations": {"org.opencontainers.image.ref.name": "keepme"}}


def _layout(root: Path, index: dict | str | None = None, marker: str = '{"imageLayoutVersion": "1.0.0"}') -> Path:
    root.mkdir()
    (root / "oci-layout").write_text(marker)
    text = index if isinstance(index, str) else json.dumps(index or {"schemaVersion": 2, "manifests": [ENTRY]})
    (root / "index.json").write_text(text)
    (root / "blobs" / "sha256").mkdir(parents=True)
    return root


def _index(**changes) -> dict:
    return {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [ENTRY],
            **changes}


def _entry(**changes) -> dict:
    entry = {**ENTRY, **changes}
    return {k: v for k, v in entry.items() if v is not None}


CASES = {
    "digest is a number": (_index(manifests=[_entry(digest=5)]), "index.json: manifests[0].digest is 5, not a digest"),
    "digest without algorithm": (_index(manifests=[_entry(digest="cd" * 32)]), "manifests[0].digest is 'cdcd"),
    "digest too short": (_index(manifests=[ENTRY, _entry(digest="sha256:abc")]),
                         "manifests[1].digest 'sha256:abc': not a sha256 or sha512 digest"),
    "size a string": (_index(manifests=[_entry(size="3")]), "manifests[0].size is '3', not a byte count"),
    "size a boolean": (_index(manifests=[_entry(size=True)]), "manifests[0].size is True"),
    "mediaType missing": (_index(manifests=[_entry(mediaType=None)]), "manifests[0].mediaType is None"),
    "annotation not a string": (_index(manifests=[_entry(annotations={"a": 1})]), "manifests[0].annotations is"),
    "entry not an object": (_index(manifests=["sha256:" + "cd" * 32]), "manifests[0] is 'sha256:cdcd"),
    "schemaVersion 3": (_index(schemaVersion=3), "index.json: schemaVersion is 3; an OCI image index has schemaVersion 2"),
    "schemaVersion missing": ({"manifests": [ENTRY]}, "index.json: schemaVersion is None"),
    "manifests not a list": (_index(manifests={"a": ENTRY}), "index.json: manifests is {'a'"),
    "index of a Docker list": (_index(mediaType="application/vnd.docker.distribution.manifest.list.v2+json"),
                               "index.json: mediaType is 'application/vnd.docker.distribution.manifest.list.v2+json'"),
    "index not JSON": ("{", "index.json: not a readable OCI index"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_malformed_layout_index_is_refused_before_any_work(workspace, hub, tmp_path, case):
    index, expected = CASES[case]
    layout = _layout(workspace / "images", index)
    before = snapshot(tmp_path)
    run = build(workspace, hub, "--oci", str(layout))
    line = assert_refused(run, hub, tmp_path, before, f"--oci {layout}: ", expected)
    assert "Traceback" not in run.err and len(line) < 300


@pytest.mark.parametrize("what, expected", [
    ("blobs", "blobs is not a directory"), ("blobs/sha256", "blobs/sha256 is not a directory"),
    ("layout version", "oci-layout: imageLayoutVersion is '2.0.0'"), ("marker not JSON", "oci-layout: not readable JSON"),
])
def test_a_layout_kiln_cannot_add_to_is_refused_before_any_work(workspace, hub, tmp_path, what, expected):
    layout = _layout(workspace / "images", marker='{"imageLayoutVersion": "2.0.0"}' if what == "layout version"
                     else "1.0.0" if what == "marker not JSON" else '{"imageLayoutVersion": "1.0.0"}')
    if what.startswith("blobs"):
        (layout / "blobs" / "sha256").rmdir()
        if what == "blobs":
            (layout / "blobs").rmdir()
        (layout / what).write_text("not a directory\n")
    before = snapshot(tmp_path)
    run = build(workspace, hub, "--oci", str(layout))
    assert_refused(run, hub, tmp_path, before, f"--oci {layout}: {expected}")


def test_a_well_formed_layout_passes_the_check(tmp_path):
    """The check accepts what skopeo writes (and a sha512 entry): it refuses only what is wrong."""
    from kiln.publish.layout import check_layout

    entries = [ENTRY, _entry(digest="sha512:" + "ef" * 64, annotations=None)]
    check_layout(_layout(tmp_path / "images", _index(manifests=entries)))
    check_layout(_layout(tmp_path / "bare", {"schemaVersion": 2, "manifests": []}))
