"""The Triton that compiles an image's kernels: the version its base image carries, from PyPI.

Public API:
    Toolchain(version, site, fingerprint, reused)
    toolchain_for(version, image, cache) -> Toolchain
    STAGE                     the fixed directory the worker sees sources and Triton under

Triton's cache key hashes the Triton install by content (``triton_key()``: version, the
compiler/backends/language sources, ``libtriton.so``), never by its path. So any unmodified
install of the same wheel gives the keys the image's own Triton computes: the one kiln itself
runs with when the version matches (saves a 188 MB download), else ``pip install --no-deps
--target`` into ``<cache>/triton/toolchains/triton-<version>/`` (staged, renamed into place).

Paths still matter for *bytes*: a cubin's line info names the directory of every source file
that holds a ``@triton.jit`` function, Triton's ``language/`` directory included. The worker
therefore sees Triton and the vLLM sources under ``STAGE`` through symlinks whose names depend
only on content, so the same inputs give the same cubins on any machine.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kiln.cache import file_lock
from kiln.errors import KilnError

STAGE = Path("/tmp/kiln-triton")


@dataclass(frozen=True)
class Toolchain:
    version: str
    site: Path  # a directory holding the ``triton`` package (first on the worker's sys.path)
    fingerprint: str  # sha256 of the install's RECORD (every file's hash, as pip wrote it)
    reused: bool  # kiln's own interpreter's Triton

    @property
    def python(self) -> str:
        # the worker also needs torch and numpy; kiln's environment provides them
        return sys.executable

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
    tmp = stage_dir() / f".{name}.{os.getpid()}"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, link)
    return link


def _record_fingerprint(dist: importlib.metadata.Distribution) -> str | None:
    record = dist.read_text("RECORD")
    return hashlib.sha256(record.encode()).hexdigest() if record else None


def _find(version: str, paths: list[str]) -> Toolchain | None:
    for dist in importlib.metadata.distributions(path=paths):
        if (dist.metadata["Name"] or "").lower() != "triton" or dist.version != version:
            continue
        site = Path(dist.locate_file(""))
        fingerprint = _record_fingerprint(dist)
        if fingerprint and (site / "triton" / "__init__.py").is_file():
            return Toolchain(version, site, fingerprint, reused=False)
    return None


def toolchain_for(version: str | None, image: str, cache: Path) -> Toolchain:
    """The toolchain for the base image's Triton ``version`` (None: the base has none)."""
    if not version:
        raise KilnError(f"{image}: base image has no Triton (no triton-*.dist-info next to vLLM); "
                        "cannot compile its kernel cache")
    own = _find(version, sys.path)
    if own is not None:
        return Toolchain(own.version, own.site, own.fingerprint, reused=True)
    root = cache / "triton" / "toolchains"
    final = root / f"triton-{version}"
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f".triton-{version}.lock"):
        found = _find(version, [str(final)]) if final.is_dir() else None
        if found is None:
            staging = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-triton-{version}-"))
            try:
                result = subprocess.run(
                    [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                     "--no-deps", "--only-binary=:all:", "--target", str(staging), f"triton=={version}"],
                    capture_output=True, text=True)
                if result.returncode != 0:
                    tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
                    raise KilnError(f"{image}: cannot install triton=={version} from PyPI for the kernel "
                                    f"cache: {tail[0]}")
                if final.exists():
                    shutil.rmtree(final)
                os.rename(staging, final)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            found = _find(version, [str(final)])
            if found is None:
                raise KilnError(f"{final}: triton=={version} installed but its dist-info is not readable")
    return found
