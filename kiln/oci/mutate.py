"""The image being built, and pure steps that derive a new image from an old one.

Public API:
    ImageModel(media_type, config, layers, annotations={})
        ImageModel.from_base(manifest, config_bytes) -> ImageModel
        .layer_media_type          gzip layer type matching the manifest flavour (OCI / Docker v2)
        .config_bytes() -> bytes   canonical JSON;   .config_descriptor() -> Descriptor
        .manifest() -> Manifest    canonical JSON bytes, media type and digest
        .blobs() -> list[Descriptor]   config first, then the layers (what a sink must store)
    append_layer(image, digest, diff_id, size, created_by, comment="") -> ImageModel
    to_oci(image) -> ImageModel     Docker v2 -> OCI media types (same blobs)
    with_labels(image, labels) / with_annotations(image, annotations) / with_env(image, env)
    canonical_json(value) -> bytes

Every step returns a new ``ImageModel`` and leaves its input untouched. Serialisation is
canonical (sorted keys, no whitespace, UTF-8), and no step reads a clock: the same base and
the same steps give byte-identical config and manifest, hence the same manifest digest.

Flavour: a model keeps its base's manifest type until ``to_oci``. An OCI manifest carries
annotations; a Docker v2 manifest has no such field, so there the labels (always written to
the config) are the only record.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, replace

from kiln.errors import KilnError
from kiln.oci.digest import check_digest, sha256_digest
from kiln.oci.manifest import Descriptor, Manifest
from kiln.oci.mediatypes import (
    DOCKER_CONFIG,
    DOCKER_FOREIGN_LAYER,
    DOCKER_LAYER_GZIP,
    DOCKER_MANIFEST,
    OCI_CONFIG,
    OCI_LAYER_GZIP,
    OCI_MANIFEST,
)

_CONFIG_TYPE = {OCI_MANIFEST: OCI_CONFIG, DOCKER_MANIFEST: DOCKER_CONFIG}
_LAYER_TYPE = {OCI_MANIFEST: OCI_LAYER_GZIP, DOCKER_MANIFEST: DOCKER_LAYER_GZIP}


def _json_kind(value: object) -> str:
    if value is None:
        return "missing"
    names = {str: "a string", int: "a number", float: "a number", bool: "a boolean", dict: "an object"}
    return f"{names.get(type(value), type(value).__name__)} ({json.dumps(value)[:40]})"


def canonical_json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


@dataclass(frozen=True)
class ImageModel:
    media_type: str  # OCI_MANIFEST or DOCKER_MANIFEST
    config: dict  # the parsed image config; never mutated in place
    layers: tuple[Descriptor, ...]
    annotations: dict = field(default_factory=dict)  # manifest annotations (OCI only)

    def __post_init__(self) -> None:
        if self.media_type not in _CONFIG_TYPE:
            raise KilnError(f"manifest media type {self.media_type!r}: kiln writes OCI or Docker v2 image manifests only")

    @classmethod
    def from_base(cls, manifest: Manifest, config_bytes: bytes) -> ImageModel:
        try:
            config = json.loads(config_bytes)
        except ValueError:
            raise KilnError(f"base image {manifest.digest}: config is not JSON") from None
        if not isinstance(config, dict):
            raise KilnError(f"base image {manifest.digest}: config is not a JSON object")
        media_type = manifest.media_type
        layers = tuple(manifest.layers)
        for layer in layers:
            if not layer.media_type:
                raise KilnError(f"base image {manifest.digest}: layer {layer.digest} has no mediaType")
        rootfs = config.get("rootfs")
        diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
        where = f"base image {manifest.digest}: config rootfs.diff_ids"
        if not isinstance(diff_ids, list):
            raise KilnError(f"{where} is {_json_kind(diff_ids)}, not a list of the {len(layers)} layers' digests")
        if len(diff_ids) != len(layers):
            raise KilnError(f"{where} lists {len(diff_ids)} digests for {len(layers)} layers")
        for i, diff_id in enumerate(diff_ids):
            check_digest(diff_id, f"{where}[{i}]")
        annotations = dict(manifest.json.get("annotations") or {}) if media_type == OCI_MANIFEST else {}
        return cls(media_type, config, layers, annotations)

    @property
    def layer_media_type(self) -> str:
        return _LAYER_TYPE[self.media_type]

    def config_bytes(self) -> bytes:
        return canonical_json(self.config)

    def config_descriptor(self) -> Descriptor:
        data = self.config_bytes()
        return Descriptor(_CONFIG_TYPE[self.media_type], sha256_digest(data), len(data))

    def manifest(self) -> Manifest:
        body: dict = {
            "schemaVersion": 2,
            "mediaType": self.media_type,
            "config": self.config_descriptor().to_json(),
            "layers": [layer.to_json() for layer in self.layers],
        }
        if self.annotations and self.media_type == OCI_MANIFEST:
            body["annotations"] = dict(self.annotations)
        data = canonical_json(body)
        return Manifest(data, self.media_type, sha256_digest(data))

    def blobs(self) -> list[Descriptor]:
        return [self.config_descriptor(), *self.layers]


def _edit_config(image: ImageModel) -> tuple[dict, dict]:
    config = copy.deepcopy(image.config)
    inner = config.get("config")
    if not isinstance(inner, dict):
        inner = config["config"] = {}
    return config, inner


def append_layer(image: ImageModel, digest: str, diff_id: str, size: int, created_by: str,
                 comment: str = "") -> ImageModel:
    """Add a gzip layer on top: descriptor, ``rootfs.diff_ids`` and one ``history`` entry.

    Keeps the non-empty ``history`` entries equal in number to ``diff_ids`` (bases that left
    history short get placeholder entries for their layers first).
    """
    config = copy.deepcopy(image.config)
    rootfs = config.setdefault("rootfs", {"type": "layers", "diff_ids": []})
    rootfs.setdefault("type", "layers")
    diff_ids = rootfs.setdefault("diff_ids", [])
    history = config.get("history")
    history = list(history) if isinstance(history, list) else []
    non_empty = sum(1 for h in history if isinstance(h, dict) and not h.get("empty_layer"))
    history.extend({"created_by": "(base layer, no history recorded)"} for _ in range(len(diff_ids) - non_empty))
    entry: dict = {"created_by": created_by}
    if config.get("created"):
        entry["created"] = config["created"]  # the base's timestamp: no clock, reproducible
    if comment:
        entry["comment"] = comment
    history.append(entry)
    diff_ids.append(diff_id)
    config["history"] = history
    layer = Descriptor(image.layer_media_type, digest, size)
    return replace(image, config=config, layers=(*image.layers, layer))


def to_oci(image: ImageModel) -> ImageModel:
    """The same image as an OCI manifest: Docker v2 media types mapped, blobs untouched.

    Layer and config bytes stay as they are (Docker v2 gzip layers *are* OCI gzip layers and
    the config schema is shared), so only the manifest changes. skopeo's OCI layout reader
    ignores Docker v2 manifests, so layouts need this; kiln applies it to every output so all
    sinks hold one image with one digest.
    """
    if image.media_type == OCI_MANIFEST:
        return image
    layers = []
    for layer in image.layers:
        if layer.media_type == DOCKER_FOREIGN_LAYER:
            raise KilnError(f"layer {layer.digest}: Docker foreign layers cannot be converted to OCI")
        media_type = OCI_LAYER_GZIP if layer.media_type == DOCKER_LAYER_GZIP else layer.media_type
        layers.append(replace(layer, media_type=media_type))
    return replace(image, media_type=OCI_MANIFEST, layers=tuple(layers))


def with_labels(image: ImageModel, labels: dict[str, str]) -> ImageModel:
    config, inner = _edit_config(image)
    inner["Labels"] = {**(inner.get("Labels") or {}), **labels}
    return replace(image, config=config)


def with_annotations(image: ImageModel, annotations: dict[str, str]) -> ImageModel:
    return replace(image, annotations={**image.annotations, **annotations})


def with_env(image: ImageModel, env: dict[str, str]) -> ImageModel:
    """Set environment variables, replacing an existing ``KEY=`` entry in place."""
    config, inner = _edit_config(image)
    entries = list(inner.get("Env") or [])
    for key, value in env.items():
        if not key or "=" in key:
            raise KilnError(f"environment variable name {key!r} is not valid")
        line = f"{key}={value}"
        for i, existing in enumerate(entries):
            if existing.split("=", 1)[0] == key:
                entries[i] = line
                break
        else:
            entries.append(line)
    inner["Env"] = entries
    return replace(image, config=config)
