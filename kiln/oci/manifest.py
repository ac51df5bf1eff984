"""Manifests as fetched (exact bytes + media type + digest) and the descriptors inside them.

Public API:
    Descriptor(media_type, digest, size, platform=None, annotations={})
        Descriptor.from_json(obj, what) -> Descriptor;  .to_json() -> dict
    Manifest(data, media_type, digest)       the exact bytes (the digest is over them)
        .json -> dict   .is_index   .config -> Descriptor   .layers -> list[Descriptor]
        .manifests -> list[Descriptor]
    select_platform(index, os="linux", architecture="amd64", what="") -> Descriptor
    index_platforms(index) -> dict[str, str]     "os/arch" -> manifest digest, attestations left out
    is_attestation(descriptor) -> bool

Bytes are kept, never re-serialised: a manifest re-encoded by ``json.dumps`` gets a new digest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property

from kiln.errors import KilnError
from kiln.oci.digest import check_digest
from kiln.oci.mediatypes import IMAGE_CONFIG_TYPES, IMAGE_MANIFEST_TYPES, INDEX_TYPES


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    platform: dict | None = None
    annotations: dict = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: object, what: str) -> Descriptor:
        if not isinstance(obj, dict):
            raise KilnError(f"{what}: descriptor is not a JSON object")
        size = obj.get("size")
        if not isinstance(size, int) or size < 0:
            raise KilnError(f"{what}: descriptor {obj.get('digest')!r} has no valid size")
        return cls(
            media_type=str(obj.get("mediaType", "")),
            digest=check_digest(obj.get("digest"), what),
            size=size,
            platform=obj.get("platform") if isinstance(obj.get("platform"), dict) else None,
            annotations=obj.get("annotations") or {},
        )

    def to_json(self) -> dict:
        out: dict = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.platform:
            out["platform"] = self.platform
        if self.annotations:
            out["annotations"] = self.annotations
        return out


@dataclass(frozen=True)
class Manifest:
    data: bytes
    media_type: str
    digest: str

    @cached_property
    def json(self) -> dict:
        try:
            value = json.loads(self.data)
        except ValueError:
            raise KilnError(f"manifest {self.digest}: not valid JSON") from None
        if not isinstance(value, dict):
            raise KilnError(f"manifest {self.digest}: not a JSON object")
        return value

    @property
    def is_index(self) -> bool:
        return self.media_type in INDEX_TYPES

    @property
    def config(self) -> Descriptor:
        self._require_image()
        config = Descriptor.from_json(self.json.get("config"), f"manifest {self.digest} config")
        if config.media_type not in IMAGE_CONFIG_TYPES:  # an OCI artifact (Helm chart, SBOM...)
            raise KilnError(f"manifest {self.digest}: config media type {config.media_type!r} is not a "
                            "container image config; is this reference an artifact, not an image?")
        return config

    @property
    def layers(self) -> list[Descriptor]:
        self._require_image()
        layers = self.json.get("layers")
        if not isinstance(layers, list):
            raise KilnError(f"manifest {self.digest}: no 'layers' list")
        return [Descriptor.from_json(layer, f"manifest {self.digest} layer {i}") for i, layer in enumerate(layers)]

    @property
    def manifests(self) -> list[Descriptor]:
        if not self.is_index:
            raise KilnError(f"manifest {self.digest} ({self.media_type}) is not an index")
        entries = self.json.get("manifests")
        if not isinstance(entries, list):
            raise KilnError(f"index {self.digest}: no 'manifests' list")
        return [Descriptor.from_json(m, f"index {self.digest} entry {i}") for i, m in enumerate(entries)]

    def _require_image(self) -> None:
        if self.media_type not in IMAGE_MANIFEST_TYPES:
            raise KilnError(f"manifest {self.digest}: media type {self.media_type!r} is not an image manifest")


def is_attestation(descriptor: Descriptor) -> bool:
    """BuildKit stores provenance/SBOM as index entries with platform unknown/unknown."""
    platform = descriptor.platform or {}
    return (
        "vnd.docker.reference.type" in descriptor.annotations
        or (platform.get("os") == "unknown" and platform.get("architecture") == "unknown")
    )


def index_platforms(index: Manifest) -> dict[str, str]:
    """``{"linux/amd64": digest, ...}``: an index's image entries by ``os/architecture`` (the
    first of each, as ``select_platform`` picks; attestation entries left out)."""
    found: dict[str, str] = {}
    for d in index.manifests:
        if not is_attestation(d) and d.platform:
            found.setdefault(f"{d.platform.get('os')}/{d.platform.get('architecture')}", d.digest)
    return found


def select_platform(index: Manifest, os: str = "linux", architecture: str = "amd64", what: str = "") -> Descriptor:
    """The entry for ``os/architecture``, ignoring attestation entries."""
    candidates = [
        d for d in index.manifests
        if not is_attestation(d) and d.platform
        and d.platform.get("os") == os and d.platform.get("architecture") == architecture
    ]
    if not candidates:
        offered = sorted({f"{(d.platform or {}).get('os')}/{(d.platform or {}).get('architecture')}"
                          for d in index.manifests if not is_attestation(d)})
        raise KilnError(f"{what or index.digest}: no {os}/{architecture} image in the index (has: {', '.join(offered) or 'none'})")
    return candidates[0]
