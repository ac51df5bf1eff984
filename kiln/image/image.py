"""The one image value a build produces, which every publisher writes somewhere.

Public API:
    BuiltImage      prepared (the decisions), model (config + manifest), layers (kiln's, baked),
                    blobs (every blob by digest, as verified local files), attestations (the
                    SBOM and provenance artifacts, set by the pipeline: ``kiln.attest``)
        .manifest, .config_digest, .tag
    bake(prepared, workdir, reporter=SILENT) -> BuiltImage   pure given ``prepared``: no clock, no network
    BuiltIndex(images)  one tag's platforms: an OCI image index of their manifests (``.manifest``),
                        each image with its own SBOM and provenance; ``.of(platform)``, ``.tag``
    parts(image) -> list[BuiltImage]    the images a publisher writes (an index's, or the one)

Baking writes each of kiln's ``LayerContents`` as a deterministic gzip tar in ``workdir`` and
derives the config and manifest with the pure ``kiln.oci.mutate`` steps (canonical JSON), so the
same prepared build gives the same manifest digest on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kiln import __version__
from kiln.image.prepare import PreparedBuild
from kiln.oci.blobstore import BlobStore
from kiln.oci.digest import sha256_digest
from kiln.oci.layer import Layer, write_layer
from kiln.oci.manifest import Manifest
from kiln.oci.mediatypes import OCI_INDEX
from kiln.oci.mutate import (
    ImageModel,
    append_layer,
    canonical_json,
    with_annotations,
    with_env,
    with_labels,
)
from kiln.report import SILENT, Reporter


@dataclass
class BuiltImage:
    prepared: PreparedBuild
    model: ImageModel
    layers: list[Layer]  # kiln's layers, bottom first (the patched source first)
    blobs: BlobStore
    attestations: list = field(default_factory=list)  # kiln.attest.referrers.Artifact: SBOM, provenance

    @property
    def manifest(self) -> Manifest:
        return self.model.manifest()

    @property
    def config_digest(self) -> str:
        return self.model.config_descriptor().digest

    @property
    def tag(self) -> str:
        return self.prepared.tag


def bake(prepared: PreparedBuild, workdir: Path, reporter: Reporter = SILENT) -> BuiltImage:
    """Write kiln's layers into ``workdir`` and derive the image's config and manifest."""
    model = prepared.base_model
    baked = []
    for contents in prepared.layers:
        layer = write_layer(contents, workdir)
        model = append_layer(model, layer.digest, layer.diff_id, layer.size,
                             created_by=contents.created_by, comment=f"kiln {__version__}")
        baked.append(layer)
    model = with_annotations(with_labels(model, prepared.labels), prepared.labels)
    if prepared.env:
        model = with_env(model, prepared.env)
    new_blobs: dict[str, Path | bytes] = {layer.digest: layer.path for layer in baked}
    new_blobs[model.config_descriptor().digest] = model.config_bytes()
    return BuiltImage(prepared, model, baked, BlobStore(prepared.base, new_blobs, workdir, reporter))


@dataclass
class BuiltIndex:
    """One tag's images, one per platform (the order the SM's platforms are listed in): the tag
    names the index of their manifests. Its digest is a function of theirs: reproducible as they are."""

    images: list[BuiltImage]

    @property
    def manifest(self) -> Manifest:
        entries = []
        for image in self.images:
            os_name, _, arch = image.prepared.inputs.platform.partition("/")
            manifest = image.manifest
            entries.append({"mediaType": manifest.media_type, "digest": manifest.digest, "size": len(manifest.data),
                            "platform": {"architecture": arch, "os": os_name}})
        data = canonical_json({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries})
        return Manifest(data, OCI_INDEX, sha256_digest(data))

    @property
    def prepared(self) -> PreparedBuild:
        return self.images[0].prepared

    @property
    def tag(self) -> str:
        return self.images[0].tag

    @property
    def attestations(self) -> list:
        return []  # each platform's image carries its own

    def of(self, platform: str) -> BuiltImage:
        return next(image for image in self.images if image.prepared.inputs.platform == platform)


def parts(image) -> list[BuiltImage]:
    """The platform images of ``image``: an index's, or the one image itself."""
    return list(image.images) if isinstance(image, BuiltIndex) else [image]
