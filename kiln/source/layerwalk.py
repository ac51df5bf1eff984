"""Top-down walk over an image's layers, extracting the vLLM package as the merged view shows it.

Public API:
    VllmLayerWalk(dest, need_triton=False)
        .add_layer(tar, label)   feed one layer (a ``tarfile`` opened in stream mode), top-most first
        .complete -> bool        True once no lower layer can change what kiln reads (rule below)
        .result() -> VllmFound   where vLLM lives, its version, and the files extracted
    VllmFound(site_dir, vllm_version, triton_version, triton_record, files, layers)

Merged view (overlay semantics, as container runtimes apply them): walking from the top, the
first layer holding a path decides it; ``.wh.<name>`` deletes ``<name>`` in lower layers;
``<dir>/.wh..wh..opq`` hides everything lower layers put in ``<dir>`` (the opaque layer's own
entries stay); a non-directory in an upper layer hides a lower directory's contents. A layer's
whiteouts apply to the layers *below* it only, so they take effect after the layer is read.

Where vLLM lives: ``<prefix>/lib/python3[.N]/{dist,site}-packages/vllm/`` (the real image uses
``/usr/local/lib/python3.12/dist-packages``). kiln reads ``vllm/**/*.py`` (extracted below
``dest`` at their image paths), ``vllm-*.dist-info/{METADATA,RECORD}`` and
``triton-*.dist-info/{METADATA,RECORD}`` (which Triton the image runs: the kernel cache is keyed by
its files); every other entry is only looked at, never written.

Stop rule (a gzip layer must be read whole to know what it holds, so reading stops as early as
the merged view allows): once ``<site>/vllm/__init__.py`` and a ``vllm-*.dist-info/METADATA``
are decided for one site dir, no lower layer can change the result when
  (a) ``<site>/vllm`` (or an ancestor) is opaque, whited out or replaced above, or
  (b) the ``RECORD`` read lists ``.py`` files under ``vllm/`` and every one is decided
      (present, or deleted by a whiteout) -- pip writes the whole package in one layer, or
  (c) without ``RECORD``: ``__init__.py`` and ``METADATA`` came from the same layer (the
      install layer).
With ``need_triton`` (an image whose kernels kiln compiles), reading also goes on below a
settled site until a Triton dist-info is decided there or the layers run out: an image may
install torch and Triton in a layer of their own, under vLLM's.
Limits: a lower-layer ``.py`` under ``vllm/`` that the installed RECORD does not own (a stray
file left by some other tool) is not seen; under (c) a file only a lower layer holds is missed.
If no site qualifies, every layer is read; if then no ``vllm/__init__.py`` is visible the image
has no vLLM (KilnError).

Safety (a base image is input, and may be hostile): entry names are normalised (``./``
prefix); an absolute name or a ``..`` component anywhere in a layer is refused. Under
``vllm/``: a device, FIFO or other special file, a ``.py`` entry declaring more than
``MAX_SOURCE_FILE`` bytes (checked on the header, before any data is read), an entry below a
symlink or below a file of the same layer, and a link whose target leaves the package are
refused; every refusal names the layer and the entry. Entries outside the package are only
looked at, never written, whatever their type. Nothing is ever written through a link:
``dest`` holds only real directories and regular files (written with ``O_EXCL|O_NOFOLLOW``);
a symlink is recorded and, once every layer is read, resolved inside the package by kiln itself
(never by the kernel) and materialised as a copy of its target. A later duplicate entry of a
layer replaces the earlier one, as tar extraction does.
"""

from __future__ import annotations

import email.parser
import posixpath
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from packaging.version import InvalidVersion, Version

from kiln.errors import KilnError, writing
from kiln.source.writes import OrderedWrites, copy_of, create_new

_SITE = re.compile(r"^(?P<site>(?:[^/]+/)*lib/python3(?:\.\d+)?/(?:dist|site)-packages)/(?P<rest>.+)$")
_VLLM_META = re.compile(r"^vllm-[^/]+\.dist-info/(METADATA|RECORD)$")
_TRITON_META = re.compile(r"^triton-[^/]+\.dist-info/(METADATA|RECORD)$")
_WHITEOUT = ".wh."
_OPAQUE = ".wh..wh..opq"
MAX_SOURCE_FILE = 64 << 20  # vLLM's largest .py is well under 1 MiB; a bigger one is not source
_MAX_LINK_HOPS = 40  # as the kernel's ELOOP limit


@dataclass(frozen=True)
class VllmFound:
    site_dir: str  # e.g. "usr/local/lib/python3.12/dist-packages" (no leading slash)
    vllm_version: Version
    triton_version: str | None
    triton_record: str | None  # that Triton's dist-info RECORD (the hash of every file it installed)
    files: tuple[str, ...]  # every regular file visible under vllm/ in the layers read, relative to it
    layers: tuple[str, ...]  # labels of the layers read, top-most first


@dataclass
class _SiteState:
    init_layer: str | None = None
    metadata: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # dist-info -> (layer, METADATA)
    record: bytes | None = None
    triton: bytes | None = None  # the first triton-*.dist-info/METADATA seen (top-most layer)
    triton_info: str | None = None  # its dist-info directory
    triton_records: dict[str, bytes] = field(default_factory=dict)  # dist-info -> RECORD


class VllmLayerWalk:
    def __init__(self, dest: Path, need_triton: bool = False):
        self.dest = dest  # an empty directory: the walk is the only writer, so what it holds is known
        self.need_triton = need_triton
        self._decided: set[str] = set()
        self._deleted: set[str] = set()
        self._opaque: set[str] = set()
        self._nondirs: set[str] = set()
        self._sites: dict[str, _SiteState] = {}
        self._files: dict[str, set[str]] = {}  # site -> vllm-relative files visible
        self._links: dict[str, tuple[str, str]] = {}  # symlink path under a package -> (target, layer)
        # What ``dest`` holds, kept here rather than asked of the file system: a stat or a mkdir
        # per entry cost as much as writing the file (~1,700 of them in vLLM 0.20.1).
        self._dirs: set[str] = set()
        self._regular: set[str] = set()
        self.layers: list[str] = []
        self._writes: OrderedWrites | None = None  # while a layer is added, or the links written

    # -- feeding -----------------------------------------------------------------------------

    def add_layer(self, tar: tarfile.TarFile, label: str) -> None:
        with OrderedWrites() as self._writes:  # done (or failed) when the layer is
            self._add_layer(tar, label)

    def _add_layer(self, tar: tarfile.TarFile, label: str) -> None:
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
            if not (member.isfile() or member.islnk() or member.issym() or member.isdir()):
                raise KilnError(f"layer {label}: entry {member.name!r} in the vllm package is a "
                                f"{_KINDS.get(member.type, 'special file')}; kiln reads only files, directories and links")
            self._check_parents(path, site, member, label)
            if member.isdir():
                return
            self._files.setdefault(site, set()).add(rel)
            if rel == "__init__.py":
                state.init_layer = label
            if member.issym():
                self._drop(path, member, label)
                self._resolve(path, f"{site}/vllm", label, member.linkname)  # refuse an escape early
                self._links[path] = (member.linkname, label)
            elif rel.endswith(".py"):
                self._extract(member, path, site, tar, label)
        elif _VLLM_META.match(rest) and member.isfile():
            data = _read(tar, member, label)
            if rest.endswith("/METADATA"):
                state.metadata[rest.split("/")[0]] = (label, data)
            else:
                state.record = data
        elif _TRITON_META.match(rest) and member.isfile():
            info = rest.split("/")[0]
            if rest.endswith("/RECORD"):
                state.triton_records[info] = _read(tar, member, label)
            elif state.triton is None:
                state.triton, state.triton_info = _read(tar, member, label), info

    def _check_parents(self, path: str, site: str, member: tarfile.TarInfo, label: str) -> None:
        """Refuse an entry that would be written through a symlink or below a file."""
        parent = posixpath.dirname(path)
        while len(parent) > len(site):
            if parent in self._links:
                raise KilnError(f"layer {label}: entry {member.name!r} is below the symlink "
                                f"{parent!r}; refusing to write through a link")
            if parent in self._regular:
                raise KilnError(f"layer {label}: entry {member.name!r} is below {parent!r}, which is not a directory")
            parent = posixpath.dirname(parent)

    def _drop(self, path: str, member: tarfile.TarInfo, label: str) -> None:
        """Forget what an earlier entry of this layer put at ``path`` (a later duplicate wins)."""
        self._links.pop(path, None)
        if path in self._dirs:
            raise KilnError(f"layer {label}: entry {member.name!r} replaces a directory already extracted")
        if path in self._regular:
            self._writes.submit((self.dest / path).unlink)
            self._regular.discard(path)

    def _new_file(self, path: str, size: int | None, what: str, fill) -> None:
        """``dest/path`` created (its directories made first) and filled by ``fill(out)``, in the
        writer's thread; never through a link (``create_new``). ``size``/``what``: for a full disk's error."""
        parent = posixpath.dirname(path)
        made = None
        if parent not in self._dirs:
            made = self.dest / parent
            while parent and parent not in self._dirs:
                self._dirs.add(parent)
                parent = posixpath.dirname(parent)
        self._regular.add(path)
        target = self.dest / path

        def write() -> None:
            with writing(target, size, what):
                if made is not None:
                    made.mkdir(parents=True, exist_ok=True)
                with create_new(target) as out:
                    fill(out)

        self._writes.submit(write, size or 0)

    def _extract(self, member: tarfile.TarInfo, path: str, site: str, tar: tarfile.TarFile, label: str) -> None:
        # ``path`` is relative with no ``..`` (``_normalise``); ``_check_parents`` made sure no
        # parent is a link or a file, and ``dest`` never holds a link: the write stays in ``dest``.
        self._drop(path, member, label)
        package = f"{site}/vllm"
        if member.isfile():
            if member.size > MAX_SOURCE_FILE:
                raise KilnError(f"layer {label}: entry {member.name!r} declares {member.size} bytes, over kiln's "
                                f"limit of {MAX_SOURCE_FILE} for a source file")
            source = tar.extractfile(member)
            assert source is not None
            data = source.read()  # (the tar is read here, in order; the file is written in the writer's thread)
            self._new_file(path, member.size, f"layer {label}: entry {member.name!r}", lambda out: out.write(data))
        else:  # hard link: its target must be a regular file already extracted into the package
            try:
                linked = _normalise(member.linkname, label)
            except KilnError:  # absolute or climbing: reported below, naming the link itself
                linked = None
            if not linked or not linked.startswith(package + "/") or linked not in self._regular:
                raise KilnError(f"layer {label}: hard link {member.name!r} -> {member.linkname!r} does not name "
                                "a file extracted from the vllm package")
            self._new_file(path, None, f"layer {label}: hard link {member.name!r}", copy_of(self.dest / linked))

    def _materialise_links(self, site: str) -> None:
        """Write each ``.py`` symlink of the package as a copy of the file it resolves to."""
        package = f"{site}/vllm"
        resolved = {}
        for path, (linkname, label) in sorted(self._links.items()):
            if path.startswith(package + "/") and path.endswith(".py"):
                resolved[path] = (self._resolve(path, package, label, linkname), label, linkname)
        for path, (target, label, linkname) in resolved.items():
            source = self.dest / target
            if target not in self._regular:
                raise KilnError(f"layer {label}: symlink {path!r} -> {linkname!r} resolves to {target!r}, "
                                "which is not a file in the layers read")
            self._new_file(path, source.stat().st_size, f"layer {label}: symlink {path!r}", copy_of(source))

    def _resolve(self, path: str, package: str, label: str, linkname: str) -> str:
        """Where the symlink at ``path`` leads, following links, never leaving ``package``."""
        bound = package.split("/")
        done = path.split("/")[:-1]
        pending = linkname.split("/")
        hops = 1
        if linkname.startswith("/"):
            raise KilnError(f"layer {label}: symlink {path!r} -> {linkname!r} leaves the vllm package (absolute target)")
        while pending:
            part = pending.pop(0)
            if part in ("", "."):
                continue
            if part == "..":
                done.pop()
            else:
                done.append(part)
            if done[:len(bound)] != bound:
                raise KilnError(f"layer {label}: symlink {path!r} -> {linkname!r} leaves the vllm package")
            here = "/".join(done)
            if here in self._links:
                hops += 1
                if hops > _MAX_LINK_HOPS:
                    raise KilnError(f"layer {label}: symlink {path!r} -> {linkname!r}: too many levels of links")
                target, _ = self._links[here]
                if target.startswith("/"):
                    raise KilnError(f"layer {label}: symlink {path!r} -> {linkname!r} leaves the vllm package "
                                    f"(through {here!r} -> {target!r})")
                done.pop()
                pending = target.split("/") + pending
        if len(done) <= len(bound):
            raise KilnError(f"layer {label}: symlink {path!r} -> {linkname!r} names the vllm package itself")
        return "/".join(done)

    # -- deciding ----------------------------------------------------------------------------

    @property
    def complete(self) -> bool:
        site = self._settled_site()
        return site is not None and (not self.need_triton or self._sites[site].triton is not None)

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
        with OrderedWrites() as self._writes:
            self._materialise_links(site)
        state = self._sites[site]
        name, (_, metadata) = sorted(state.metadata.items())[0]
        version = _metadata_version(metadata, f"/{site}/{name}/METADATA")
        triton = record = None
        if state.triton is not None:
            triton = str(_metadata_version(state.triton, f"/{site}/triton dist-info METADATA"))
            raw = state.triton_records.get(state.triton_info or "")
            record = raw.decode("utf-8", "replace") if raw is not None else None
        return VllmFound(site, version, triton, record, tuple(sorted(self._files[site])), tuple(self.layers))


def _normalise(name: str, label: str) -> str | None:
    """``./usr/x`` -> ``usr/x``; ``.``/``./`` -> None; absolute or ``..`` names are refused."""
    if name.startswith("/"):
        raise KilnError(f"layer {label}: entry {name!r} has an absolute path")
    parts = [p for p in PurePosixPath(name).parts if p != "."]
    if ".." in parts:
        raise KilnError(f"layer {label}: entry {name!r} climbs out of the root with '..'")
    return "/".join(parts) or None


_KINDS = {tarfile.CHRTYPE: "character device", tarfile.BLKTYPE: "block device", tarfile.FIFOTYPE: "FIFO"}


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo, label: str, limit: int = MAX_SOURCE_FILE) -> bytes:
    if member.size > limit:
        raise KilnError(f"layer {label}: entry {member.name!r} declares {member.size} bytes, over kiln's "
                        f"limit of {limit} for a dist-info file")
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
