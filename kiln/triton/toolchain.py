"""The Triton that compiles an image's kernels: the version its base image carries, from PyPI.

Public API:
    Toolchain(version, site, fingerprint, wheel, wheel_sha256)   ``.record`` its wheel's RECORD text,
                              ``.libtriton_sha256``, ``.wheel_python`` ("3.11", from the wheel's tags)
    toolchain_for(version, image, cache, reporter=SILENT, wheels=None) -> Toolchain
                              ``wheels``: where else the wheel may come from (``kiln.image.wheelcache``)
    toolchains_dir(cache) -> Path     where toolchains live (``$KILN_TRITON_TOOLCHAINS`` to share one)
    STAGE                     the fixed directory the worker sees sources and Triton under
    SOURCE_MTIME              the mtime of every file the compile reads (toolchain and sources)
    stage_dir(), stage_link(name, target)

The toolchain is fetched on demand, once per version, into
``<cache>/triton/toolchains/triton-<version>/`` (or ``$KILN_TRITON_TOOLCHAINS/triton-<version>/``): pip only *chooses* the wheel (``pip install
--dry-run --report``, so the machine's pip configuration and indexes apply), kiln downloads it
with progress, checks its sha256 and unpacks it itself. Nothing else is installed: the worker
needs no torch (``standin_torch.py``) and runs in kiln's own interpreter.

Why kiln unpacks the wheel rather than ``pip install --target``: the compile's bytes must
depend on content only. Triton's cache key hashes the install by content (``triton_key()``),
but a cubin's line info also names every source file holding a ``@triton.jit`` function
(Triton's ``language/`` included) and ptxas records each file's *mtime* there; and pip writes
the current time as mtime and a venv path into RECORD (script shebangs). So every file gets
``SOURCE_MTIME``, the fingerprint is the sha256 of the wheel's own RECORD (the hash of every
file in it), and the worker sees Triton and the vLLM sources under ``STAGE`` through symlinks
named by content: the same wheel and sources give the same cubins in any directory, on any
machine.

The entry keeps the sha256 of the wheel file kiln downloaded (``wheel_sha256`` in
``kiln-toolchain.json``, checked against the index's when it gives one) for the SBOM and the
provenance. ``wheels`` (the registry build cache's ``toolchain`` entries) may give the wheel
the index chose, by its sha256, instead of a download: its bytes are checked against the
index's sha256 all the same; and a wheel kiln downloaded is handed to ``wheels.keep`` before it
is deleted (``--cache-to`` writes it). The wheel itself is not kept in the entry, so an entry whose marker lacks that hash (one an index
without hashes filled) is completed by fetching the wheel again: its RECORD must match the
entry's fingerprint, then the marker is replaced atomically.
"""

from __future__ import annotations

import compileall
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

from kiln import lifeline
from kiln.cache import install_dir
from kiln.errors import KilnError
from kiln.report import SILENT, Reporter
from kiln.staging import write_atomic
from kiln.triton.imagekey import LIBTRITON, record_hashes

STAGE = Path("/tmp/kiln-triton")
SOURCE_MTIME = 1_000_000_000  # 2001-09-09, as kiln's layers (any fixed value would do)
_MARKER = "kiln-toolchain.json"


@dataclass(frozen=True)
class Toolchain:
    version: str
    site: Path  # a directory holding the ``triton`` package (first on the worker's sys.path)
    fingerprint: str  # sha256 of the wheel's RECORD (every file's hash, as the wheel lists it)
    wheel: str  # the wheel's file name (its tags say which Python and platform it is for)
    wheel_sha256: str  # sha256 of the wheel file as downloaded (the index's, when it gives one)

    @property
    def python(self) -> str:
        return sys.executable

    @property
    def record(self) -> str:
        return (self.site / f"triton-{self.version}.dist-info" / "RECORD").read_text()

    @property
    def libtriton_sha256(self) -> str:
        digest = record_hashes(self.record).get(LIBTRITON)
        if digest is None:
            raise KilnError(f"{self.site}: the Triton {self.version} wheel's RECORD lists no {LIBTRITON}; "
                            "kiln cannot tell its cache key")
        return digest

    @property
    def wheel_python(self) -> str:
        """``3.11`` from ``triton-3.6.0-cp311-cp311-...whl``."""
        tag = self.wheel.split("-")[2]
        return f"{tag[2]}.{tag[3:]}" if tag.startswith("cp") else tag

    def staged_site(self) -> Path:
        """``site`` seen through a symlink named by content (see the module docstring)."""
        return stage_link(f"triton-{self.version}-{self.fingerprint[:16]}", self.site)


def stage_dir() -> Path:
    """``STAGE``, created private; refuses one that another user owns or that is a link."""
    try:
        STAGE.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(STAGE)
    except OSError as err:
        raise KilnError(f"{STAGE}: cannot create the Triton staging directory ({err.strerror})") from None
    if not os.path.isdir(STAGE) or os.path.islink(STAGE) or info.st_uid != os.getuid():
        raise KilnError(f"{STAGE}: exists but is not a directory owned by this user; remove it to build kernels")
    return STAGE


def stage_link(name: str, target: Path) -> Path:
    """``STAGE/name`` -> ``target`` (replaced atomically when it points elsewhere)."""
    link = stage_dir() / name
    if os.path.islink(link) and os.readlink(link) == str(target):
        return link
    # private to this process and thread: one build compiles several SMs in threads
    tmp = stage_dir() / f".{name}.{os.getpid()}.{threading.get_ident()}"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, link)
    return link


def toolchain_for(version: str | None, image: str, cache: Path, reporter: Reporter = SILENT,
                  wheels=None) -> Toolchain:
    """The toolchain for the base image's Triton ``version`` (None: the base has none)."""
    if not version:
        raise KilnError(f"{image}: base image has no Triton (no triton-*.dist-info next to vLLM); "
                        "cannot compile its kernel cache")
    final = toolchains_dir(cache) / f"triton-{version}"
    install_dir(final, lambda tmp: _fetch(version, image, tmp, reporter, wheels))
    marker = _read_marker(final)
    if not marker.get("wheel_sha256"):
        marker = _complete_wheel_sha256(final, version, marker, image, reporter)
    return Toolchain(version, final, marker["record_sha256"], marker["wheel"], marker["wheel_sha256"])


def _read_marker(entry: Path) -> dict:
    """The entry's ``kiln-toolchain.json``: version, wheel, wheel_sha256, record_sha256, python."""
    try:
        marker = json.loads((entry / _MARKER).read_text())
        if not isinstance(marker, dict) or not marker.get("record_sha256") or not marker.get("wheel"):
            raise ValueError
    except (OSError, ValueError):
        raise KilnError(f"{entry}: not a toolchain kiln installed (no readable {_MARKER}); remove it") from None
    return marker


def _write_marker(entry: Path, marker: dict) -> None:
    write_atomic(entry / _MARKER, (json.dumps(marker, indent=1, sort_keys=True) + "\n").encode())


def _complete_wheel_sha256(entry: Path, version: str, marker: dict, image: str, reporter: Reporter) -> dict:
    """An entry without the wheel's sha256 (its index gave none, and kiln kept only the index's
    then): the wheel is not kept, so fetch it again and check it is the one the entry holds."""
    url, index_sha256 = _choose_wheel(version, image)
    name = unquote(PurePosixPath(urlsplit(url).path).name)
    if name != marker["wheel"]:
        raise KilnError(f"{entry}: installed from {marker['wheel']} but the index now offers {name}; "
                        "remove the entry to fetch it again")
    with tempfile.TemporaryDirectory(prefix="kiln-triton-wheel-") as tmp:
        wheel = Path(tmp) / name
        sha256 = _download(url, index_sha256, wheel, f"Triton {version} ({name.split('-')[2]})", reporter)
        if _record_sha256(wheel) != marker["record_sha256"]:
            raise KilnError(f"{entry}: the index's {name} is not the wheel this entry holds (RECORD differs); "
                            "remove the entry to fetch it again")
    marker = {**marker, "wheel_sha256": sha256}
    _write_marker(entry, marker)
    return marker


def toolchains_dir(cache: Path) -> Path:
    """``$KILN_TRITON_TOOLCHAINS`` (one directory several kiln caches share), else ``<cache>/triton/toolchains``."""
    shared = os.environ.get("KILN_TRITON_TOOLCHAINS")
    return Path(shared) if shared else cache / "triton" / "toolchains"


def _fetch(version: str, image: str, into: Path, reporter: Reporter, wheels=None) -> None:
    url, sha256 = _choose_wheel(version, image)
    name = unquote(PurePosixPath(urlsplit(url).path).name)
    wheel = into / name
    label = f"Triton {version} ({name.split('-')[2]})"
    # the index's sha256 names the wheel; a build cache entry of it is checked against it again here
    if sha256 and wheels is not None and wheels.fetch(name, sha256, wheel) and _file_sha256(wheel) == sha256:
        reporter.note(f"{label}: the wheel from the build cache (sha256 {sha256})")
        downloaded = False
    else:
        sha256, downloaded = _download(url, sha256, wheel, label, reporter), True
    with reporter.status(f"unpacking Triton {version}"):
        record = _unpack(wheel, into)
        if downloaded and wheels is not None:
            wheels.keep(name, sha256, wheel)  # may move it away: --cache-to writes it
        wheel.unlink(missing_ok=True)
        # bytecode for the interpreter that runs the worker, valid for SOURCE_MTIME sources
        for source in sorted((into / "triton").rglob("*.py")):
            lifeline.check()  # a build told to stop does not finish the fetch first
            compileall.compile_file(source, quiet=2)
    _write_marker(into, {"version": version, "wheel": name, "wheel_sha256": sha256,
                         "record_sha256": record, "python": sys.version.split()[0]})


def _choose_wheel(version: str, image: str, target: tuple[str, str] | None = None) -> tuple[str, str]:
    """The URL and sha256 of the wheel pip would install here (its indexes, this Python), or for
    ``target`` = (Python ``3.12``, wheel arch ``aarch64``): another platform's (``platformwheel.py``)."""
    with tempfile.TemporaryDirectory(prefix="kiln-pip-") as tmp:
        report = Path(tmp) / "report.json"
        result = lifeline.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--disable-pip-version-check",
             "--ignore-installed", "--no-deps", "--only-binary=:all:", "--report", str(report),
             *(_target_options(target, Path(tmp) / "target") if target else ()), f"triton=={version}"])
        if result.returncode != 0 or not report.is_file():
            tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
            what = (f"CPython {target[0]} on manylinux {target[1]}" if target
                    else f"this Python ({sys.version.split()[0]})")
            raise KilnError(f"{image}: no triton=={version} wheel for {what} on the package index: {tail[0]}")
        [item] = json.loads(report.read_text())["install"]
    info = item["download_info"]
    sha256 = (info.get("archive_info") or {}).get("hashes", {}).get("sha256") or ""
    return info["url"], sha256


def _target_options(target: tuple[str, str], into: Path) -> list[str]:
    """pip's options choosing a wheel for CPython ``python`` on manylinux ``arch`` (pip 23 matches
    each ``--platform`` exactly: every manylinux glibc a wheel may name is listed)."""
    python, arch = target
    platforms = [f"manylinux_2_{minor}_{arch}" for minor in range(17, 40)] + [f"manylinux2014_{arch}"]
    abi = f"cp{python.replace('.', '')}"
    return ["--target", str(into), "--python-version", python, "--implementation", "cp", "--abi", abi,
            *(option for name in platforms for option in ("--platform", name))]


def _download(url: str, sha256: str, path: Path, label: str, reporter: Reporter) -> str:
    """Download ``url`` to ``path``; its sha256, which must be ``sha256`` when that is given."""
    digest = hashlib.sha256()
    parts = urlsplit(url)
    if parts.scheme == "file":
        source = Path(unquote(parts.path))
        with reporter.task(f"copying {label}", source.stat().st_size) as task, \
                source.open("rb") as src, path.open("wb") as dst:
            while chunk := src.read(1 << 20):
                lifeline.check()
                digest.update(chunk)
                dst.write(chunk)
                task.advance(len(chunk))
    else:
        import requests

        try:
            with requests.get(url, stream=True, timeout=60) as response:
                response.raise_for_status()
                total = int(response.headers.get("Content-Length") or 0) or None
                with reporter.task(f"fetching {label}", total) as task, path.open("wb") as dst:
                    for chunk in response.iter_content(1 << 20):
                        lifeline.check()
                        digest.update(chunk)
                        dst.write(chunk)
                        task.advance(len(chunk))
        except requests.RequestException as err:
            raise KilnError(f"{parts.scheme}://{parts.hostname}{parts.path}: cannot download the Triton "
                            f"wheel: {err}") from None
    if sha256 and digest.hexdigest() != sha256:
        raise KilnError(f"{path.name}: sha256 {digest.hexdigest()} differs from the index's {sha256}")
    return digest.hexdigest()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as src:
        while chunk := src.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _record_sha256(wheel: Path) -> str | None:
    """sha256 of the RECORD inside ``wheel`` (what ``_unpack`` returns), without unpacking it."""
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            parts = PurePosixPath(name).parts
            if len(parts) == 2 and parts[0].endswith(".dist-info") and parts[1] == "RECORD":
                return hashlib.sha256(archive.read(name)).hexdigest()
    return None


def _unpack(wheel: Path, into: Path) -> str:
    """Unpack ``wheel``'s importable files into ``into`` at ``SOURCE_MTIME``; the RECORD's sha256."""
    record = None
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            lifeline.check()
            name = info.filename
            parts = PurePosixPath(name).parts
            if name.startswith("/") or ".." in parts:
                raise KilnError(f"{wheel.name}: member {name!r} leaves the install directory")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue  # scripts, headers: nothing the compile imports
                parts = parts[2:]
            target = into.joinpath(*parts)
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            data = archive.read(info)
            target.write_bytes(data)
            executable = (info.external_attr >> 16) & 0o111
            os.chmod(target, 0o755 if executable else 0o644)
            os.utime(target, (SOURCE_MTIME, SOURCE_MTIME))
            if parts[0].endswith(".dist-info") and parts[-1] == "RECORD":
                record = hashlib.sha256(data).hexdigest()
    if record is None or not (into / "triton" / "__init__.py").is_file():
        shutil.rmtree(into / "triton", ignore_errors=True)
        raise KilnError(f"{wheel.name}: not a Triton wheel (no triton/__init__.py or no RECORD)")
    return record
