"""``build --docker-archive FILE``: a ``docker save``-style tarball, for ``podman load``.

Public API:
    ArchivePublisher(path, repo_tags, force=False)

The tarball holds ``manifest.json``, the config and the layers as they are (no
recompression: the digests stay the registry's): gzip ones named ``<hex>.tar.gz``, a zstd
base's ``<hex>.tar.zst`` (``docker load`` and ``podman load`` tell them apart by their bytes).
An existing file is refused unless ``--force``, before any work; a file that is not a tar
archive is never replaced.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Sequence
from pathlib import Path

from kiln.errors import KilnError
from kiln.oci.layer import LAYER_MTIME
from kiln.oci.mediatypes import tar_mode
from kiln.publish import Input, Publisher
from kiln.staging import Staged, stage_file


class ArchivePublisher(Publisher):
    kind = "docker-archive"
    option = "--docker-archive"

    def __init__(self, path: Path, repo_tags: list[str], force: bool = False):
        self.path = path
        self.repo_tags = list(repo_tags)
        self.force = force

    def check(self, inputs: Sequence[Input] = ()) -> None:
        super().check(inputs)
        if not self.path.exists():
            return
        if not self.force:
            raise KilnError(f"--docker-archive {self.path}: already exists (use --force to replace it)")
        if not tarfile.is_tarfile(self.path):
            raise KilnError(f"--docker-archive {self.path}: exists and is not a tar archive; refusing to replace it "
                            "(--force replaces an earlier archive only)")

    def stage(self, image) -> Staged:
        model, blobs = image.model, image.blobs
        config_name = model.config_descriptor().digest.split(":", 1)[1] + ".json"
        layer_names = [layer.digest.split(":", 1)[1] + _suffix(layer.media_type) for layer in model.layers]
        index = [{"Config": config_name, "RepoTags": self.repo_tags, "Layers": layer_names}]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = stage_file(self.path)
        try:
            with open(tmp, "wb") as raw, tarfile.open(fileobj=raw, mode="w|", format=tarfile.PAX_FORMAT) as tar:
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
        return Staged(tmp, self.path)

    def where(self, image) -> str:
        return f"docker-archive:{self.path}"


def _suffix(media_type: str) -> str:
    return ".tar.zst" if tar_mode(media_type) == "r|zst" else ".tar.gz"


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
