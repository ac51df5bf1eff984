"""A deterministic layer writer: the same entries always give the same tar and the same gzip.

Public API:
    LAYER_MTIME                      the fixed mtime of every entry (an odd value on purpose)
    GZIP_LEVEL                       the fixed deflate level
    LayerBuilder()
        .add_file(path, data, mode=0o644)   data: bytes or a Path to copy from
        .add_whiteout(path)                 hides ``path`` of a lower layer (``.wh.<name>``)
        .paths() -> list[str]               every entry the layer will hold, sorted
        .write(directory) -> Layer          streams tar -> gzip into ``directory``
    Layer(path, digest, diff_id, size, uncompressed_size)
    normalise_path(path) -> str          ``/usr/x`` -> ``usr/x``; KilnError for ``..`` or empty
    diff_id_of(path) -> str              sha256 of a gzip layer's uncompressed bytes (for checks)
    LayerContents(files, removals, created_by)   what one layer puts over the base, however written
    write_layer(contents, workdir) -> Layer      ``LayerContents`` as a deterministic gzip layer

The recipe (see shared research, "Determinism rules for layer tarballs"): entries sorted by
path with every parent directory present explicitly, one fixed integer mtime, uid/gid 0 with
empty user and group names, modes 0644/0755, PAX format, no xattrs, and
``GzipFile(filename="", mtime=0)`` at a fixed level. The mtime is deliberately *not* the
original files' mtime nor a common epoch (0, 1980-01-01, 2024-01-01): a patched module with
the same size and mtime as the one it replaces would keep running the stale ``.pyc``.

The layer is streamed to a temporary file while both digests are computed; nothing the size
of a layer is held in memory.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import posixpath
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import KilnError, is_no_space, writing
from kiln.staging import streamed_file

LAYER_MTIME = 1_000_000_000  # 2001-09-09T01:46:40Z
GZIP_LEVEL = 6
WHITEOUT_PREFIX = ".wh."
OPAQUE = ".wh..wh..opq"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Layer:
    path: Path  # the gzip blob on disk
    digest: str  # sha256 of the gzip blob (the layer's descriptor digest)
    diff_id: str  # sha256 of the uncompressed tar (the config's rootfs.diff_ids entry)
    size: int  # bytes of the gzip blob
    uncompressed_size: int


@dataclass(frozen=True)
class _Entry:
    kind: str  # "file" | "dir"
    data: bytes | Path | None = None
    mode: int = 0o644


def normalise_path(path: str) -> str:
    """``/usr/lib/x`` or ``./usr/lib/x`` -> ``usr/lib/x``; refuses ``..`` and empty paths."""
    text = path.replace("\\", "/").lstrip("/")
    while text.startswith("./"):
        text = text[2:]
    norm = posixpath.normpath(text) if text else ""
    if not norm or norm == "." or norm.startswith("..") or "/../" in f"/{norm}/":
        raise KilnError(f"layer entry {path!r}: not a path inside the image")
    return norm


class LayerBuilder:
    """Collects entries, then writes them as one reproducible gzip layer."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def add_file(self, path: str, data: bytes | Path, mode: int = 0o644) -> None:
        if mode not in (0o644, 0o755):
            raise KilnError(f"layer entry {path!r}: mode {oct(mode)} (only 0644 and 0755 are written)")
        self._put(normalise_path(path), _Entry("file", data, mode))

    def add_whiteout(self, path: str) -> None:
        norm = normalise_path(path)
        parent, name = posixpath.split(norm)
        if name.startswith(WHITEOUT_PREFIX):
            raise KilnError(f"layer entry {path!r}: cannot white out a whiteout")
        self._put(posixpath.join(parent, WHITEOUT_PREFIX + name), _Entry("file", b"", 0o644))

    def _put(self, norm: str, entry: _Entry) -> None:
        if norm in self._entries:
            raise KilnError(f"layer entry {norm!r}: added twice")
        parts = norm.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            existing = self._entries.get(parent)
            if existing is not None and existing.kind != "dir":
                raise KilnError(f"layer entry {norm!r}: its parent {parent!r} is a file in this layer")
            self._entries.setdefault(parent, _Entry("dir", None, 0o755))
        self._entries[norm] = entry

    def paths(self) -> list[str]:
        return sorted(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def write(self, directory: Path) -> Layer:
        """Write the layer into ``directory`` (a temp name, renamed to ``<hex>.tar.gz``)."""
        with streamed_file(directory, ".tmp-layer-", ".tar.gz") as out, \
                writing(out.path, None, "kiln's layer"):  # (its size is known only once written)
            blob = _HashingWriter(out.handle)
            with gzip.GzipFile(filename="", mode="wb", compresslevel=GZIP_LEVEL, fileobj=blob, mtime=0) as gz:
                tar_stream = _HashingWriter(gz)
                with tarfile.open(fileobj=tar_stream, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                    for name in self.paths():
                        _add(tar, name, self._entries[name])
            digest = "sha256:" + blob.sha.hexdigest()
            final = out.land(directory / f"{blob.sha.hexdigest()}.tar.gz")
        return Layer(final, digest, "sha256:" + tar_stream.sha.hexdigest(), blob.count, tar_stream.count)


def _add(tar: tarfile.TarFile, name: str, entry: _Entry) -> None:
    info = tarfile.TarInfo(name)
    info.mtime = LAYER_MTIME
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = entry.mode
    if entry.kind == "dir":
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
        return
    info.type = tarfile.REGTYPE
    if isinstance(entry.data, Path):
        try:
            info.size = entry.data.stat().st_size
            with entry.data.open("rb") as handle:
                tar.addfile(info, handle)
        except OSError as err:
            if is_no_space(err):  # the layer's own write filled the disk: not a read error
                raise
            raise KilnError(f"layer entry {name!r}: cannot read {entry.data}: {err.strerror}") from None
        return
    data = entry.data or b""
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


class _HashingWriter:
    """A write-only file object that hashes and counts everything passed on to ``target``."""

    def __init__(self, target) -> None:
        self._target = target
        self.sha = hashlib.sha256()
        self.count = 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.count += len(data)
        self._target.write(data)
        return len(data)

    def flush(self) -> None:
        self._target.flush()


def diff_id_of(path: Path) -> str:
    """sha256 of the uncompressed contents of a gzip layer blob."""
    sha = hashlib.sha256()
    with gzip.open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            sha.update(chunk)
    return "sha256:" + sha.hexdigest()


@dataclass(frozen=True)
class LayerContents:
    """What one layer kiln adds puts over the base, independent of how it is written.

    ``files``: image path (relative, e.g. ``usr/local/lib/.../x.py``) -> bytes, mode 0644.
    ``removals``: image paths of lower-layer files this layer hides (a tar layer writes a
    whiteout for each; a build context deletes them with ``rm -f``, so an absent one is fine).
    ``created_by``: the config history entry of the layer.
    """

    files: dict[str, bytes] = field(default_factory=dict)
    removals: tuple[str, ...] = ()
    created_by: str = ""


def write_layer(contents: LayerContents, workdir: Path) -> Layer:
    """Write ``contents`` as one deterministic gzip layer into ``workdir``."""
    builder = LayerBuilder()
    for path, data in sorted(contents.files.items()):
        builder.add_file(path, data)
    for path in contents.removals:
        builder.add_whiteout(path)
    return builder.write(workdir)
