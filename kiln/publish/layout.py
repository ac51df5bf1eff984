"""``build --oci DIR``: the image added to an OCI image layout, as skopeo and crane add to one.

Public API:
    LayoutPublisher(path, ref_name, reporter=SILENT)
    layout_index(path, option="--oci") -> dict   a layout's ``index.json`` (validated)
    check_layout(path, option="--oci")           an existing layout kiln may add to (marker, index, blobs)

A layout is shared: it may hold other images (a per-SM matrix written into one directory,
images copied in with skopeo). Writing adds this image's manifest to ``index.json``, replacing
only an entry with the same ``org.opencontainers.image.ref.name``, and adds the blobs it lacks;
every other entry and every blob stay. Commits take an exclusive lock on the layout's parent
directory, so concurrent builds writing one layout both land. A missing or empty directory
becomes a new layout; anything else that is not a layout, or a layout kiln cannot add to (an
index entry without a valid digest, a ``blobs`` that is a file), is refused before any work.

Staging writes the complete layout beside the destination (blobs hard-linked where possible);
the commit moves it into place (new layout) or moves its missing blobs into the existing one
and rewrites ``index.json`` atomically. Rolling back restores the previous index entry.

The image's attestations (SBOM, provenance) join the layout as artifact manifests listed in
``index.json`` with their ``artifactType`` and an ``io.kiln.subject`` annotation naming the
image's manifest digest (each artifact's own ``subject`` says the same). When this image
replaces another under its name, the replaced image's artifacts leave ``index.json`` with it
(under the same lock, said in one warning): a layout never lists an SBOM or provenance of an image
it no longer lists (of a replaced index, its platform manifests' artifacts: an index's SBOMs
and provenances name its platform images). Those still naming an image another entry lists stay
(a platform manifest the new index keeps, too); the blobs stay too (another entry may use
them), and a rollback puts the index entries back.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import stat
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kiln.attest.referrers import SUBJECT_ANNOTATION
from kiln.errors import KilnError, writing
from kiln.image.image import parts
from kiln.labels import REF_NAME
from kiln.oci.limits import Budget
from kiln.oci.manifest import Descriptor
from kiln.oci.mediatypes import INDEX_TYPES, OCI_INDEX
from kiln.oci.mutate import canonical_json
from kiln.publish import Input, Publisher
from kiln.publish.destinations import LAYOUT_MARKER
from kiln.report import SILENT, Reporter
from kiln.staging import Staged, stage_dir, umask, write_atomic

# The OCI digest grammar (image-spec descriptor.md), and the algorithms a reader can verify.
_DIGEST = re.compile(r"[a-z0-9]+(?:[+._-][a-z0-9]+)*:[a-zA-Z0-9=_-]+")
_ENCODED = {"sha256": re.compile(r"[a-f0-9]{64}"), "sha512": re.compile(r"[a-f0-9]{128}")}


def is_layout(path: Path) -> bool:
    return (path / LAYOUT_MARKER).is_file() and (path / "index.json").is_file()


def layout_index(path: Path, option: str = "--oci") -> dict:
    """A layout's ``index.json``, checked as a reader of the layout (skopeo, crane) would need it:
    an image index of schemaVersion 2 whose every entry is a descriptor (mediaType, a digest
    of a known algorithm, a size); refused naming the file and the field otherwise."""
    where = f"{option} {path}: index.json"
    try:
        index = json.loads((path / "index.json").read_text())
    except (OSError, ValueError) as err:
        raise KilnError(f"{where}: not a readable OCI index ({err})") from None
    if not isinstance(index, dict):
        raise KilnError(f"{where}: not an OCI image index (a JSON object)")
    version = index.get("schemaVersion")
    if type(version) is not int or version != 2:
        raise KilnError(f"{where}: schemaVersion is {version!r}; an OCI image index has schemaVersion 2")
    if "mediaType" in index and index["mediaType"] != OCI_INDEX:
        raise KilnError(f"{where}: mediaType is {index['mediaType']!r}, not {OCI_INDEX}")
    manifests = index.get("manifests")
    if not isinstance(manifests, list):
        raise KilnError(f"{where}: manifests is {_shown(manifests)}, not a list of descriptors")
    for i, entry in enumerate(manifests):
        problem = _descriptor_problem(entry)
        if problem:
            raise KilnError(f"{where}: manifests[{i}]{problem}")
    return index


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _descriptor_problem(entry) -> str | None:
    if not isinstance(entry, dict):
        return f" is {_shown(entry)}, not a descriptor (a JSON object)"
    media_type, digest, size = entry.get("mediaType"), entry.get("digest"), entry.get("size")
    if not isinstance(media_type, str) or not media_type:
        return f".mediaType is {_shown(media_type)}, not a media type"
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        return f".digest is {_shown(digest)}, not a digest (algorithm:hex, e.g. sha256:<64 hex>)"
    algorithm, encoded = digest.split(":", 1)
    if algorithm not in _ENCODED or not _ENCODED[algorithm].fullmatch(encoded):
        return f".digest {_shown(digest)}: not a sha256 or sha512 digest a reader can verify"
    if type(size) is not int or size < 0:
        return f".size is {_shown(size)}, not a byte count"
    annotations = entry.get("annotations", {})
    if not isinstance(annotations, dict) or not all(isinstance(v, str) for v in annotations.values()):
        return f".annotations is {_shown(annotations)}, not a map of strings"
    return None


def check_layout(path: Path, option: str = "--oci") -> None:
    """An existing layout kiln may add to: its marker, its index and its blob directories."""
    try:
        marker = json.loads((path / LAYOUT_MARKER).read_text())
    except (OSError, ValueError) as err:
        raise KilnError(f"{option} {path}: {LAYOUT_MARKER}: not readable JSON ({err})") from None
    version = marker.get("imageLayoutVersion") if isinstance(marker, dict) else None
    if version != "1.0.0":
        raise KilnError(f"{option} {path}: {LAYOUT_MARKER}: imageLayoutVersion is {_shown(version)}; kiln "
                        "writes into layouts of version 1.0.0")
    for blobs in (path / "blobs", path / "blobs" / "sha256"):
        if blobs.exists() and not blobs.is_dir():
            raise KilnError(f"{option} {path}: {blobs.relative_to(path)} is not a directory; not an OCI layout "
                            "kiln can add blobs to")
    layout_index(path, option)


@contextmanager
def _locked(directory: Path, budget: Budget | None = None) -> Iterator[None]:
    """The layout's lock; with ``budget``, waited for only until its deadline (a build that
    hangs while holding it must not hang this one past its ``--deadline``)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if budget is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        else:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    budget.check_deadline(f"--oci: waiting for the lock on {directory} (another build writes there)")
                    budget.sleep(0.1)
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


def _reached(layout: Path, entries: list[dict]) -> set[str]:
    """The image manifests ``entries`` name (not their artifacts): each, and each platform
    manifest of an index among them (read from the layout's blob; none when it is unreadable)."""
    reached = set()
    for entry in entries:
        if SUBJECT_ANNOTATION in (entry.get("annotations") or {}):
            continue
        reached.add(entry.get("digest"))
        if entry.get("mediaType") not in INDEX_TYPES:
            continue
        algorithm, _, encoded = str(entry.get("digest")).partition(":")
        try:
            children = json.loads((layout / "blobs" / algorithm / encoded).read_bytes()).get("manifests") or []
        except (OSError, ValueError, AttributeError):
            continue
        reached |= {child.get("digest") for child in children if isinstance(child, dict)}
    return reached


class LayoutPublisher(Publisher):
    kind = "oci"
    option = "--oci"
    directory = True

    def __init__(self, path: Path, ref_name: str, reporter: Reporter = SILENT):
        self.path = path
        self.ref_name = ref_name
        self.reporter = reporter

    def check(self, inputs: Sequence[Input] = ()) -> None:
        super().check(inputs)
        dest = self.path
        if dest.is_dir() and any(dest.iterdir()) and not is_layout(dest):
            raise KilnError(f"--oci {dest}: exists and is neither empty nor an OCI layout; refusing to write there")
        if is_layout(dest):
            check_layout(dest)

    def stage(self, image) -> Staged:
        dest = self.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        staged = stage_dir(dest)
        try:
            blob_dir = staged / "blobs" / "sha256"
            blob_dir.mkdir(parents=True)
            needed = len(image.manifest.data) + sum(
                sum(d.size for d in part.model.blobs()) + len(part.manifest.data) + sum(
                    len(data) for artifact in part.attestations
                    for data in (*artifact.blobs.values(), artifact.manifest.data)) for part in parts(image))
            entries = self._write(image, staged, blob_dir, lambda: writing(dest, needed, f"--oci {dest}"))
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        return Staged(staged, dest, on_commit=lambda: self._commit(staged, dest, entries))

    def _write(self, image, staged: Path, blob_dir: Path, layout_write) -> list[dict]:
        """The layout's blobs, marker and index written into ``staged``; the index entries.

        Every write into the layout is inside ``layout_write()``: a full disk there names the
        layout and the bytes it needs (one elsewhere, e.g. kiln's layer materialised in the work
        directory, names its own path)."""
        for part in parts(image):  # an index's platform images, or the one
            for descriptor in part.model.blobs():
                target = blob_dir / descriptor.digest.split(":", 1)[1]
                if not target.exists():
                    source = part.blobs.path(descriptor)
                    with layout_write():
                        _place(source, target)
        with layout_write():
            return self._write_rest(image, staged, blob_dir)

    def _write_rest(self, image, staged: Path, blob_dir: Path) -> list[dict]:
        manifest = image.manifest  # the index of an index build
        (blob_dir / manifest.digest.split(":", 1)[1]).write_bytes(manifest.data)
        extra = []  # the attestations: artifacts beside the image, each naming its platform's image
        for part in parts(image):
            (blob_dir / part.manifest.digest.split(":", 1)[1]).write_bytes(part.manifest.data)
            for artifact in part.attestations:
                for digest, data in {**artifact.blobs, artifact.manifest.digest: artifact.manifest.data}.items():
                    (blob_dir / digest.split(":", 1)[1]).write_bytes(data)
                found = artifact.entry()
                found["annotations"] = {**found.get("annotations", {}), SUBJECT_ANNOTATION: part.manifest.digest}
                extra.append(found)
        (staged / LAYOUT_MARKER).write_bytes(canonical_json({"imageLayoutVersion": "1.0.0"}))
        entry = Descriptor(manifest.media_type, manifest.digest, len(manifest.data),
                           annotations={REF_NAME: self.ref_name}).to_json()
        entries = [entry, *extra]
        (staged / "index.json").write_bytes(canonical_json(
            {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}))
        return entries

    def _commit(self, staged: Path, dest: Path, entries: list[dict]) -> Callable[[], None]:
        with _locked(dest.parent, self.budget):
            if not dest.exists() or (dest.is_dir() and not any(dest.iterdir())):
                if dest.exists():
                    dest.rmdir()
                os.rename(staged, dest)
                return lambda: self._undo_new(dest, entries)
            if not is_layout(dest):
                raise KilnError(f"--oci {dest}: is no longer an OCI layout; not writing there")
            check_layout(dest)  # as it is now, under the lock: another writer may have changed it
            for blob in sorted((staged / "blobs" / "sha256").iterdir()):
                target = dest / "blobs" / "sha256" / blob.name
                if not target.exists():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.rename(blob, target)
            index = layout_index(dest)
            manifests = index.get("manifests", [])
            previous = [m for m in manifests if (m.get("annotations") or {}).get(REF_NAME) == self.ref_name]
            added = [e for e in entries if e not in manifests or e in previous]
            kept = [m for m in manifests if m not in previous and m not in added]
            orphans, said = self._orphans(dest, previous, kept, entries)
            index["manifests"] = [m for m in kept if m not in orphans] + added
            write_atomic(dest / "index.json", canonical_json(index))
            if said:
                self.reporter.warn(said)
            return lambda: self._undo_merge(dest, added, previous + orphans)

    def _orphans(self, dest: Path, previous: list[dict], kept: list[dict],
                 entries: list[dict]) -> tuple[list[dict], str]:
        """The artifacts of the images this name no longer lists (and no other entry does): of a
        replaced index, those of its platform manifests; and the one line that says so ("" when
        no image was replaced)."""
        listed = _reached(dest, [*kept, *entries])
        replaced = [m.get("digest") for m in previous if m.get("digest") not in listed]
        if not replaced:
            return [], ""
        gone = _reached(dest, previous) - listed
        orphans = [m for m in kept if (m.get("annotations") or {}).get(SUBJECT_ANNOTATION) in gone]
        types = ", ".join(sorted({str(m.get("artifactType", "?")) for m in orphans})) or "none"
        return orphans, (f"--oci {self.path}: {self.ref_name} replaced {', '.join(replaced)} with "
                         f"{entries[0]['digest']}; removed its {len(orphans)} referrer(s) from index.json ({types})")

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
