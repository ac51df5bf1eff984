"""Where a pulled image differs from its re-derived self: annotation, layer and file, config.

Public API:
    describe_difference(pulled, rebuilt, client, repo, workdir) -> str   one line
    tar_difference(pulled_tar, rebuilt_tar) -> str | None                the first differing entry

Layers are compared by position; for the first that differs, the pulled blob is fetched
(verified, size-bounded) and both tars are read entry by entry: a file's name, type, mode and
content hash are what count (the tars kiln writes fix owner and time). A pulled layer may be
gzip, zstd (an image recompressed on its way, ``skopeo copy --dest-compress-format zstd``) or
plain tar, told apart by its first bytes.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

from kiln.oci.manifest import Manifest
from kiln.oci.registry import RegistryClient
from kiln.source.layerstream import Unzstd

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

_LAYER_MAX = 1 << 30  # a kiln layer is source files and kernels; a pulled one larger than this is not compared


def _entries(path: Path) -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    with path.open("rb") as raw:
        zstd = raw.read(4) == _ZSTD_MAGIC
        raw.seek(0)
        with (tarfile.open(fileobj=Unzstd(raw), mode="r|") if zstd else tarfile.open(fileobj=raw, mode="r:*")) as tar:
            for member in tar:
                content = hashlib.sha256(tar.extractfile(member).read()).hexdigest() if member.isfile() else ""
                out[member.name.lstrip("./")] = (member.type, member.mode, member.linkname, content)
    return out


def tar_difference(pulled: Path, rebuilt: Path) -> str | None:
    theirs, ours = _entries(pulled), _entries(rebuilt)
    for name in sorted(set(theirs) | set(ours)):
        if name not in ours:
            return f"file /{name} is only in the pulled layer"
        if name not in theirs:
            return f"file /{name} is missing from the pulled layer"
        if theirs[name] != ours[name]:
            what = "content" if theirs[name][3] != ours[name][3] else "type, mode or link"
            return f"file /{name} differs ({what})"
    return None


def describe_difference(pulled: Manifest, rebuilt, client: RegistryClient, repo: str, workdir: Path) -> str:
    """The first difference between ``pulled`` and the re-derived ``BuiltImage``, as one line."""
    digest = rebuilt.manifest.digest
    head = f"differs from the re-derived image {digest}"
    theirs = pulled.json.get("annotations") or {}
    ours = rebuilt.model.annotations
    for key in sorted(set(theirs) | set(ours)):
        if theirs.get(key) != ours.get(key):
            return f"{head}: manifest annotation {key} is {theirs.get(key)!r}, re-derived {ours.get(key)!r}"
    pulled_layers, our_layers = pulled.layers, list(rebuilt.model.layers)
    base_count = len(rebuilt.prepared.base_model.layers)
    for index in range(max(len(pulled_layers), len(our_layers))):
        if index >= len(pulled_layers) or index >= len(our_layers):
            return f"{head}: {len(pulled_layers)} layers pulled, {len(our_layers)} re-derived"
        layer, ours_layer = pulled_layers[index], our_layers[index]
        if layer.digest == ours_layer.digest:
            continue
        where = f"{head}: layer {index} ({layer.digest})"
        if index < base_count:
            return f"{where} is not the recorded base's layer {ours_layer.digest}"
        if layer.size > _LAYER_MAX:
            return f"{where} differs ({layer.size} bytes, not compared file by file)"
        target = workdir / f"pulled-{index}"
        with client.open_blob(repo, layer.digest, layer.size) as reader, target.open("wb") as out:
            while chunk := reader.read(1 << 20):
                out.write(chunk)
        mine = rebuilt.blobs.path(ours_layer)
        found = tar_difference(target, mine)
        return f"{where}: {found or 'same files, different bytes (compression or tar headers)'}"
    config = client_config(client, repo, pulled)
    ours_config = rebuilt.model.config
    for key in sorted(set(config) | set(ours_config)):
        if config.get(key) != ours_config.get(key):
            return f"{head}: config field {key} differs"
    return f"{head}: the manifests differ outside annotations, layers and config"


def client_config(client: RegistryClient, repo: str, manifest: Manifest) -> dict:
    descriptor = manifest.config
    with client.open_blob(repo, descriptor.digest, descriptor.size) as reader:
        data = reader.read()
    try:
        value = json.loads(data)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
