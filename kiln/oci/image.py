"""One image abstraction over its sources: a registry, or an OCI layout directory.

Public API:
    Image (protocol)
        .name -> str               for messages, e.g. "docker.io/vllm/vllm-openai@sha256:..."
        .digest -> str             what the reference resolved to (an index or a manifest)
        .manifest() -> Manifest    the image manifest of ``platform`` (index entries resolved)
        .platforms() -> dict[str, str]   "os/arch" -> image manifest digest: an index's entries, or a
                                   single manifest's own platform (from its config)
        .config_bytes() -> bytes   verified config blob;  .config() -> dict
        .layers() -> list[Descriptor]
        .open_layer(descriptor) -> ctx[VerifyingReader]   verified when the block exits
    RemoteImage(reference, client, blobs=None, platform=("linux", "amd64"))
    OciLayoutImage(path, tag=None, platform=("linux", "amd64"))

Manifests of a remote image are cached by digest under ``<cache>/manifests/`` (bytes and
media type, re-verified on read), so an image pinned by digest opens with no network at all;
blobs go through the ``BlobCache``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import cached_property
from pathlib import Path
from typing import Protocol

from kiln.cache import cache_root
from kiln.errors import KilnError
from kiln.oci.blobcache import BlobCache
from kiln.oci.digest import VerifyingReader, check_digest, sha256_digest
from kiln.oci.manifest import Descriptor, Manifest, index_platforms, select_platform
from kiln.oci.mediatypes import INDEX_TYPES, OCI_INDEX
from kiln.oci.reference import ImageReference
from kiln.oci.registry import RegistryClient
from kiln.staging import write_atomic


class Image(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def digest(self) -> str: ...
    def manifest(self) -> Manifest: ...
    def config_bytes(self) -> bytes: ...
    def config(self) -> dict: ...
    def layers(self) -> list[Descriptor]: ...
    def open_layer(self, descriptor: Descriptor) -> AbstractContextManager[VerifyingReader]: ...


class _ImageBase:
    platform: tuple[str, str]

    def _top(self) -> Manifest:
        raise NotImplementedError

    def _manifest_by_digest(self, digest: str) -> Manifest:
        raise NotImplementedError

    @property
    def name(self) -> str:
        raise NotImplementedError

    @property
    def digest(self) -> str:
        return self._top().digest

    @cached_property
    def _platform_manifest(self) -> Manifest:
        top = self._top()
        if not top.is_index:
            return top
        entry = select_platform(top, *self.platform, what=self.name)
        child = self._manifest_by_digest(entry.digest)
        if child.is_index:
            raise KilnError(f"{self.name}: nested index {child.digest} is not supported")
        return child

    def manifest(self) -> Manifest:
        return self._platform_manifest

    def platforms(self) -> dict[str, str]:
        top = self._top()
        if top.is_index:
            return index_platforms(top)
        config = self.config()
        return {f"{config.get('os') or 'linux'}/{config.get('architecture') or 'amd64'}": top.digest}

    def config(self) -> dict:
        try:
            value = json.loads(self.config_bytes())
        except ValueError:
            raise KilnError(f"{self.name}: image config is not JSON") from None
        if not isinstance(value, dict):
            raise KilnError(f"{self.name}: image config is not a JSON object")
        return value

    def layers(self) -> list[Descriptor]:
        return self.manifest().layers


class RemoteImage(_ImageBase):
    def __init__(self, reference: ImageReference, client: RegistryClient, blobs: BlobCache | None = None,
                 platform: tuple[str, str] = ("linux", "amd64"), manifest_cache: Path | None = None):
        self.reference = reference
        self.client = client
        self.blobs = blobs or BlobCache()
        self.platform = platform
        self._manifests = manifest_cache or cache_root() / "manifests"

    @property
    def name(self) -> str:
        return str(self.reference)

    @cached_property
    def _top_manifest(self) -> Manifest:
        ref = self.reference
        if ref.digest:
            return self._manifest_by_digest(ref.digest)
        manifest = self.client.get_manifest(ref.repository, ref.ref)
        self._store(manifest)
        return manifest

    def _top(self) -> Manifest:
        return self._top_manifest

    def _manifest_by_digest(self, digest: str) -> Manifest:
        path = self._manifests / check_digest(digest, self.name).replace(":", "-")
        if path.is_file():
            media_type, _, data = path.read_bytes().partition(b"\n")
            if sha256_digest(data) == digest:
                return Manifest(data, media_type.decode(), digest)
            path.unlink()  # corrupted entry: never trusted, fetched again
        manifest = self.client.get_manifest(self.reference.repository, digest)
        self._store(manifest)
        return manifest

    def _store(self, manifest: Manifest) -> None:
        path = self._manifests / manifest.digest.replace(":", "-")
        if not path.is_file():
            write_atomic(path, manifest.media_type.encode() + b"\n" + manifest.data)

    def config_bytes(self) -> bytes:
        return self._config_bytes

    @cached_property
    def _config_bytes(self) -> bytes:
        config = self.manifest().config
        return self.blobs.read_bytes(config.digest, f"{self.name} config {config.digest}",
                                     lambda: self.client.blob_stream(self.reference.repository, config.digest),
                                     config.size)

    def open_layer(self, descriptor: Descriptor) -> AbstractContextManager[VerifyingReader]:
        return self.blobs.open(descriptor.digest, f"{self.name} layer {descriptor.digest}",
                               lambda: self.client.blob_stream(self.reference.repository, descriptor.digest),
                               descriptor.size)


class OciLayoutImage(_ImageBase):
    def __init__(self, path: Path, tag: str | None = None, platform: tuple[str, str] = ("linux", "amd64")):
        self.path = path
        self.tag = tag
        self.platform = platform

    @property
    def name(self) -> str:
        return f"oci:{self.path}" + (f":{self.tag}" if self.tag else "")

    @cached_property
    def _top_manifest(self) -> Manifest:
        index_path = self.path / "index.json"
        if not index_path.is_file():
            raise KilnError(f"{self.name}: no index.json (not an OCI layout)")
        layout = Manifest(index_path.read_bytes(), OCI_INDEX, sha256_digest(index_path.read_bytes()))
        entries = layout.manifests
        if self.tag:
            entries = [e for e in entries if e.annotations.get("org.opencontainers.image.ref.name") == self.tag]
        if len(entries) != 1:
            raise KilnError(f"{self.name}: {'no' if not entries else 'several'} manifests match; name one with oci:DIR:TAG")
        return self._manifest_by_digest(entries[0].digest, entries[0].media_type)

    def _top(self) -> Manifest:
        return self._top_manifest

    def _manifest_by_digest(self, digest: str, media_type: str = "") -> Manifest:
        data = self._blob_path(digest).read_bytes()
        if sha256_digest(data) != digest:
            raise KilnError(f"{self.name}: manifest blob {digest} does not match its digest")
        if not media_type:
            media_type = str(json.loads(data).get("mediaType", ""))
            if not media_type:  # umoci omits the optional field; an index has "manifests"
                media_type = OCI_INDEX if "manifests" in json.loads(data) else "application/vnd.oci.image.manifest.v1+json"
        if media_type in INDEX_TYPES or media_type.endswith("manifest.v1+json") or media_type.endswith("manifest.v2+json"):
            return Manifest(data, media_type, digest)
        raise KilnError(f"{self.name}: manifest {digest} has unsupported media type {media_type!r}")

    def _blob_path(self, digest: str) -> Path:
        algorithm, _, hexdigest = check_digest(digest, self.name).partition(":")
        path = self.path / "blobs" / algorithm / hexdigest
        if not path.is_file():
            raise KilnError(f"{self.name}: blob {digest} missing from the layout")
        return path

    def config_bytes(self) -> bytes:
        config = self.manifest().config
        with self.open_layer(config) as reader:
            return b"".join(iter(lambda: reader.read(1 << 20), b""))

    @contextmanager
    def open_layer(self, descriptor: Descriptor) -> Iterator[VerifyingReader]:
        with self._blob_path(descriptor.digest).open("rb") as handle:
            reader = VerifyingReader(handle, descriptor.digest, f"{self.name} blob {descriptor.digest}", descriptor.size)
            yield reader
            reader.finish()
