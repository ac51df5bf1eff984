"""``build --oci DIR``: the image added to an OCI image layout, as skopeo and crane add to one.

Public API:
    LayoutPublisher(path, ref_name)
    layout_index(path) -> dict        a layout's ``index.json`` (validated)

A layout is shared: it may hold other images (a per-SM matrix written into one directory,
images copied in with skopeo). Writing adds this image's manifest to ``index.json``, replacing
only an entry with the same ``org.opencontainers.image.ref.name``, and adds the blobs it lacks;
every other entry and every blob stay. Commits take an exclusive lock on the layout's parent
directory, so concurrent builds writing one layout both land. A missing or empty directory
becomes a new layout; anything else that is not a layout is refused before any work.

Staging writes the complete layout beside the destination (blobs hard-linked where possible);
the commit moves it into place (new layout) or moves its missing blobs into the existing one
and rewrites ``index.json`` atomically. Rolling back restores the previous index entry.

The image's attestations (SBOM, provenance) join the layout as artifact manifests listed in
``index.json`` with their ``artifactType`` and an ``io.kiln.subject`` annotation naming the
image's manifest digest (each artifact's own ``subject`` says the same).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kiln.attest.referrers import SUBJECT_ANNOTATION
from kiln.errors import KilnError
from kiln.labels import REF_NAME
from kiln.oci.manifest import Descriptor
from kiln.oci.mediatypes import OCI_INDEX
from kiln.oci.mutate import canonical_json
from kiln.publish import Publisher
from kiln.staging import Staged, stage_dir, umask, write_atomic

LAYOUT_MARKER = "oci-layout"


def is_layout(path: Path) -> bool:
    return (path / LAYOUT_MARKER).is_file() and (path / "index.json").is_file()


def layout_index(path: Path) -> dict:
    try:
        index = json.loads((path / "index.json").read_text())
    except (OSError, ValueError) as err:
        raise KilnError(f"{path}/index.json: not a readable OCI index ({err})") from None
    if not isinstance(index, dict) or not isinstance(index.get("manifests", []), list):
        raise KilnError(f"{path}/index.json: not an OCI image index")
    return index


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _place(source: Path, target: Path) -> None:
    """Hard-link a blob when on the same filesystem and of the mode the umask gives new files
    (a link shares the cached file's mode); copy otherwise (a copy gets the umask's mode)."""
    if stat.S_IMODE(source.stat().st_mode) == 0o666 & ~umask():
        try:
            os.link(source, target)
            return
        except OSError:
            pass
    shutil.copyfile(source, target)


class LayoutPublisher(Publisher):
    kind = "oci"
    option = "--oci"
    directory = True

    def __init__(self, path: Path, ref_name: str):
        self.path = path
        self.ref_name = ref_name

    def check(self) -> None:
        super().check()
        dest = self.path
        if dest.is_dir() and any(dest.iterdir()) and not is_layout(dest):
            raise KilnError(f"--oci {dest}: exists and is neither empty nor an OCI layout; refusing to write there")
        if is_layout(dest):
            layout_index(dest)

    def stage(self, image) -> Staged:
        dest = self.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        staged = stage_dir(dest)
        try:
            blob_dir = staged / "blobs" / "sha256"
            blob_dir.mkdir(parents=True)
            model, manifest = image.model, image.manifest
            for descriptor in model.blobs():
                target = blob_dir / descriptor.digest.split(":", 1)[1]
                if not target.exists():
                    _place(image.blobs.path(descriptor), target)
            (blob_dir / manifest.digest.split(":", 1)[1]).write_bytes(manifest.data)
            extra = []  # the attestations: artifacts beside the image, each naming it as subject
            for artifact in image.attestations:
                for digest, data in {**artifact.blobs, artifact.manifest.digest: artifact.manifest.data}.items():
                    (blob_dir / digest.split(":", 1)[1]).write_bytes(data)
                found = artifact.entry()
                found["annotations"] = {**found.get("annotations", {}), SUBJECT_ANNOTATION: manifest.digest}
                extra.append(found)
            (staged / LAYOUT_MARKER).write_bytes(canonical_json({"imageLayoutVersion": "1.0.0"}))
            entry = Descriptor(manifest.media_type, manifest.digest, len(manifest.data),
                               annotations={REF_NAME: self.ref_name}).to_json()
            entries = [entry, *extra]
            (staged / "index.json").write_bytes(canonical_json(
                {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}))
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        return Staged(staged, dest, on_commit=lambda: self._commit(staged, dest, entries))

    def _commit(self, staged: Path, dest: Path, entries: list[dict]) -> Callable[[], None]:
        with _locked(dest.parent):
            if not dest.exists() or (dest.is_dir() and not any(dest.iterdir())):
                if dest.exists():
                    dest.rmdir()
                os.rename(staged, dest)
                return lambda: self._undo_new(dest, entries)
            if not is_layout(dest):
                raise KilnError(f"--oci {dest}: is no longer an OCI layout; not writing there")
            for blob in sorted((staged / "blobs" / "sha256").iterdir()):
                target = dest / "blobs" / "sha256" / blob.name
                if not target.exists():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.rename(blob, target)
            index = layout_index(dest)
            manifests = index.get("manifests", [])
            previous = [m for m in manifests if (m.get("annotations") or {}).get(REF_NAME) == self.ref_name]
            added = [e for e in entries if e not in manifests or e in previous]
            index["manifests"] = [m for m in manifests if m not in previous and m not in added] + added
            write_atomic(dest / "index.json", canonical_json(index))
            return lambda: self._undo_merge(dest, added, previous)

    def _undo_new(self, dest: Path, entries: list[dict]) -> None:
        """Remove the layout this build created, unless another build has added to it since."""
        with _locked(dest.parent):
            if not is_layout(dest):
                return
            others = [m for m in layout_index(dest).get("manifests", []) if m not in entries]
            if not others:
                shutil.rmtree(dest, ignore_errors=True)
                return
        self._undo_merge(dest, entries, [])

    def _undo_merge(self, dest: Path, entries: list[dict], previous: list[dict]) -> None:
        """The index as it was for this name; blobs added stay (another entry may use them)."""
        with _locked(dest.parent):
            index = layout_index(dest)
            index["manifests"] = [m for m in index.get("manifests", []) if m not in entries] + previous
            write_atomic(dest / "index.json", canonical_json(index))

    def where(self, image) -> str:
        return f"oci:{self.path}:{self.ref_name}"
