"""Manifest and layer media types, and the Accept header every manifest request carries.

Public API: the ``OCI_*`` / ``DOCKER_*`` constants, ``MANIFEST_ACCEPT`` (all four manifest
types, in one header), ``INDEX_TYPES``, ``IMAGE_MANIFEST_TYPES``, ``IMAGE_CONFIG_TYPES``, ``tar_mode(media_type)``,
the layer's tar mode: "r|gz", "r|zst" or "r|" (decompression: ``kiln.source.layerstream``).

Why all four in Accept: distribution answers 404 for OCI content the client did not list and
silently converts Docker content to schema1 (a different digest) when Docker v2 is missing.
"""

from __future__ import annotations

from kiln.errors import KilnError

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
DOCKER_FOREIGN_LAYER = "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip"

INDEX_TYPES = frozenset({OCI_INDEX, DOCKER_LIST})
IMAGE_MANIFEST_TYPES = frozenset({OCI_MANIFEST, DOCKER_MANIFEST})
IMAGE_CONFIG_TYPES = frozenset({OCI_CONFIG, DOCKER_CONFIG})
MANIFEST_ACCEPT = ", ".join([OCI_INDEX, DOCKER_LIST, OCI_MANIFEST, DOCKER_MANIFEST])

_GZIP_LAYERS = {OCI_LAYER_GZIP, DOCKER_LAYER_GZIP, DOCKER_FOREIGN_LAYER,
                "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"}
_ZSTD_LAYERS = {OCI_LAYER_ZSTD, "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd"}
_TAR_LAYERS = {OCI_LAYER_TAR, "application/vnd.oci.image.layer.nondistributable.v1.tar"}


def tar_mode(media_type: str) -> str:
    """How a layer of this media type is stored, as a ``tarfile`` streaming mode (Python 3.14's
    names: "r|zst" for zstd); the registry build cache's keys name layers by it."""
    if media_type in _GZIP_LAYERS:
        return "r|gz"
    if media_type in _ZSTD_LAYERS:
        return "r|zst"
    if media_type in _TAR_LAYERS:
        return "r|"
    raise KilnError(f"layer media type {media_type!r} is not a tar layer kiln can read")
