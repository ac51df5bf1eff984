"""Pristine vLLM source taken from a base image, reading only the layers that hold it.

Public API:
    ImageVllm     what was found: tree (SourceTree), image, digest, manifest_digest, site_dir,
                  layers_read, triton_version, vllm_files
    read_vllm(image, cache=None, reporter=SILENT) -> ImageVllm   walk ``image`` top-down (``layerwalk``)
    ImageSource(reference, expected_version=None, registry_config=None, cache=None, stats=None,
                reporter=SILENT)
        the ``SourceProvider`` for images: .describe() -> str, .fetch() -> SourceTree,
        .pull() -> ImageVllm (the same plus what the bake step needs)

Caching: layers by digest in the blob cache; the extracted tree under
``<cache>/sources/image-<hex>/`` where ``<hex>`` is the sha256 of the digests of the layers read
(content-addressed: the same layers give the same tree); and a record per resolved image digest
under ``<cache>/images/`` so an image pinned by digest is answered with no network at all.
A tag costs one manifest HEAD to learn its current digest.

A base whose vLLM differs from ``expected_version`` is refused: patches are written per pin.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import shutil
import tarfile
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.version import Version

from kiln.cache import cache_root, file_lock
from kiln.errors import KilnError
from kiln.oci.blobcache import BlobCache
from kiln.oci.endpoints import RegistryConfig
from kiln.oci.image import Image, RemoteImage
from kiln.oci.mediatypes import open_layer_tar, tar_mode
from kiln.oci.reference import ImageReference, parse_reference
from kiln.oci.registry import RegistryClient, TransferStats
from kiln.pausepoint import pause_point
from kiln.report import SILENT, Reporter
from kiln.source.layerwalk import VllmLayerWalk
from kiln.source.tree import SourceTree
from kiln.staging import write_atomic

_READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class ImageVllm:
    tree: SourceTree
    image: str  # the reference, e.g. "docker.io/vllm/vllm-openai:v0.20.1"
    digest: str  # what it resolved to (index or manifest): the digest a pin locks
    manifest_digest: str  # the linux/amd64 image manifest
    site_dir: str  # "usr/local/lib/python3.12/dist-packages"
    layers_read: tuple[str, ...]  # digests, top-most first
    triton_version: str | None
    vllm_files: tuple[str, ...]  # every file under vllm/ visible in the layers read (incl. __pycache__)


def read_vllm(image: Image, cache: Path | None = None, reporter: Reporter = SILENT) -> ImageVllm:
    """Extract ``vllm/**/*.py`` from the fewest top-most layers of ``image`` (verified, cached)."""
    cache = cache or cache_root()
    config = image.config()
    arch, os_name = config.get("architecture"), config.get("os")
    if (arch and arch != "amd64") or (os_name and os_name != "linux"):
        raise KilnError(f"{image.name}: image is {os_name}/{arch}, kiln builds linux/amd64")
    layers = image.layers()
    sources = cache / "sources"
    sources.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=sources, prefix=".tmp-image-"))
    walk = VllmLayerWalk(work)
    try:
        for descriptor in reversed(layers):
            try:
                mode = tar_mode(descriptor.media_type)
            except KilnError as err:
                raise KilnError(f"{image.name}: layer {descriptor.digest}: {err}") from None
            with reporter.task(f"layer {descriptor.digest[7:19]}", total=descriptor.size) as task, \
                    image.open_layer(descriptor) as reader, _Prefetch(reader, task.advance) as stream:
                try:
                    with open_layer_tar(stream, mode) as tar:
                        walk.add_layer(tar, descriptor.digest)
                except (tarfile.TarError, EOFError, OSError) as err:
                    raise KilnError(f"{image.name}: layer {descriptor.digest} is not a readable tar ({err})") from None
            if walk.complete:
                break
            pause_point("pull")
        found = walk.result()
        identity = hashlib.sha256("\n".join(found.layers).encode()).hexdigest()
        final = sources / f"image-{identity}"
        with file_lock(sources / f".image-{identity}.lock"):
            if not final.is_dir():
                os.rename(work, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tree = SourceTree(
        root=final / found.site_dir,
        vllm_version=found.vllm_version,
        identity=f"sha256:{identity}",
        origin=f"image {image.name} ({len(found.layers)} of {len(layers)} layers read)",
    )
    return ImageVllm(tree, image.name, image.digest, image.manifest().digest, found.site_dir,
                     found.layers, found.triton_version, found.files)


class _Prefetch:
    """Reads a layer ahead in a thread while the caller decompresses and parses it.

    The reader's work (HTTP, sha256, the blob-cache write) and zlib release the GIL, so the two
    overlap on a second core. Reads are 1 MiB: tarfile asks for 10 KiB at a time, and one call
    per 10 KiB through the digest, cache and HTTP layers cost ~0.5 s per 250 MB. ``close`` (on
    leaving the block) stops and joins the thread, before the blob cache drains and verifies
    the rest of the blob on the caller's thread; an error in the thread is raised to the caller.
    """

    def __init__(self, reader, advance: Callable[[int], object], depth: int = 8):
        self._reader, self._advance = reader, advance
        self._queue: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
        self._pending = memoryview(b"")
        self._eof = False
        self._thread = threading.Thread(target=self._run, name="kiln-layer-prefetch", daemon=True)
        self._thread.start()

    def __enter__(self) -> _Prefetch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                data = self._reader.read(_READ_CHUNK)
                self._put(data)
                if not data:
                    return
        except BaseException as err:  # handed to the reading thread
            self._put(err)

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def read(self, n: int = -1) -> bytes:
        while not self._pending:
            if self._eof:
                return b""
            item = self._queue.get()
            if isinstance(item, BaseException):
                self._eof = True
                raise item
            if not item:
                self._eof = True
                return b""
            self._advance(len(item))
            self._pending = memoryview(item)
        n = len(self._pending) if n is None or n < 0 else n
        data, self._pending = self._pending[:n], self._pending[n:]
        return bytes(data)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class ImageSource:
    """``SourceProvider`` reading the pristine tree out of a base image in a registry."""

    def __init__(self, reference: str | ImageReference, expected_version: Version | str | None = None,
                 registry_config: RegistryConfig | None = None, cache: Path | None = None,
                 stats: TransferStats | None = None, reporter: Reporter = SILENT):
        self.reference = parse_reference(reference) if isinstance(reference, str) else reference
        self.expected_version = Version(str(expected_version)) if expected_version else None
        self.registry_config = registry_config or RegistryConfig.load()
        self.cache = cache or cache_root()
        self.stats = stats or TransferStats()
        self.reporter = reporter
        self._client: RegistryClient | None = None

    def describe(self) -> str:
        return f"vLLM source from image {self.reference}"

    @property
    def client(self) -> RegistryClient:
        if self._client is None:
            self._client = RegistryClient.for_registry(self.reference.registry, self.registry_config, stats=self.stats)
        return self._client

    def fetch(self) -> SourceTree:
        return self.pull().tree

    def pull(self) -> ImageVllm:
        ref = self.reference
        digest = ref.digest or self.client.resolve(ref.repository, ref.ref)
        record_path = self.cache / "images" / f"{digest.replace(':', '-')}.json"
        found = _load_record(record_path)
        if found is None:
            image = RemoteImage(ref.pinned(digest), self.client, BlobCache(self.cache / "blobs"),
                                manifest_cache=self.cache / "manifests")
            found = read_vllm(image, self.cache, self.reporter)
            found = ImageVllm(found.tree, str(ref), digest, found.manifest_digest, found.site_dir,
                              found.layers_read, found.triton_version, found.vllm_files)
            _save_record(record_path, found)
        if self.expected_version and found.tree.vllm_version != self.expected_version:
            raise KilnError(
                f"{ref}: the image carries vLLM {found.tree.vllm_version}, the pin expects "
                f"{self.expected_version}; refusing a mismatched base"
            )
        return found


def _save_record(path: Path, found: ImageVllm) -> None:
    record = asdict(found)
    record["tree"] = {"root": str(found.tree.root), "vllm_version": str(found.tree.vllm_version),
                      "identity": found.tree.identity, "origin": found.tree.origin}
    write_atomic(path, json.dumps(record, indent=1).encode())


def _load_record(path: Path) -> ImageVllm | None:
    try:
        record = json.loads(path.read_text())
        tree = record.pop("tree")
        root = Path(tree["root"])
        if not (root / "vllm" / "__init__.py").is_file():
            return None  # the tree was pruned from the cache: read the layers again
        source = SourceTree(root, Version(tree["vllm_version"]), tree["identity"], tree["origin"])
        return ImageVllm(tree=source, **{k: tuple(v) if isinstance(v, list) else v for k, v in record.items()})
    except (OSError, ValueError, KeyError, TypeError):
        return None
