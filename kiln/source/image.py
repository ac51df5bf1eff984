"""Pristine vLLM source taken from a base image, reading only the layers that hold it.

Public API:
    ImageVllm     what was found: tree (SourceTree), image, digest, manifest_digest, site_dir,
                  layers_read, triton_version, triton_record, vllm_files
    check_platform(config, name, platform="linux/amd64")   a base config of another platform than
                  the one built is refused (a config that names none is taken as it)
    read_vllm(image, cache=None, reporter=SILENT, budget=None, need_triton=False) -> ImageVllm
                  ``image.platform``'s manifest (``kiln.oci.image``) and config
                  walk ``image`` top-down (``layerwalk``), its layers (gzip, zstd or plain tar)
                  decompressed, bounded and checked against the config's diff_ids by
                  ``layerstream``; ``need_triton``: read on until Triton's dist-info is found
    ImageSource(reference, expected_version=None, registry_config=None, cache=None, stats=None,
                reporter=SILENT, budget=None, need_triton=False, platform="linux/amd64")
                                                 ``budget``: the build's limits (``kiln.oci.limits``), by
                                                 default from ``registry_config.limits``; ``platform``: the
                                                 index entry read (its record apart from linux/amd64's)
        the ``SourceProvider`` for images: .describe() -> str, .fetch() -> SourceTree,
        .pull() -> ImageVllm (the same plus what the bake step needs)
    cached_image_vllm(digest, cache=None) -> ImageVllm | None   what a pull of ``digest`` left in the
                                                 cache (no network), e.g. for ``verify --pin``

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
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from packaging.version import Version

from kiln.cache import cache_root, file_lock
from kiln.errors import KilnError
from kiln.oci.blobcache import BlobCache
from kiln.oci.endpoints import RegistryConfig
from kiln.oci.image import Image, RemoteImage
from kiln.oci.limits import Budget
from kiln.oci.mediatypes import tar_mode
from kiln.oci.reference import ImageReference, parse_reference
from kiln.oci.registry import RegistryClient, TransferStats
from kiln.pausepoint import pause_point
from kiln.report import SILENT, Reporter
from kiln.source.layerstream import open_tar
from kiln.source.layerwalk import VllmLayerWalk
from kiln.source.tree import CachedProvider, SourceTree
from kiln.staging import write_atomic
from kiln.targets import DEFAULT_PLATFORM, split_platform

_SHA256 = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class ImageVllm:
    tree: SourceTree
    image: str  # the reference, e.g. "docker.io/vllm/vllm-openai:v0.20.1"
    digest: str  # what it resolved to (index or manifest): the digest a pin locks
    manifest_digest: str  # the platform's image manifest
    site_dir: str  # "usr/local/lib/python3.12/dist-packages"
    layers_read: tuple[str, ...]  # digests, top-most first
    triton_version: str | None
    triton_record: str | None  # the image's triton-*.dist-info/RECORD (kiln.triton.imagekey reads it)
    vllm_files: tuple[str, ...]  # every file under vllm/ visible in the layers read (incl. __pycache__)


def read_vllm(image: Image, cache: Path | None = None, reporter: Reporter = SILENT,
              budget: Budget | None = None, need_triton: bool = False) -> ImageVllm:
    """Extract ``vllm/**/*.py`` from the fewest top-most layers of ``image`` (verified, cached).

    ``budget`` bounds the work (``kiln.oci.limits``): the number of layers, the bytes they
    decompress to, the build's deadline.
    """
    cache = cache or cache_root()
    budget = budget or Budget()
    config = image.config()
    check_platform(config, image.name, "/".join(getattr(image, "platform", split_platform(DEFAULT_PLATFORM))))
    layers = image.layers()
    budget.check_layers(image.name, len(layers))
    diff_ids = _diff_ids(config, len(layers))
    sources = cache / "sources"
    sources.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=sources, prefix=".tmp-image-"))
    walk = VllmLayerWalk(work, need_triton)
    try:
        for index, descriptor in reversed(list(enumerate(layers))):
            name = f"{image.name}: layer {descriptor.digest}"
            try:
                mode = tar_mode(descriptor.media_type)
            except KilnError as err:
                raise KilnError(f"{name}: {err}") from None
            with reporter.task(f"layer {descriptor.digest[7:19]}", total=descriptor.size) as task, \
                    image.open_layer(descriptor) as reader, \
                    open_tar(reader, mode, name, budget, reporter, task.advance, diff_ids[index]) as tar:
                walk.add_layer(tar, descriptor.digest)
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
                     found.layers, found.triton_version, found.triton_record, found.files)


def _diff_ids(config: dict, count: int) -> list[str | None]:
    """The config's ``rootfs.diff_ids``, one per layer (None where it gives none kiln can check:
    a malformed list is refused later, with its own message, by ``ImageModel.from_base``)."""
    rootfs = config.get("rootfs")
    listed = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(listed, list) or len(listed) != count:
        return [None] * count
    return [d if isinstance(d, str) and _SHA256.fullmatch(d) else None for d in listed]


def check_platform(config: dict, name: str, platform: str = DEFAULT_PLATFORM) -> None:
    """A base's config says ``platform`` (or nothing): the platform this build is for."""
    arch, os_name = config.get("architecture"), config.get("os")
    want_os, want_arch = split_platform(platform)
    if (arch and arch != want_arch) or (os_name and os_name != want_os):
        raise KilnError(f"{name}: image is {os_name}/{arch}, this build is for {platform}")


class ImageSource(CachedProvider):
    """``SourceProvider`` reading the pristine tree out of a base image in a registry."""

    def __init__(self, reference: str | ImageReference, expected_version: Version | str | None = None,
                 registry_config: RegistryConfig | None = None, cache: Path | None = None,
                 stats: TransferStats | None = None, reporter: Reporter = SILENT, budget: Budget | None = None,
                 need_triton: bool = False, platform: str = DEFAULT_PLATFORM):
        self.platform = platform
        self.reference = parse_reference(reference) if isinstance(reference, str) else reference
        self.expected_version = Version(str(expected_version)) if expected_version else None
        self.registry_config = registry_config or RegistryConfig.load()
        self._cache = cache
        self.budget = budget or Budget(self.registry_config.limits)
        self.stats = stats or TransferStats()
        self.reporter = reporter
        self.need_triton = need_triton
        self._client: RegistryClient | None = None

    def describe(self) -> str:
        return f"vLLM source from image {self.reference}"

    @property
    def client(self) -> RegistryClient:
        if self._client is None:
            self._client = RegistryClient.for_registry(self.reference.registry, self.registry_config,
                                                       stats=self.stats, budget=self.budget)
        return self._client

    def fetch(self) -> SourceTree:
        return self.pull().tree

    def pull(self) -> ImageVllm:
        ref = self.reference
        digest = ref.digest or self.client.resolve(ref.repository, ref.ref)
        # a walk that read on for Triton may have read more layers: its own record
        suffix = "+triton" if self.need_triton else ""
        # another platform's entry of the same index: its own record (linux/amd64's keeps its name)
        where = "" if self.platform == DEFAULT_PLATFORM else "@" + self.platform.replace("/", "-")
        record_path = self.cache / "images" / f"{digest.replace(':', '-')}{where}{suffix}.json"
        found = _load_record(record_path)
        if found is None:
            image = RemoteImage(ref.pinned(digest), self.client, BlobCache(self.cache / "blobs"),
                                platform=split_platform(self.platform), manifest_cache=self.cache / "manifests")
            found = read_vllm(image, self.cache, self.reporter, self.budget, self.need_triton)
            found = ImageVllm(found.tree, str(ref), digest, found.manifest_digest, found.site_dir,
                              found.layers_read, found.triton_version, found.triton_record, found.vllm_files)
            _save_record(record_path, found)
        if self.expected_version and found.tree.vllm_version != self.expected_version:
            raise KilnError(
                f"{ref}: the image carries vLLM {found.tree.vllm_version}, the pin expects "
                f"{self.expected_version}; refusing a mismatched base"
            )
        return found


def cached_image_vllm(digest: str, cache: Path | None = None) -> ImageVllm | None:
    """What kiln already read from the image ``digest`` (a build's pull: its record under
    ``<cache>/images/``, with its tree still in the cache), or None. No network."""
    cache = cache or cache_root()
    for suffix in ("", "+triton"):
        found = _load_record(cache / "images" / f"{digest.replace(':', '-')}{suffix}.json")
        if found is not None:
            return found
    return None


def _save_record(path: Path, found: ImageVllm) -> None:
    record = asdict(found)
    record["tree"] = {"root": str(found.tree.root), "vllm_version": str(found.tree.vllm_version),
                      "identity": found.tree.identity, "origin": found.tree.origin}
    write_atomic(path, json.dumps(record, indent=1).encode())


def _load_record(path: Path) -> ImageVllm | None:
    try:
        record = json.loads(path.read_text())
        if set(record) != {f.name for f in fields(ImageVllm)}:
            return None  # written by another kiln version: read the layers again
        tree = record.pop("tree")
        root = Path(tree["root"])
        if not (root / "vllm" / "__init__.py").is_file():
            return None  # the tree was pruned from the cache: read the layers again
        source = SourceTree(root, Version(tree["vllm_version"]), tree["identity"], tree["origin"])
        return ImageVllm(tree=source, **{k: tuple(v) if isinstance(v, list) else v for k, v in record.items()})
    except (OSError, ValueError, KeyError, TypeError):
        return None
