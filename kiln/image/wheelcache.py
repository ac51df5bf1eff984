"""The registry build cache's ``toolchain`` entry: the Triton wheel a kernel compile unpacks.

Public API:
    TOOLCHAIN, ARTIFACT_TYPE, WHEEL_MEDIA_TYPE
    RegistryWheels(sources, keep_dir=None, reporter=SILENT)   what ``toolchain_for`` is given as ``wheels``:
        .fetch(name, sha256, path) -> bool    the wheel from the first ``sources`` entry that verifies
        .keep(name, sha256, path)             keeps a wheel fetched from the index (for ``--cache-to``)
        .uses -> list[dict]                   each entry looked up or kept, for the ``--json`` summary
        .kept -> list[(name, sha256, Path)]
    write_wheel_entry(client, repository, name, sha256, path) -> str  (the entry's manifest digest)

A build whose ``kernels`` entry misses compiles its SM, and on a fresh machine that needs the
Triton toolchain: the wheel pip chooses (``kiln.triton.toolchain``). The index tells its sha256
without the wheel being downloaded (pip's ``--dry-run --report``: PyPI serves each wheel's
metadata apart, and pip 26 reads only that; pip 23.2 still downloads the wheel to choose it), so that sha256 is the entry's key, tagged ``kiln-cache-toolchain-v1-<sha256>``.
The entry's one blob is the wheel itself, so its blob digest is ``sha256:<key>``: reading it
back checks the manifest's layer is exactly that digest and the blob's bytes hash to it (the
registry client's verifying reader), and the record names the same wheel file. The index, not
the entry's writer, says what the wheel must be, so the entry needs no signature (a signed
record is not asked for). An index that gives no sha256 gives no key: no lookup, no entry.
Anything wrong is a miss with a warning, and the wheel is fetched from the index as without
cache. Writers of one key upload the same blob (content-addressed) before the manifest, so
concurrent writers are safe as for the other kinds.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from kiln.errors import KilnError
from kiln.image.cachekeys import entry_tag
from kiln.image.regcache import RECORD_MEDIA_TYPE
from kiln.oci.digest import sha256_digest
from kiln.oci.manifest import Descriptor
from kiln.oci.mediatypes import OCI_MANIFEST
from kiln.oci.registry import RegistryClient
from kiln.report import SILENT, Reporter

TOOLCHAIN = "toolchain"
ARTIFACT_TYPE = "application/vnd.kiln.cache.toolchain.v1"
WHEEL_MEDIA_TYPE = "application/vnd.kiln.cache.wheel.v1+zip"
_RECORD_MAX = 1 << 16
_WHEEL_MAX = 4 << 30


def _record(name: str, sha256: str) -> bytes:
    record = {"kind": TOOLCHAIN, "key": sha256, "wheel": name, "sha256": sha256}
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def write_wheel_entry(client: RegistryClient, repository: str, name: str, sha256: str, path: Path) -> str:
    """Upload the wheel (unless present) and its record, then PUT the entry's manifest under its tag."""
    record = _record(name, sha256)
    record_digest, wheel_digest = sha256_digest(record), f"sha256:{sha256}"
    size = path.stat().st_size
    if not client.blob_exists(repository, wheel_digest):
        client.upload_blob(repository, wheel_digest, path)
    if not client.blob_exists(repository, record_digest):
        client.upload_blob(repository, record_digest, record)
    manifest = {
        "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": RECORD_MEDIA_TYPE, "digest": record_digest, "size": len(record)},
        "layers": [{"mediaType": WHEEL_MEDIA_TYPE, "digest": wheel_digest, "size": size,
                    "annotations": {"org.opencontainers.image.title": name}}],
    }
    data = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    return client.put_manifest(repository, entry_tag(TOOLCHAIN, sha256), data, OCI_MANIFEST)


class RegistryWheels:
    """The toolchain wheels a build reads from its ``--cache-from`` entries and keeps for ``--cache-to``.

    ``sources``: (client, repository) pairs, tried in order; ``keep_dir``: where fetched wheels
    are kept (None: not kept)."""

    def __init__(self, sources: list[tuple[RegistryClient, str]], keep_dir: Path | None = None,
                 reporter: Reporter = SILENT) -> None:
        self.sources, self.keep_dir, self.reporter = sources, keep_dir, reporter
        self.uses: list[dict] = []
        self.kept: list[tuple[str, str, Path]] = []

    def fetch(self, name: str, sha256: str, path: Path) -> bool:
        """Write the wheel ``name`` of ``sha256`` to ``path`` from the first entry that verifies."""
        tag = entry_tag(TOOLCHAIN, sha256)
        use = {"kind": TOOLCHAIN, "key": sha256, "tag": tag, "hit": None}
        if self.sources:
            self.uses.append(use)
        for client, repository in self.sources:
            where = f"{client.endpoint.registry}/{repository}:{tag}"
            try:
                if self._read(client, repository, tag, name, sha256, path, where):
                    use["hit"] = where
                    return True
            except KilnError as err:
                path.unlink(missing_ok=True)
                self.reporter.warn(f"build cache entry {where} refused, fetching the wheel from the index: {err}")
        return False

    def _read(self, client: RegistryClient, repository: str, tag: str, name: str, sha256: str, path: Path,
              where: str) -> bool:
        manifest = client.find_manifest(repository, tag)
        if manifest is None:
            self.reporter.note(f"build cache {client.endpoint.registry}/{repository}: no toolchain entry for {name}")
            return False
        body = manifest.json
        if body.get("artifactType") != ARTIFACT_TYPE:
            raise KilnError(f"not a kiln toolchain cache entry (artifactType {body.get('artifactType')!r})")
        config = Descriptor.from_json(body.get("config"), f"{where} config")
        layers = body.get("layers")
        if config.media_type != RECORD_MEDIA_TYPE or config.size > _RECORD_MAX or not isinstance(layers, list) \
                or len(layers) != 1:
            raise KilnError("it is not one wheel and its kiln cache record")
        wheel = Descriptor.from_json(layers[0], f"{where} layer")
        if wheel.digest != f"sha256:{sha256}" or wheel.size > _WHEEL_MAX:
            raise KilnError(f"its wheel is {wheel.digest}, not the index's sha256:{sha256}")
        chunks = []
        with client.open_blob(repository, config.digest, config.size) as reader:
            while chunk := reader.read(1 << 16):
                chunks.append(chunk)
        if b"".join(chunks) != _record(name, sha256):
            raise KilnError(f"its record is not the one of {name} (sha256 {sha256})")
        with client.open_blob(repository, wheel.digest, wheel.size) as reader, path.open("wb") as out:
            while chunk := reader.read(1 << 20):
                out.write(chunk)
        return True  # the reader checked size and digest as its block exited

    def keep(self, name: str, sha256: str, path: Path) -> None:
        """Move the wheel kiln fetched from the index (before it is deleted) to ``keep_dir``."""
        if self.keep_dir is None or any(k[1] == sha256 for k in self.kept):
            return
        self.keep_dir.mkdir(parents=True, exist_ok=True)
        kept = self.keep_dir / name
        try:
            os.replace(path, kept)
        except OSError:
            shutil.copyfile(path, kept)
        self.kept.append((name, sha256, kept))
        if not any(u["key"] == sha256 for u in self.uses):
            self.uses.append({"kind": TOOLCHAIN, "key": sha256, "tag": entry_tag(TOOLCHAIN, sha256), "hit": None})
