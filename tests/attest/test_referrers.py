"""The referrers index kiln merges into, and the reproducible time attestations record."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from kiln.attest.referrers import (
    EMPTY_MEDIA_TYPE,
    artifact,
    index_entries,
    merged_index,
    referrers_tag,
)
from kiln.attest.sbom import build_time
from kiln.errors import KilnError
from kiln.oci.digest import sha256_digest
from kiln.oci.manifest import Manifest
from kiln.oci.mediatypes import OCI_INDEX, OCI_MANIFEST

SUBJECT = Manifest(b'{"schemaVersion":2}', OCI_MANIFEST, sha256_digest(b'{"schemaVersion":2}'))


def test_artifact_is_an_oci_1_1_manifest_about_its_subject():
    made = artifact("application/vnd.cyclonedx+json", b'{"bomFormat":"CycloneDX"}', SUBJECT, {"a": "b"})
    body = made.manifest.json
    assert body["artifactType"] == "application/vnd.cyclonedx+json"
    assert body["config"]["mediaType"] == EMPTY_MEDIA_TYPE and made.blobs[body["config"]["digest"]] == b"{}"
    assert body["subject"] == {"mediaType": OCI_MANIFEST, "digest": SUBJECT.digest, "size": len(SUBJECT.data)}
    assert made.manifest.digest == sha256_digest(made.manifest.data)
    assert referrers_tag(SUBJECT.digest) == "sha256-" + SUBJECT.digest.split(":")[1]


def test_merged_index_keeps_other_referrers_and_lists_each_once():
    ours = artifact("application/vnd.cyclonedx+json", b"{}", SUBJECT, {})
    theirs = {"mediaType": OCI_MANIFEST, "digest": "sha256:" + "a" * 64, "size": 10,
              "artifactType": "application/vnd.dev.cosign.artifact.sig.v1+json"}
    existing_bytes = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX,
                                 "manifests": [theirs, ours.entry()]}).encode()
    existing = Manifest(existing_bytes, OCI_INDEX, sha256_digest(existing_bytes))
    merged = Manifest(merged_index(existing, [ours]), OCI_INDEX, "")
    assert [e["digest"] for e in index_entries(merged)] == [theirs["digest"], ours.manifest.digest]
    assert index_entries(None) == []


def _image(created):
    return SimpleNamespace(prepared=SimpleNamespace(base_model=SimpleNamespace(config={"created": created})))


def test_build_time_is_source_date_epoch_else_the_base_created_time(monkeypatch):
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    assert build_time(_image("2026-04-01T12:30:45.123456789Z")) == datetime(2026, 4, 1, 12, 30, 45, tzinfo=UTC)
    assert build_time(_image(None)) == datetime(1970, 1, 1, tzinfo=UTC)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    assert build_time(_image("2026-04-01T12:30:45Z")) == datetime.fromtimestamp(1700000000, UTC)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(KilnError, match="SOURCE_DATE_EPOCH='yesterday'"):
        build_time(_image(None))
