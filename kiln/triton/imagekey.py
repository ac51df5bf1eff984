"""The Triton cache key of the image's own Triton, for kernels compiled with kiln's toolchain.

Public API:
    RuntimeKey(libtriton_sha256, toolchain_libtriton_sha256, problem)
        ``.substitutes`` whether the worker keys entries with another libtriton.so than its own
    runtime_key(image_record, toolchain_record, image_python, toolchain_python, sources) -> RuntimeKey
    platform_key(image_record, platform_record, toolchain_record, sources, platform_wheel) -> RuntimeKey
                                               an image of another machine than the host's
                                               (``platformwheel.py``): its Triton must be that
                                               platform's PyPI wheel, the wheel the host's source
    compared_files(sources, paths) -> set[str]  the Triton files that must be the toolchain's
    record_hashes(text) -> dict[str, str]      a dist-info RECORD: path -> sha256 (hex)
    LIBTRITON                                  "triton/_C/libtriton.so"

Why: Triton finds a compiled kernel under a key that starts with ``triton_key()``: its version
and the sha256 of the files it reads, decided from that version's own source
(``keyfiles.py``: ``runtime/cache.py``, the modules under ``compiler/``, ``backends/`` and
``language/``, ``_C/libtriton.so`` in 3.6.0 and 3.8.0). The wheels of one Triton release for
different Pythons hold the same Python files, ptxas and libdevice, but each its own
libtriton.so and other native libraries (built against that Python's ABI; 3.8.0's also differ in
``plugins/`` and ``instrumentation/``, which ``triton_key()`` does not read). kiln compiles in
its own interpreter, with the wheel for that Python; the image runs its Python (3.12 in vLLM's
images). So the worker is given the image's libtriton.so hash, read from the RECORD of the
Triton installed in the image, and keys every entry with it: the compiler is the same source,
the key is the one the image's Triton computes.

That holds only when every other file the key is made of is the wheel's: the files
``triton_key()`` reads, and the other files under the directories it walks (native libraries
apart: the backend's hash runs its ``ptxas --version``, the options' hash hashes its libdevice,
and they make the cubins). Those are compared with the toolchain's RECORD, file by file; files
elsewhere may differ. A Triton built from source, a vendor build of the same version or a
patched install differs there: its kernels would be keyed differently and never found, so
``problem`` says why and the build stops (or leaves the layer out when told to). An image
without Triton's RECORD cannot be checked at all (same outcome).
"""

from __future__ import annotations

import base64
import csv
import io
import posixpath
import re
from dataclasses import dataclass

from kiln.errors import KilnError
from kiln.triton.keyfiles import KeySources

LIBTRITON = "triton/_C/libtriton.so"
_SHOWN = 3  # differing files named in a problem
_NATIVE = re.compile(r"\.so(\.[^/]*)?$")  # libcupti.so, libcupti.so.13
_MACHINE = re.compile(r"/bin/[^/]+$|\.a$")  # executables, static archives: built per machine


@dataclass(frozen=True)
class RuntimeKey:
    libtriton_sha256: str | None  # what the image's Triton hashes into its key; None: unknown
    toolchain_libtriton_sha256: str  # what the toolchain's Triton hashes
    problem: str | None = None  # why the image's Triton will not find the entries (None: it will)

    @property
    def substitutes(self) -> bool:
        return self.libtriton_sha256 is not None and self.libtriton_sha256 != self.toolchain_libtriton_sha256


def record_hashes(text: str) -> dict[str, str]:
    """``path -> sha256 hex`` for every RECORD row with a sha256 (``.pyc`` rows carry none)."""
    hashes = {}
    for row in csv.reader(io.StringIO(text)):
        if len(row) < 2 or not row[1].startswith("sha256="):
            continue
        digest = row[1][len("sha256="):]
        raw = base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4))
        hashes[row[0]] = raw.hex()
    return hashes


def compared_files(sources: KeySources, paths: set[str]) -> set[str]:
    """The files of ``paths`` that must be the toolchain's: what ``triton_key()`` reads, and the
    rest of the directories it walks but native libraries (``*.so``, ``*.so.N``)."""
    walked = {p for p in paths if any(p.startswith(root + "/") for root in sources.walked)
              and not _NATIVE.search(posixpath.basename(p))}
    return sources.files(paths) | walked


def runtime_key(image_record: str | None, toolchain_record: str, image_python: str | None,
                toolchain_python: str, sources: KeySources) -> RuntimeKey:
    """How to key kernels for the image's Triton, described by its RECORD (None: not found)."""
    ours = record_hashes(toolchain_record)
    own = ours.get(LIBTRITON)
    if own is None:
        raise KilnError(f"the Triton toolchain's RECORD lists no {LIBTRITON}: kiln cannot tell its cache key")
    if image_record is None:
        if image_python in (None, toolchain_python):
            return RuntimeKey(own, own)  # nothing to compare: assumed to be the same wheel
        return RuntimeKey(None, own, f"the image's Triton has no RECORD, so the key its libtriton.so gives under "
                                     f"Python {image_python} is unknown (kiln runs Python {toolchain_python})")
    theirs = record_hashes(image_record)
    if sources.extension != LIBTRITON:
        raise KilnError(f"Triton's triton_key() hashes {sources.extension}; kiln keys for the image's {LIBTRITON} only")
    if LIBTRITON not in theirs:
        return RuntimeKey(None, own, f"the image's Triton RECORD lists no {LIBTRITON}")
    paths = compared_files(sources, set(ours) | set(theirs)) - {sources.extension}
    differing = sorted(p for p in paths if ours.get(p) != theirs.get(p))
    if differing:
        shown = ", ".join(differing[:_SHOWN]) + (f" and {len(differing) - _SHOWN} more" if len(differing) > _SHOWN else "")
        return RuntimeKey(None, own, f"the image's Triton is not the PyPI wheel kiln compiles with: "
                                     f"{len(differing)} file(s) differ ({shown})")
    return RuntimeKey(theirs[LIBTRITON], own)


def _differ(ours: dict[str, str], theirs: dict[str, str], paths: set[str]) -> str | None:
    differing = sorted(p for p in paths if ours.get(p) != theirs.get(p))
    if not differing:
        return None
    shown = ", ".join(differing[:_SHOWN]) + (f" and {len(differing) - _SHOWN} more" if len(differing) > _SHOWN else "")
    return f"{len(differing)} file(s) differ ({shown})"


def platform_key(image_record: str | None, platform_record: str, toolchain_record: str, sources: KeySources,
                 platform_wheel: str) -> RuntimeKey:
    """How to key kernels for an image of another machine (``platform_record``: the RECORD of the
    PyPI wheel ``platform_wheel`` of its Triton for its Python and machine, sha256-checked).

    The image's Triton must be that wheel on every file the key is made of, ``libtriton.so`` and
    the ptxas binaries too (their ``--version`` text keys the backend: ``platformwheel.py``); and
    that wheel the host's toolchain on all of them but what is built per machine (``libtriton.so``,
    native libraries, executables, static archives): the same compiler source and libdevice."""
    ours, wheel = record_hashes(toolchain_record), record_hashes(platform_record)
    own = ours.get(LIBTRITON)
    if own is None:
        raise KilnError(f"the Triton toolchain's RECORD lists no {LIBTRITON}: kiln cannot tell its cache key")
    if sources.extension != LIBTRITON:
        raise KilnError(f"Triton's triton_key() hashes {sources.extension}; kiln keys for the image's {LIBTRITON} only")
    if image_record is None:
        return RuntimeKey(None, own, f"the image's Triton has no RECORD, so kiln cannot tell it is {platform_wheel}")
    theirs = record_hashes(image_record)
    walked = compared_files(sources, set(wheel) | set(theirs))
    machine = {p for p in set(wheel) | set(theirs) | set(ours)
               if any(p.startswith(root + "/") for root in sources.walked) and _MACHINE.search(p)}
    if LIBTRITON not in theirs:
        return RuntimeKey(None, own, f"the image's Triton RECORD lists no {LIBTRITON}")
    if problem := _differ(wheel, theirs, walked | machine | {LIBTRITON}):
        return RuntimeKey(None, own, f"the image's Triton is not the PyPI wheel {platform_wheel}: {problem}")
    same_source = compared_files(sources, set(ours) | set(wheel)) - machine - {LIBTRITON}
    if problem := _differ(ours, wheel, same_source):
        return RuntimeKey(None, own, f"{platform_wheel} is not the compiler kiln compiles with: {problem}")
    return RuntimeKey(theirs[LIBTRITON], own)
