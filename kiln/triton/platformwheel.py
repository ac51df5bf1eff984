"""The Triton wheel of an image built for another platform than the host that compiles its kernels.

Public API:
    PlatformWheel(version, python, arch, wheel, wheel_sha256, record, ptxas)
                                ``ptxas``: the host ptxas's ``--version`` text -> the image's
    platform_wheel(toolchain, python, arch, image, cache, reporter=SILENT) -> PlatformWheel
    host_ptxas(toolchain) -> dict[str, str]   name -> what the toolchain's ptxas prints for ``--version``
    wheel_arch(wheel_name) -> str       "x86_64" from ``triton-3.6.0-cp311-cp311-manylinux_…_x86_64.whl``
    built_on(data) -> str | None        the build date a ptxas binary prints on its "Built on" line
    ptxas_key_text(own_text, image_date) -> str   what the image's ptxas prints for ``--version``
    check_same_build(name, own_text, image_binary, where)
    PTXAS                               the ptxas binaries a wheel ships, by name

Why: kiln compiles every platform's kernels on the amd64 build host, with the toolchain wheel for
its own Python and machine. An arm64 image runs the aarch64 wheel of the same Triton release for
its Python (3.12). Triton keys a kernel by ``triton_key()`` (its version and the sha256 of its
``.py`` files and ``libtriton.so``), by the backend's ``hash()`` (the full text ``ptxas --version``
prints, and the arch) and by the kernel's source, specialisation and options. Across machines the
``.py`` files and libdevice are the same bytes; ``libtriton.so`` and the ptxas binaries are not,
and the aarch64 ptxas prints another "Built on" time (3.6.0: ``Fri_Feb_21_20:22:20_PST_2025``
vs x86_64's ``…20:21:21…``). So the kernels are keyed with the image's ``libtriton.so`` sha256 and
the image's ptxas text, and the image's Triton is proven to be the PyPI wheel whose bytes say both.

The aarch64 wheel is chosen by pip for that platform and Python (``--platform manylinux_…_aarch64
--python-version 3.12``), downloaded through the toolchain's path and checked against the index's
sha256 (an index that gives none is refused: nothing else vouches for the wheel), and only its
RECORD and each ptxas's ``--version`` text (derived from its bytes, which must hash to the RECORD's
entry) are kept: ``<toolchains>/triton-<version>-cp312-aarch64/``, with the host text it was
derived from (a host ptxas that prints another is refused: remove the entry). The aarch64 ptxas cannot run
on the build host; its ``--version`` text is the host ptxas's with that date (and the copyright's
year, the date's) put in, and every other line of it must appear verbatim in the aarch64 binary
(the release and build lines, and the format strings ``%s: NVIDIA (R) %s``, ``Built on %s``).
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

from kiln import lifeline
from kiln.cache import install_dir
from kiln.errors import KilnError
from kiln.report import SILENT, Reporter
from kiln.staging import write_atomic
from kiln.triton import toolchain as toolchains
from kiln.triton.imagekey import record_hashes

PTXAS = {"ptxas": "triton/backends/nvidia/bin/ptxas", "ptxas-blackwell": "triton/backends/nvidia/bin/ptxas-blackwell"}
_MARKER = "kiln-platform-wheel.json"
# "Fri_Feb_21_20:22:20_PST_2025" (CUDA 12.x); CUDA 13.3's (Triton 3.8.0's ptxas-blackwell) prints a
# 12-hour clock: "Fri_Apr_24_07:22:02_PM_PDT_2026"; a one-digit day may be padded ("Apr__8")
_DATE = re.compile(rb"(?<![\w:])(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)_[A-Z][a-z]{2}_{1,2}\d{1,2}_\d{2}:\d{2}:\d{2}"
                   rb"(?:_[AP]M)?_[A-Z]{3}_\d{4}(?![\w:])")
_FORMATS = (b"%s: NVIDIA (R) %s", b"Ptx optimizing assembler", b"Built on %s", b"Copyright (c) 2005-%s NVIDIA Corporation")


@dataclass(frozen=True)
class PlatformWheel:
    version: str
    python: str  # "3.12"
    arch: str  # "aarch64"
    wheel: str  # the wheel's file name
    wheel_sha256: str  # as the index gives it (the download checked against it)
    record: str  # the wheel's RECORD
    ptxas: dict[str, str]  # the host ptxas's --version text -> the image's (one per ptxas binary)

    def to_json(self) -> dict:
        return {"wheel": self.wheel, "wheel_sha256": self.wheel_sha256,
                "record_sha256": hashlib.sha256(self.record.encode()).hexdigest()}


def wheel_arch(wheel_name: str) -> str:
    """The machine of a manylinux wheel's platform tag: ``x86_64``, ``aarch64``."""
    tag = wheel_name.removesuffix(".whl").split("-")[-1].split(".")[0]
    match = re.fullmatch(r"(?:manylinux_\d+_\d+|manylinux\d+|linux)_(\w+)", tag)
    if not match:
        raise KilnError(f"{wheel_name}: not a Linux wheel kiln can tell the machine of")
    return match.group(1)


def built_on(data: bytes) -> str | None:
    """The one build date a ptxas binary holds (what its ``Built on %s`` line prints), else None."""
    found = set(_DATE.findall(data))
    return found.pop().decode() if len(found) == 1 else None


def ptxas_key_text(own_text: str, image_date: str) -> str:
    """The host ptxas's ``--version`` text as the image's ptxas prints it: its date, its year."""
    match = re.search(r"^Built on (\S+)$", own_text, re.M)
    own_date = match.group(1) if match else ""
    own_year, image_year = own_date[-4:], image_date[-4:]
    if own_text.count(f"Built on {own_date}\n") != 1 or own_text.count(f"2005-{own_year} ") != 1:
        raise KilnError(f"ptxas --version printed {own_text!r}: not the lines kiln knows how to carry over")
    return own_text.replace(f"Built on {own_date}\n", f"Built on {image_date}\n").replace(
        f"2005-{own_year} ", f"2005-{image_year} ")


def check_same_build(name: str, own_text: str, image_binary: bytes, where: str) -> None:
    """Every line of the host ptxas's text but the date's is in the image's binary, verbatim."""
    lines = [line.encode() for line in own_text.splitlines()[3:] if line.strip()]  # release, build
    missing = [line.decode() for line in (*lines, *_FORMATS) if line not in image_binary]
    if missing or len(lines) < 2:
        raise KilnError(f"{where}: its {name} is another build than the one kiln compiles with "
                        f"({missing[0] if missing else 'no release line'} not in it)")


def host_ptxas(toolchain) -> dict[str, str]:
    """name -> what each ptxas of the toolchain (the host's) prints for ``--version``."""
    texts = {}
    for name, path in PTXAS.items():
        binary = toolchain.site / path
        if binary.is_file():
            result = lifeline.run([str(binary), "--version"])
            if result.returncode != 0:
                raise KilnError(f"{binary}: --version failed: {(result.stderr or result.stdout).strip()[:200]}")
            texts[name] = result.stdout
    return texts


def platform_wheel(toolchain, python: str, arch: str, image: str, cache: Path,
                   reporter: Reporter = SILENT) -> PlatformWheel:
    """The RECORD and ptxas texts of ``toolchain``'s Triton release for CPython ``python`` on ``arch``."""
    version = toolchain.version
    final = toolchains.toolchains_dir(cache) / f"triton-{version}-cp{python.replace('.', '')}-{arch}"
    own = host_ptxas(toolchain)
    install_dir(final, lambda tmp: _fetch(version, python, arch, image, tmp, own, reporter))
    try:
        marker = json.loads((final / _MARKER).read_text())
        record = (final / "RECORD").read_bytes().decode()
    except (OSError, ValueError):
        raise KilnError(f"{final}: not an entry kiln wrote (no readable {_MARKER} or RECORD); remove it") from None
    if hashlib.sha256(record.encode()).hexdigest() != marker.get("record_sha256"):
        raise KilnError(f"{final}: its RECORD is not the one kiln kept; remove it")
    kept = {entry["host"]: entry["image"] for entry in marker["ptxas"].values()}
    if set(kept) != set(own.values()):
        raise KilnError(f"{final}: derived from another host ptxas than the toolchain's; remove it")
    return PlatformWheel(version, python, arch, marker["wheel"], marker["wheel_sha256"], record, kept)


def _fetch(version: str, python: str, arch: str, image: str, into: Path, own: dict[str, str],
           reporter: Reporter) -> None:
    url, sha256 = toolchains._choose_wheel(version, image, (python, arch))
    name = unquote(PurePosixPath(urlsplit(url).path).name)
    if not sha256:
        raise KilnError(f"{image}: the package index gives no sha256 for {name}; kiln keys kernels for "
                        "another platform's Triton only from a wheel the index vouches for")
    with tempfile.TemporaryDirectory(prefix="kiln-triton-wheel-") as tmp:
        wheel = Path(tmp) / name
        toolchains._download(url, sha256, wheel, f"Triton {version} ({python}, {arch}) RECORD", reporter)
        record, texts = _read_wheel(wheel, version, own)
    write_atomic(into / "RECORD", record.encode())
    write_atomic(into / _MARKER, (json.dumps({
        "version": version, "python": python, "arch": arch, "wheel": name, "wheel_sha256": sha256,
        "record_sha256": hashlib.sha256(record.encode()).hexdigest(), "ptxas": texts,
    }, indent=1, sort_keys=True) + "\n").encode())


def _read_wheel(wheel: Path, version: str, own: dict[str, str]) -> tuple[str, dict[str, dict]]:
    """The wheel's RECORD and each ptxas's ``--version`` text (``{"host": …, "image": …}``), its
    bytes checked against the RECORD and against the host ptxas (``check_same_build``)."""
    with zipfile.ZipFile(wheel) as archive:
        try:
            record = archive.read(f"triton-{version}.dist-info/RECORD").decode()
        except KeyError:
            raise KilnError(f"{wheel.name}: no triton-{version}.dist-info/RECORD") from None
        hashes = record_hashes(record)
        texts = {}
        for name, path in PTXAS.items():
            if path not in hashes and name not in own:
                continue
            if path not in hashes or name not in own:
                raise KilnError(f"{wheel.name}: {path} is {'not ' if path not in hashes else ''}in it, "
                                f"{'not ' if name not in own else ''}in the toolchain kiln compiles with")
            data = archive.read(path)
            if hashlib.sha256(data).hexdigest() != hashes[path]:
                raise KilnError(f"{wheel.name}: {path} does not hash to its RECORD entry")
            date = built_on(data)
            if date is None:
                raise KilnError(f"{wheel.name}: {path}: no single build date in it; kiln cannot tell "
                                "what its --version prints")
            check_same_build(name, own[name], data, wheel.name)
            texts[name] = {"host": own[name], "image": ptxas_key_text(own[name], date)}
    return record, texts
