"""Top-down walk over an image's layers, extracting the vLLM package as the merged view shows it.

Public API:
    VllmLayerWalk(dest)
        .add_layer(tar, label)   feed one layer (a ``tarfile`` opened in stream mode), top-most first
        .complete -> bool        True once no lower layer can change what kiln reads (rule below)
        .result() -> VllmFound   where vLLM lives, its version, and the files extracted
    VllmFound(site_dir, vllm_version, triton_version, files, layers)

Merged view (overlay semantics, as container runtimes apply them): walking from the top, the
first layer holding a path decides it; ``.wh.<name>`` deletes ``<name>`` in lower layers;
``<dir>/.wh..wh..opq`` hides everything lower layers put in ``<dir>`` (the opaque layer's own
entries stay); a non-directory in an upper layer hides a lower directory's contents. A layer's
whiteouts apply to the layers *below* it only, so they take effect after the layer is read.

Where vLLM lives: ``<prefix>/lib/python3[.N]/{dist,site}-packages/vllm/`` (the real image uses
``/usr/local/lib/python3.12/dist-packages``). kiln reads ``vllm/**/*.py`` (extracted below
``dest`` at their image paths), ``vllm-*.dist-info/{METADATA,RECORD}`` and
``triton-*.dist-info/METADATA``; every other entry is only looked at, never written.

Stop rule (a gzip layer must be read whole to know what it holds, so reading stops as early as
the merged view allows): once ``<site>/vllm/__init__.py`` and a ``vllm-*.dist-info/METADATA``
are decided for one site dir, no lower layer can change the result when
  (a) ``<site>/vllm`` (or an ancestor) is opaque, whited out or replaced above, or
  (b) the ``RECORD`` read lists ``.py`` files under ``vllm/`` and every one is decided
      (present, or deleted by a whiteout) -- pip writes the whole package in one layer, or
  (c) without ``RECORD``: ``__init__.py`` and ``METADATA`` came from the same layer (the
      install layer).
Limits: a lower-layer ``.py`` under ``vllm/`` that the installed RECORD does not own (a stray
file left by some other tool) is not seen; under (c) a file only a lower layer holds is missed.
If no site qualifies, every layer is read; if then no ``vllm/__init__.py`` is visible the image
has no vLLM (KilnError).

Safety: entry names are normalised (``./`` prefix); absolute names, ``..`` components and links
whose target leaves the package are refused with the layer and entry named. Files are written
only inside ``dest``.
"""

from __future__ import annotations

import email.parser
import posixpath
import re
import shutil
import tarfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from packaging.version import InvalidVersion, Version

from kiln.errors import KilnError

_SITE = re.compile(r"^(?P<site>(?:[^/]+/)*lib/python3(?:\.\d+)?/(?:dist|site)-packages)/(?P<rest>.+)$")
_VLLM_META = re.compile(r"^vllm-[^/]+\.dist-info/(METADATA|RECORD)$")
_TRITON_META = re.compile(r"^triton-[^/]+\.dist-info/METADATA$")
_WHITEOUT = ".wh."
_OPAQUE = ".wh..wh..opq"


@dataclass(frozen=True)
class VllmFound:
    site_dir: str  # e.g. "usr/local/lib/python3.12/dist-packages" (no leading slash)
    vllm_version: Version
    triton_version: str | None
    files: tuple[str, ...]  # every regular file visible under vllm/ in the layers read, relative to it
    layers: tuple[str, ...]  # labels of the layers read, top-most first


@dataclass
class _SiteState:
    init_layer: str | None = None
    metadata: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # dist-info -> (layer, METADATA)
    record: bytes | None = None
    triton: bytes | None = None


class VllmLayerWalk:
    def __init__(self, dest: Path):
        self.dest = dest
        self._decided: set[str] = set()
        self._deleted: set[str] = set()
        self._opaque: set[str] = set()
        self._nondirs: set[str] = set()
        self._sites: dict[str, _SiteState] = {}
        self._files: dict[str, set[str]] = {}  # site -> vllm-relative files visible
        self.layers: list[str] = []

    # -- feeding -----------------------------------------------------------------------------

    def add_layer(self, tar: tarfile.TarFile, label: str) -> None:
        decided, deleted, opaque, nondirs = set(), set(), set(), set()
        for member in tar:
            path = _normalise(member.name, label)
            if path is None or self._hidden(path):
                continue
            parent, base = posixpath.split(path)
            if base == _OPAQUE:
                opaque.add(parent)
                continue
            if base.startswith(_WHITEOUT):
                deleted.add(posixpath.join(parent, base[len(_WHITEOUT):]))
                continue
            decided.add(path)
            if not member.isdir():
                nondirs.add(path)
            self._visit(member, path, tar, label)
        self._decided |= decided
        self._deleted |= deleted
        self._opaque |= opaque
        self._nondirs |= nondirs
        self.layers.append(label)

    def _hidden(self, path: str) -> bool:
        """Whether layers above already decided ``path`` or hide it."""
        if path in self._decided or path in self._deleted:
            return True
        parent = posixpath.dirname(path)
        while parent:
            if parent in self._deleted or parent in self._opaque or parent in self._nondirs:
                return True
            parent = posixpath.dirname(parent)
        return False

    def _visit(self, member: tarfile.TarInfo, path: str, tar: tarfile.TarFile, label: str) -> None:
        match = _SITE.match(path)
        if not match:
            return
        site, rest = match["site"], match["rest"]
        state = self._sites.setdefault(site, _SiteState())
        if rest.startswith("vllm/"):
            rel = rest[len("vllm/"):]
            if member.isfile() or member.islnk() or member.issym():
                self._files.setdefault(site, set()).add(rel)
            if rel == "__init__.py":
                state.init_layer = label
            if rel.endswith(".py") and (member.isfile() or member.islnk() or member.issym()):
                self._extract(member, path, site, tar, label)
        elif _VLLM_META.match(rest) and member.isfile():
            data = _read(tar, member)
            if rest.endswith("/METADATA"):
                state.metadata[rest.split("/")[0]] = (label, data)
            else:
                state.record = data
        elif _TRITON_META.match(rest) and member.isfile():
            state.triton = _read(tar, member)

    def _extract(self, member: tarfile.TarInfo, path: str, site: str, tar: tarfile.TarFile, label: str) -> None:
        # ``path`` is relative with no ``..`` (``_normalise``), and ``dest`` holds only directories
        # made here and in-package leaf symlinks, so no parent can redirect the write elsewhere.
        target = self.dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()  # a later duplicate entry of the same layer wins, as tar extraction does
        package = f"{site}/vllm"
        if member.isfile():
            source = tar.extractfile(member)
            assert source is not None
            with target.open("wb") as out:
                shutil.copyfileobj(source, out)
        elif member.issym():
            resolved = posixpath.normpath(posixpath.join(posixpath.dirname(path), member.linkname))
            if member.linkname.startswith("/") or not resolved.startswith(package + "/"):
                raise KilnError(f"layer {label}: symlink {member.name!r} -> {member.linkname!r} leaves the vllm package")
            target.symlink_to(posixpath.relpath(resolved, posixpath.dirname(path)))
        else:  # hard link: its target must be a file this layer already gave us
            linked = _normalise(member.linkname, label)
            source_path = self.dest / linked if linked else None
            if not linked or not linked.startswith(package + "/") or not source_path.is_file():
                raise KilnError(f"layer {label}: hard link {member.name!r} -> {member.linkname!r} points outside the extracted vllm package")
            shutil.copyfile(source_path, target)

    # -- deciding ----------------------------------------------------------------------------

    @property
    def complete(self) -> bool:
        return self._settled_site() is not None

    def _settled_site(self) -> str | None:
        for site, state in self._sites.items():
            if "__init__.py" not in self._files.get(site, ()) or not state.metadata:
                continue
            package = f"{site}/vllm"
            if self._hidden(package + "/\0lower"):  # (a) nothing lower can show through
                return site
            if state.record is not None:  # (b)
                listed = _record_python_files(state.record)
                if listed and all(rel in self._files[site] or self._hidden(f"{package}/{rel}") for rel in listed):
                    return site
            elif any(layer == state.init_layer for layer, _ in state.metadata.values()):  # (c)
                return site
        return None

    def result(self) -> VllmFound:
        site = self._settled_site()
        if site is None:
            with_init = [s for s, files in self._files.items() if "__init__.py" in files]
            if not with_init:
                raise KilnError(f"no vLLM in the image: no python3.X site-/dist-packages/vllm/__init__.py in {len(self.layers)} layers")
            site = with_init[0]
            if not self._sites[site].metadata:
                raise KilnError(f"/{site}/vllm has no vllm-*.dist-info/METADATA; cannot tell the installed vLLM version")
        state = self._sites[site]
        name, (_, metadata) = sorted(state.metadata.items())[0]
        version = _metadata_version(metadata, f"/{site}/{name}/METADATA")
        triton = None
        if state.triton is not None:
            triton = str(_metadata_version(state.triton, f"/{site}/triton dist-info METADATA"))
        return VllmFound(site, version, triton, tuple(sorted(self._files[site])), tuple(self.layers))


def _normalise(name: str, label: str) -> str | None:
    """``./usr/x`` -> ``usr/x``; ``.``/``./`` -> None; absolute or ``..`` names are refused."""
    if name.startswith("/"):
        raise KilnError(f"layer {label}: entry {name!r} has an absolute path")
    parts = [p for p in PurePosixPath(name).parts if p != "."]
    if ".." in parts:
        raise KilnError(f"layer {label}: entry {name!r} climbs out of the root with '..'")
    return "/".join(parts) or None


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo, limit: int = 64 << 20) -> bytes:
    if member.size > limit:
        raise KilnError(f"{member.name}: {member.size} bytes is too large for a dist-info file")
    handle = tar.extractfile(member)
    assert handle is not None
    return handle.read()


def _record_python_files(record: bytes) -> set[str]:
    files = set()
    for line in record.decode("utf-8", "replace").splitlines():
        path = line.split(",", 1)[0]
        if path.startswith("vllm/") and path.endswith(".py"):
            files.add(path[len("vllm/"):])
    return files


def _metadata_version(data: bytes, where: str) -> Version:
    message = email.parser.BytesHeaderParser().parsebytes(data)
    raw = message.get("Version")
    try:
        return Version(str(raw))
    except InvalidVersion:
        raise KilnError(f"{where}: Version {raw!r} is not a valid version") from None
