"""Every blob a built image needs, as verified local files.

Public API:
    BlobStore(base, new, workdir, reporter=SILENT)
        .path(descriptor) -> Path   new blobs as given; base blobs through the base's blob cache
        .is_new(digest) -> bool
        .bytes_fetched              base bytes read to complete a local output

Local outputs (an OCI layout, a docker-archive) need the base's blobs too; a push mounts or
finds most of them. Base blobs are read through the verifying reader of the base image, so
nothing unverified reaches an output.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

from kiln.errors import writing
from kiln.oci.digest import check_digest
from kiln.oci.image import Image
from kiln.oci.manifest import Descriptor
from kiln.report import SILENT, Reporter


class BlobStore:
    """Local, verified files for the blobs of a built image.

    ``new`` maps the digests kiln produced (layer, config) to a file or bytes; everything else
    is a base blob, read through ``base.open_layer`` (verified, and cached by digest when the
    base is remote).
    """

    def __init__(self, base: Image, new: dict[str, Path | bytes], workdir: Path, reporter: Reporter = SILENT):
        self.base = base
        self.reporter = reporter
        self.workdir = workdir
        self._new = dict(new)
        self._paths: dict[str, Path] = {}
        self.bytes_fetched = 0

    def is_new(self, digest: str) -> bool:
        return digest in self._new

    def path(self, descriptor: Descriptor) -> Path:
        digest = check_digest(descriptor.digest, "blob")
        if digest in self._paths:
            return self._paths[digest]
        if digest in self._new:
            value = self._new[digest]
            if isinstance(value, bytes):
                path = self.workdir / "blobs" / digest.replace(":", "-")
                path.parent.mkdir(parents=True, exist_ok=True)
                with writing(path, len(value)):
                    path.write_bytes(value)
            else:
                path = value
        else:
            path = self._base_path(descriptor)
        self._paths[digest] = path
        return path

    def _base_path(self, descriptor: Descriptor) -> Path:
        cache = getattr(self.base, "blobs", None)  # a RemoteImage's BlobCache
        if cache is not None and cache.has(descriptor.digest):
            return cache.path(descriptor.digest)
        # Drain through the verifying reader: a remote blob lands in the cache only once verified;
        # any other source is copied into the work directory as it is verified.
        target = None if cache is not None else self.workdir / "blobs" / descriptor.digest.replace(":", "-")
        if target is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
        with writing(target, descriptor.size) if target else nullcontext(), \
                self.reporter.task(f"pull {descriptor.digest[7:19]}", total=descriptor.size) as task, \
                (target.open("wb") if target else _NullSink()) as out, self.base.open_layer(descriptor) as reader:
            while chunk := reader.read(1 << 20):
                task.advance(len(chunk))
                out.write(chunk)
        self.bytes_fetched += descriptor.size
        return target if target is not None else cache.path(descriptor.digest)


class _NullSink:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def write(self, data: bytes) -> int:
        return len(data)
