"""Where a built image goes: an OCI layout, a docker-archive tarball, or a registry.

Public API:
    BlobStore(base, new)            every blob an image needs, as verified local files
        .path(descriptor) -> Path   new blobs as given; base blobs through the base's blob cache
        .is_new(digest) -> bool
        .bytes_fetched              base bytes read to complete a local output
    stage_oci_layout(model, blobs, dest, tag) -> Staged       .commit() -> Path, .discard()
    stage_docker_archive(model, blobs, dest, repo_tags) -> Staged
    write_oci_layout(...) / write_docker_archive(...) -> Path  stage + commit
    push_image(model, blobs, client, repository, tags, mount_from=None) -> PushReport

Outputs are staged beside their destination and renamed into place only once complete (and,
in a build, only after the push succeeded), so a failure leaves no partial directory or file. A push uploads (or mounts, or finds) every
blob before it PUTs the manifest, byte-exact, once per tag: no tag can name an incomplete
image.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kiln import ui
from kiln.errors import KilnError
from kiln.oci.digest import check_digest
from kiln.oci.image import Image
from kiln.oci.layer import LAYER_MTIME
from kiln.oci.manifest import Descriptor
from kiln.oci.mediatypes import OCI_INDEX
from kiln.oci.mutate import ImageModel, canonical_json
from kiln.oci.registry import RegistryClient
from kiln.pausepoint import pause_point

REF_NAME = "org.opencontainers.image.ref.name"
_CHUNKED_ABOVE = 512 << 20  # bigger blobs are pushed in PATCH chunks of this size


class BlobStore:
    """Local, verified files for the blobs of a built image.

    ``new`` maps the digests kiln produced (layer, config) to a file or bytes; everything else
    is a base blob, read through ``base.open_layer`` (verified, and cached by digest when the
    base is remote).
    """

    def __init__(self, base: Image, new: dict[str, Path | bytes], workdir: Path):
        self.base = base
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
        with ui.transfer_progress() as progress, (target.open("wb") if target else _NullSink()) as out:
            task = progress.add_task(f"pull {descriptor.digest[7:19]}", total=descriptor.size)
            with self.base.open_layer(descriptor) as reader:
                while chunk := reader.read(1 << 20):
                    progress.advance(task, len(chunk))
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


# -- staging ---------------------------------------------------------------------------------


@dataclass
class Staged:
    """A complete output written beside its destination, not yet visible there."""

    path: Path  # the staged file or directory
    dest: Path
    is_dir: bool

    def commit(self) -> Path:
        if self.is_dir:
            _replace_dir(self.path, self.dest)
        else:
            os.replace(self.path, self.dest)
        return self.dest

    def discard(self) -> None:
        if self.is_dir:
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            self.path.unlink(missing_ok=True)


def _stage_dir(dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))


def _replace_dir(staged: Path, dest: Path) -> None:
    """Put ``staged`` at ``dest``; an existing ``dest`` (an OCI layout or empty) is replaced."""
    if dest.exists():
        _check_replaceable(dest)
        old = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.old-"))
        os.rename(dest, old / "x")
        os.rename(staged, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staged, dest)


def _check_replaceable(dest: Path) -> None:
    if dest.exists() and (not dest.is_dir() or (any(dest.iterdir()) and not (dest / "oci-layout").is_file())):
        raise KilnError(f"{dest}: exists and is not an OCI layout; refusing to replace it")


def _place(source: Path, target: Path) -> None:
    """Hard-link a blob when on the same filesystem, copy otherwise."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


# -- OCI layout ------------------------------------------------------------------------------


def write_oci_layout(model: ImageModel, blobs: BlobStore, dest: Path, tag: str) -> Path:
    return stage_oci_layout(model, blobs, dest, tag).commit()


def stage_oci_layout(model: ImageModel, blobs: BlobStore, dest: Path, tag: str) -> Staged:
    """A complete OCI image layout for ``dest``: every blob, ``index.json`` naming ``tag``."""
    dest = dest.resolve()
    _check_replaceable(dest)
    manifest = model.manifest()
    staged = _stage_dir(dest)
    try:
        blob_dir = staged / "blobs" / "sha256"
        blob_dir.mkdir(parents=True)
        for descriptor in model.blobs():
            target = blob_dir / descriptor.digest.split(":", 1)[1]
            if not target.exists():
                _place(blobs.path(descriptor), target)
        (blob_dir / manifest.digest.split(":", 1)[1]).write_bytes(manifest.data)
        (staged / "oci-layout").write_bytes(canonical_json({"imageLayoutVersion": "1.0.0"}))
        entry = Descriptor(manifest.media_type, manifest.digest, len(manifest.data), annotations={REF_NAME: tag})
        index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [entry.to_json()]}
        (staged / "index.json").write_bytes(canonical_json(index))
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return Staged(staged, dest, is_dir=True)


# -- docker-archive --------------------------------------------------------------------------


def write_docker_archive(model: ImageModel, blobs: BlobStore, dest: Path, repo_tags: list[str]) -> Path:
    return stage_docker_archive(model, blobs, dest, repo_tags).commit()


def stage_docker_archive(model: ImageModel, blobs: BlobStore, dest: Path, repo_tags: list[str]) -> Staged:
    """A ``docker save``-style tarball (``manifest.json``, config, gzip layers as they are)."""
    dest = dest.resolve()
    if dest.is_dir():
        raise KilnError(f"{dest}: is a directory; --docker-archive wants a file path")
    config = model.config_descriptor()
    config_name = config.digest.split(":", 1)[1] + ".json"
    layer_names = [layer.digest.split(":", 1)[1] + ".tar.gz" for layer in model.layers]
    index = [{"Config": config_name, "RepoTags": list(repo_tags), "Layers": layer_names}]
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.tmp-")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            _tar_bytes(tar, config_name, model.config_bytes())
            written = set()
            for name, layer in zip(layer_names, model.layers, strict=True):
                if name not in written:
                    _tar_file(tar, name, blobs.path(layer))
                    written.add(name)
            _tar_bytes(tar, "manifest.json", json.dumps(index, separators=(",", ":")).encode())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return Staged(tmp, dest, is_dir=False)


def _info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, LAYER_MTIME, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _tar_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    tar.addfile(_info(name, len(data)), io.BytesIO(data))


def _tar_file(tar: tarfile.TarFile, name: str, path: Path) -> None:
    with path.open("rb") as handle:
        tar.addfile(_info(name, path.stat().st_size), handle)


# -- registry --------------------------------------------------------------------------------


@dataclass
class PushReport:
    repository: str
    digest: str
    tags: list[str]
    uploaded: list[str] = field(default_factory=list)
    mounted: list[str] = field(default_factory=list)
    present: list[str] = field(default_factory=list)
    bytes_uploaded: int = 0


def push_image(model: ImageModel, blobs: BlobStore, client: RegistryClient, repository: str,
               tags: list[str], mount_from: str | None = None) -> PushReport:
    """Push every blob, then the manifest once per tag (byte-exact); returns the digest.

    For each blob: already in the target repository -> nothing; a base blob and ``mount_from``
    names a repository on the same registry -> cross-repo mount; otherwise (or when the mount
    is refused) an upload from the local file.
    """
    if not tags:
        raise KilnError(f"{client.name}/{repository}: nothing to push, no tag given")
    manifest = model.manifest()
    report = PushReport(repository, manifest.digest, list(tags))
    descriptors = model.blobs()
    with ui.transfer_progress() as progress:
        task = progress.add_task(f"push {repository}", total=sum(d.size for d in descriptors))
        for descriptor in descriptors:
            digest = descriptor.digest
            if client.blob_exists(repository, digest):
                report.present.append(digest)
            elif mount_from and not blobs.is_new(digest) and client.mount_blob(repository, digest, mount_from):
                report.mounted.append(digest)
            else:
                path = blobs.path(descriptor)
                chunk = _CHUNKED_ABOVE if descriptor.size > _CHUNKED_ABOVE else None
                client.upload_blob(repository, digest, path, chunk_size=chunk)
                report.uploaded.append(digest)
                report.bytes_uploaded += descriptor.size
            progress.advance(task, descriptor.size)
        # Every blob is now confirmed (HEAD 200, mount 201 or upload 201): tags may name it.
        pause_point("push")
        for tag in tags:
            client.put_manifest(repository, tag, manifest.data, manifest.media_type)
    report.bytes_uploaded += len(manifest.data) * len(tags)
    return report
