"""Manifest and layer media types, and the Accept header every manifest request carries.

Public API: the ``OCI_*`` / ``DOCKER_*`` constants, ``MANIFEST_ACCEPT`` (all four manifest
types, in one header), ``INDEX_TYPES``, ``IMAGE_MANIFEST_TYPES``, ``IMAGE_CONFIG_TYPES``, ``tar_mode(media_type)``,
``open_layer_tar(stream, mode)`` (gzip inflated by ISA-L).

Why all four in Accept: distribution answers 404 for OCI content the client did not list and
silently converts Docker content to schema1 (a different digest) when Docker v2 is missing.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

from isal import isal_zlib

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
_TAR_LAYERS = {OCI_LAYER_TAR, "application/vnd.oci.image.layer.nondistributable.v1.tar"}


def tar_mode(media_type: str) -> str:
    """The ``tarfile.open`` streaming mode for a layer of this media type."""
    if media_type in _GZIP_LAYERS:
        return "r|gz"
    if media_type in _TAR_LAYERS:
        return "r|"
    if media_type.endswith("+zstd"):
        raise KilnError(f"layer media type {media_type}: zstd layers are not supported yet")
    raise KilnError(f"layer media type {media_type!r} is not a tar layer kiln can read")


class _Inflating:
    """The bytes of a gzip stream (every member), inflated by ISA-L; reads its source with ``read``."""

    def __init__(self, raw: BinaryIO):
        self._raw, self._inflate, self._out, self._done = raw, isal_zlib.decompressobj(31), bytearray(), False

    def read(self, size: int = -1) -> bytes:
        while not self._done and (size < 0 or len(self._out) < size):
            if self._inflate.eof:  # a member ended: another may follow (concatenated gzip)
                rest = self._inflate.unused_data or self._raw.read(1 << 20)
                if not rest:
                    self._done = True
                    break
                self._inflate = isal_zlib.decompressobj(31)
                self._out += self._inflate.decompress(rest)
                continue
            chunk = self._raw.read(1 << 20)
            if not chunk:
                raise EOFError("compressed data ended before the end-of-stream marker")
            self._out += self._inflate.decompress(chunk)
        size = len(self._out) if size < 0 else min(size, len(self._out))
        data = bytes(self._out[:size])
        del self._out[:size]
        return data


@contextmanager
def open_layer_tar(stream: BinaryIO, mode: str) -> Iterator[tarfile.TarFile]:
    """A layer's tar, streamed (``mode`` from ``tar_mode``); gzip is inflated by ISA-L (``isal``).

    Measured on vLLM's layer (``ci/bench_build.py``, docs/BENCHMARKS.md): ISA-L inflates it
    2.3-3x as fast as the standard zlib, zlib-ng 1.9-2.7x, rapidgzip 1.2-1.5x (it needs a
    seekable file to go parallel; a layer arrives as a stream). A corrupt stream is a
    ``tarfile.ReadError``.
    """
    try:
        if mode == "r|gz":
            with tarfile.open(fileobj=_Inflating(stream), mode="r|") as tar:
                yield tar
        else:
            with tarfile.open(fileobj=stream, mode=mode) as tar:
                yield tar
    except isal_zlib.error as err:
        raise tarfile.ReadError(f"invalid compressed data ({err})") from None
