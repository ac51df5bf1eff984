"""Hostile base images built by hand: layers with Python's ``tarfile``, configs and manifests as
JSON, uploaded with plain HTTP (POST/PUT) straight at the distribution API -- never with kiln's
own layer or manifest code -- on top of the fixture base's real blobs.

    Images(registry)              the fixture base (``vllm/vllm-openai:v0.20.1``) as JSON, and
        .with_top_layer(tag, blob, diff_id) / .image(tag, config, layers) / .index(tag, entries)
        .with_layers_at(tag, [(position, blob, diff_id)])   layers inserted below/among the base's
    tar_layer(entries) -> (blob, raw)    entry(name, kind, link, data, size)    sha(data)
    truncated_layer(name, declared)      one header declaring bytes that never follow
    zeros_layer(name, size, compression="gzip") -> (blob, diff_id)   a tar of one file of ``size``
        zero bytes, gzip in members of 64 MiB (valid gzip, a few KiB per GiB) or zstd in frames
        of 64 MiB (``compression="zstd"``, a few hundred bytes per GiB): a decompression bomb,
        built in moments whatever its size
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass

import requests

try:
    from compression import zstd
except ImportError:
    from backports import zstd

from tests.support.registry import REPO, VLLM_VERSION

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class HandPusher:
    """Blob uploads and manifest PUTs with ``requests``, straight at the distribution API."""

    def __init__(self, registry):
        self.url = registry.url

    def blob(self, data: bytes, repo: str = REPO) -> dict:
        start = requests.post(f"{self.url}/v2/{repo}/blobs/uploads/", timeout=30)
        assert start.status_code == 202, start.text
        location = start.headers["Location"]
        location = location if location.startswith("http") else self.url + location
        done = requests.put(location, params={"digest": sha(data)}, data=data, timeout=60,
                            headers={"Content-Type": "application/octet-stream"})
        assert done.status_code == 201, done.text
        return {"digest": sha(data), "size": len(data)}

    def manifest(self, tag: str, body: dict, media_type: str = OCI_MANIFEST, repo: str = REPO) -> str:
        data = json.dumps(body).encode()
        resp = requests.put(f"{self.url}/v2/{repo}/manifests/{tag}", data=data, timeout=30,
                            headers={"Content-Type": media_type})
        assert resp.status_code == 201, resp.text
        return sha(data)

    def get(self, kind: str, ref: str, repo: str = REPO) -> bytes:
        resp = requests.get(f"{self.url}/v2/{repo}/{kind}/{ref}", timeout=30,
                            headers={"Accept": f"{OCI_MANIFEST}, {OCI_INDEX}"})
        assert resp.status_code == 200, resp.text
        return resp.content


@dataclass
class Base:
    """The fixture base (``vllm/vllm-openai:v0.20.1``) as JSON, to derive hostile images from."""

    manifest: dict
    config: dict


def tar_layer(entries: list[tarfile.TarInfo | tuple[tarfile.TarInfo, bytes]], gz: bool = True) -> tuple[bytes, bytes]:
    """(blob, uncompressed tar) from TarInfos written verbatim (absolute names, links, devices)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for item in entries:
            info, data = item if isinstance(item, tuple) else (item, None)
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    raw = buffer.getvalue()
    return (gzip.compress(raw, mtime=0) if gz else raw), raw


def entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", data: bytes | None = None, size: int = 0):
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o644
    if kind == tarfile.DIRTYPE:
        info.mode = 0o755
    if data is None and kind == tarfile.REGTYPE:
        data = b"# hostile\n"
    if data is None:
        info.size = size
        return info
    return info, data


def truncated_layer(name: str, declared: int) -> tuple[bytes, bytes]:
    """A layer whose one header declares ``declared`` bytes that never follow (a "huge" entry)."""
    info = tarfile.TarInfo(name)
    info.size = declared
    raw = info.tobuf(tarfile.PAX_FORMAT)
    return gzip.compress(raw, mtime=0), raw


class Images:
    def __init__(self, registry):
        self.push = HandPusher(registry)
        top = json.loads(self.push.get("manifests", f"v{VLLM_VERSION}"))
        self.base = Base(top, json.loads(self.push.get("blobs", top["config"]["digest"])))

    def with_top_layer(self, tag: str, blob: bytes, diff_id: str, media_type: str = OCI_LAYER) -> tuple[str, str]:
        """The base plus one layer on top; returns (manifest digest, layer digest)."""
        layer = {"mediaType": media_type, **self.push.blob(blob)}
        config = json.loads(json.dumps(self.base.config))
        config["rootfs"]["diff_ids"].append(diff_id)
        config.setdefault("history", []).append({"created_by": f"hostile {tag}"})
        return self.image(tag, config, [*self.base.manifest["layers"], layer]), layer["digest"]

    def image(self, tag: str, config: dict, layers: list[dict], config_type: str = OCI_CONFIG,
              config_size_delta: int = 0) -> str:
        config_desc = {"mediaType": config_type, **self.push.blob(json.dumps(config).encode())}
        config_desc["size"] += config_size_delta
        body = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": config_desc, "layers": layers}
        return self.push.manifest(tag, body)

    def index(self, tag: str, entries: list[tuple[str, dict, str]]) -> str:
        """An OCI index of (manifest digest, platform, media type) entries."""
        manifests = []
        for digest, platform, media_type in entries:
            size = len(self.push.get("manifests", digest))
            manifests.append({"mediaType": media_type, "digest": digest, "size": size, "platform": platform})
        return self.push.manifest(tag, {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests}, OCI_INDEX)

    def with_layers_at(self, tag: str, inserted: list[tuple[int, bytes, str]]) -> tuple[str, list[str]]:
        """The base with layers inserted at positions (0 = below every base layer); returns
        (manifest digest, the inserted layers' digests)."""
        layers = list(self.base.manifest["layers"])
        config = json.loads(json.dumps(self.base.config))
        diff_ids = config["rootfs"]["diff_ids"]
        digests = []
        for position, blob, diff_id in sorted(inserted, key=lambda item: -item[0]):
            layer = {"mediaType": OCI_LAYER, **self.push.blob(blob)}
            layers.insert(position, layer)
            diff_ids.insert(position, diff_id)
            digests.append(layer["digest"])
        config.pop("history", None)  # history entries pair with layers; none is better than wrong
        return self.image(tag, config, layers), digests


_MEMBER = 64 << 20


def zeros_layer(name: str, size: int, compression: str = "gzip") -> tuple[bytes, str]:
    """(blob, diff_id) of a tar holding one file of ``size`` zeros (``size`` a multiple of
    64 MiB): the zeros are one gzip member (or zstd frame) compressed once and repeated."""
    assert size % _MEMBER == 0
    info = tarfile.TarInfo(name)
    info.size, info.mode = size, 0o644
    header = info.tobuf(tarfile.PAX_FORMAT)
    tail = b"\0" * (2 * 512)  # the data is a whole number of blocks; then the end-of-archive marker
    compress = {"gzip": lambda data: gzip.compress(data, compresslevel=9, mtime=0),
                "zstd": lambda data: zstd.compress(data, 19)}[compression]
    count = size // _MEMBER
    blob = compress(header) + compress(b"\0" * _MEMBER) * count + compress(tail)
    diff = hashlib.sha256(header)
    chunk = b"\0" * _MEMBER
    for _ in range(count):
        diff.update(chunk)
    diff.update(tail)
    return blob, "sha256:" + diff.hexdigest()
