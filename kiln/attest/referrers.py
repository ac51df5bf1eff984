"""Attestations as OCI 1.1 artifacts whose ``subject`` is the image, and the referrers index.

Public API:
    EMPTY_MEDIA_TYPE, DSSE_MEDIA_TYPE, SBOM_MEDIA_TYPE (re-exported)
    Artifact(artifact_type, manifest, blobs)     .entry() -> the descriptor an index lists
    attestations(image, key=None) -> list[Artifact]   the SBOM, then the DSSE-wrapped provenance
    referrers_tag(digest) -> str                 "sha256-<hex>": the referrers tag schema's tag
    merged_index(existing, artifacts) -> bytes   an OCI index of ``existing``'s entries and these
    index_entries(index) -> list[dict]          the artifact entries an index lists
    SUBJECT_ANNOTATION                           names an artifact's image in a layout's index.json

Each artifact is an OCI image manifest with ``artifactType``, the empty config
(``application/vnd.oci.empty.v1+json``, ``{}``), one layer holding the document and
``subject`` = the image manifest's descriptor. Everything is canonical JSON derived from the
``BuiltImage`` (times from ``build_time``), so a rebuild gives the same artifact digests —
except an ECDSA signature, whose nonce is random.

Registries with the referrers API (``GET /v2/<name>/referrers/<digest>``) index the artifacts
themselves; for the others (distribution 2.x) the client keeps the index under the tag
``sha256-<hex>`` of the subject (OCI distribution spec 1.1, "referrers tag schema").
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.attest.dsse import SigningKey, envelope
from kiln.attest.sbom import SBOM_MEDIA_TYPE, build_time, image_sbom
from kiln.attest.slsa import PREDICATE_TYPE, provenance_statement
from kiln.oci.digest import sha256_digest
from kiln.oci.manifest import Descriptor, Manifest
from kiln.oci.mediatypes import OCI_INDEX, OCI_MANIFEST
from kiln.oci.mutate import canonical_json

EMPTY_MEDIA_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY = b"{}"
DSSE_MEDIA_TYPE = "application/vnd.dsse.envelope.v1+json"
PREDICATE_ANNOTATION = "in-toto.io/predicate-type"
CREATED = "org.opencontainers.image.created"
__all__ = ["SBOM_MEDIA_TYPE", "DSSE_MEDIA_TYPE", "EMPTY_MEDIA_TYPE", "Artifact", "attestations",
           "referrers_tag", "merged_index", "index_entries"]


@dataclass(frozen=True)
class Artifact:
    artifact_type: str
    manifest: Manifest
    blobs: dict[str, bytes]  # digest -> bytes: the empty config and the document

    @property
    def annotations(self) -> dict:
        return self.manifest.json.get("annotations") or {}

    def entry(self) -> dict:
        out = {"mediaType": OCI_MANIFEST, "digest": self.manifest.digest, "size": len(self.manifest.data),
               "artifactType": self.artifact_type}
        if self.annotations:
            out["annotations"] = self.annotations
        return out

    def descriptors(self) -> list[Descriptor]:
        return [Descriptor(EMPTY_MEDIA_TYPE if data == EMPTY else self.artifact_type, digest, len(data))
                for digest, data in self.blobs.items()]


def artifact(artifact_type: str, document: bytes, subject: Manifest, annotations: dict) -> Artifact:
    empty = sha256_digest(EMPTY)
    layer = sha256_digest(document)
    manifest = canonical_json({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": artifact_type,
        "config": {"mediaType": EMPTY_MEDIA_TYPE, "digest": empty, "size": len(EMPTY), "data": "e30="},
        "layers": [{"mediaType": artifact_type, "digest": layer, "size": len(document)}],
        "subject": {"mediaType": subject.media_type, "digest": subject.digest, "size": len(subject.data)},
        "annotations": annotations,
    })
    return Artifact(artifact_type, Manifest(manifest, OCI_MANIFEST, sha256_digest(manifest)),
                    {empty: EMPTY, layer: document})


def attestations(image, key: SigningKey | None = None) -> list[Artifact]:
    """The SBOM and the provenance (DSSE, signed with ``key`` when given) of ``image``."""
    created = build_time(image).strftime("%Y-%m-%dT%H:%M:%SZ")
    sbom = image_sbom(image)
    statement = provenance_statement(image, sbom)
    subject = image.manifest
    return [
        artifact(SBOM_MEDIA_TYPE, sbom, subject, {CREATED: created}),
        artifact(DSSE_MEDIA_TYPE, envelope(statement, key), subject,
                 {CREATED: created, PREDICATE_ANNOTATION: PREDICATE_TYPE}),
    ]


def referrers_tag(digest: str) -> str:
    algorithm, _, value = digest.partition(":")
    return f"{algorithm}-{value}"[:128]


def index_entries(index: Manifest | None) -> list[dict]:
    """The artifact entries (those with an ``artifactType``) of a referrers index."""
    if index is None:
        return []
    return [e for e in index.json.get("manifests") or [] if isinstance(e, dict) and e.get("artifactType")]


# A layout's index.json lists artifacts beside images; this names the image each one is about.
SUBJECT_ANNOTATION = "io.kiln.subject"


def merged_index(existing: Manifest | None, artifacts: list[Artifact]) -> bytes:
    """A referrers index holding ``existing``'s entries and ``artifacts`` (each once)."""
    new = [a.entry() for a in artifacts]
    digests = {e["digest"] for e in new}
    kept = [e for e in index_entries(existing) if e.get("digest") not in digests]
    return canonical_json({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": kept + new})


