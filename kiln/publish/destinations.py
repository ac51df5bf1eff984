"""Where an output may go: never onto or into what kiln reads, never a special file, never
inside another OCI layout, never where another output of the same command goes.

Public API:
    Input(path, what, directory)     one path a command reads
    command_inputs(files=None, registries=None, cache=None) -> list[Input]
        every input kiln reads: the pins file, the verdict record, the image definitions (the
        directory and each file), the patch catalogue, the registries file, the registry auth
        file, kiln's cache and Triton toolchains, and the parts of kiln's own checkout it reads
    check_output_path(path, option, directory, inputs=()) -> Path     resolved, checked
    check_distinct(outputs)          ``[(option, resolved path)]``: no two in one place
    check_stdout(stream, inputs)     standard output redirected onto an input is refused

Paths are compared resolved (symlinks followed, relative made absolute) and, where both exist,
by inode, so a hard link to the pins file is the pins file. An output is refused when it is an
input, lies inside an input directory, or would hold one (a directory output around an input).
Inputs are listed whether or not they exist yet: a values file written where the registries file
is looked for would be read as the registries file by the next command.

An existing output must be a regular file (a directory for a directory output): a device, FIFO
or socket is refused before anything opens it (opening a FIFO blocks until a writer comes,
``/dev/zero`` never ends). An output inside an OCI layout other than its own is refused: a
layout holds its blobs and index, and another image's ``index.json`` is not a file to replace.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kiln import paths
from kiln.cache import cache_dir
from kiln.errors import KilnError
from kiln.oci.containers_conf import registries_conf_files
from kiln.oci.credentials import auth_file
from kiln.oci.endpoints import default_config_path
from kiln.staging import remove_dead_stages, stage_file

LAYOUT_MARKER = "oci-layout"
# What kiln reads from its own checkout (the code, the data, what a build copies or records):
# a command writing there would change the next command's kiln.
CHECKOUT_INPUTS = {"kiln": "kiln's own code", "patchsets": "kiln's patch catalogue", "images": "kiln's image definitions",
                   "pins.toml": "kiln's own pins.toml", "Dockerfile": "kiln's own Dockerfile",
                   "build.py": "kiln's own build.py", "pyproject.toml": "kiln's own pyproject.toml",
                   ".git": "kiln's git repository"}
_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


@dataclass(frozen=True)
class Input:
    path: Path  # resolved
    what: str  # "kiln's pins file", for the refusal
    directory: bool = False


def command_inputs(files: paths.RepoFiles | None = None, registries: Path | None = None,
                   cache: Path | None = None) -> list[Input]:
    """Every path a command reads, the most specific first (it names the refusal)."""
    files = files or paths.RepoFiles()
    found = [Input(_resolved(files.pins), "kiln's pins file"),
             Input(_resolved(files.record), "kiln's verdict record")]
    images = _resolved(files.images)
    if images.is_dir():
        found += [Input(_resolved(p), "an image definition") for p in sorted(images.glob("*.toml"))]
    found += [Input(images, "the image definitions directory", True),
              Input(_resolved(files.patchsets), "the patch catalogue", True),
              Input(_resolved(registries or default_config_path()), "the registries file")]
    found += [Input(_resolved(p), "containers' registries.conf") for p in registries_conf_files()]
    auth = auth_file()
    if auth is not None:
        found.append(Input(_resolved(auth), "the registry auth file"))
    found.append(Input(_resolved(cache or cache_dir()), "kiln's cache", True))
    shared = os.environ.get("KILN_TRITON_TOOLCHAINS")
    if shared:
        found.append(Input(_resolved(Path(shared)), "kiln's Triton toolchains", True))
    for name, what in CHECKOUT_INPUTS.items():
        part = paths.REPO / name
        if part.exists():
            found.append(Input(_resolved(part), what, part.is_dir()))
    return found


def _resolved(path: Path) -> Path:
    try:
        return path.expanduser().resolve()
    except (OSError, RuntimeError):  # a symlink loop: compared as written, made absolute
        return path.expanduser().absolute()


def _kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def check_output_path(path: Path, option: str, directory: bool, inputs: Sequence[Input] = ()) -> Path:
    """``path`` resolved, after checking it may be written and can be renamed into place.

    Refused: an existing path of the wrong kind (a file output must be a regular file, a
    directory output a directory), a path that is or touches an input, a path inside an OCI
    layout (other than the output's own). The nearest existing ancestor must be a directory kiln
    can create and rename entries in (tested with a throw-away file there, removed at once).
    Dead staging leftovers of killed runs beside ``path`` are removed.
    """
    resolved = _resolved(path)
    ancestor = resolved.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise KilnError(f"{option} {path}: {ancestor} is not a directory")
    try:
        mode = os.stat(resolved).st_mode  # never opened: a FIFO would block, a device never end
    except FileNotFoundError:
        mode = None
    except OSError as err:
        raise KilnError(f"{option} {path}: cannot be examined ({err.strerror})") from None
    if mode is not None:
        if directory and not stat.S_ISDIR(mode):
            raise KilnError(f"{option} {path}: exists and is not a directory ({_kind(mode)})")
        if not directory and stat.S_ISDIR(mode):
            raise KilnError(f"{option} {path}: is a directory; a file path is expected")
        if not directory and not stat.S_ISREG(mode):
            raise KilnError(f"{option} {path}: is {_kind(mode)}, not a regular file; kiln writes only "
                            "regular files (or creates a new one)")
    _check_not_an_input(resolved, f"{option} {path}", inputs)
    layout = next((a for a in resolved.parents if (a / LAYOUT_MARKER).exists()), None)
    if layout is not None:
        raise KilnError(f"{option} {path}: is inside the OCI layout {layout}, which holds only its own blobs "
                        "and index; choose another path")
    try:
        probe = stage_file(ancestor / resolved.name)
        try:
            os.rename(probe, probe.with_name(probe.name + "x"))
            probe = probe.with_name(probe.name + "x")
        finally:
            probe.unlink(missing_ok=True)
    except OSError as err:
        raise KilnError(f"{option} {path}: cannot write in {ancestor} ({err.strerror})") from None
    if resolved.parent.is_dir():
        remove_dead_stages(resolved.parent)
    return resolved


def _same(a: Path, b: Path) -> bool:
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _check_not_an_input(resolved: Path, named: str, inputs: Sequence[Input]) -> None:
    for source in inputs:  # exact matches first: "is the pins file" beats "is inside the checkout"
        if _same(resolved, source.path):
            raise KilnError(f"{named}: is {source.what} (an input); choose another path")
    for source in inputs:
        if source.directory and source.path in resolved.parents:
            raise KilnError(f"{named}: is inside {source.what} {source.path} (an input); choose another path")
        if resolved in source.path.parents:
            raise KilnError(f"{named}: would hold {source.what} {source.path} (an input); choose another path")


def check_distinct(outputs: Iterable[tuple[str, Path]]) -> None:
    """No two outputs of one command write the same place (or one inside the other)."""
    outputs = list(outputs)
    for i, (first_option, a) in enumerate(outputs):
        for second_option, b in outputs[i + 1:]:
            if _same(a, b) or a in b.parents or b in a.parents:
                raise KilnError(f"{first_option} {a} and {second_option} {b}: two outputs of one command "
                                "cannot write the same place")


def check_stdout(stream, inputs: Sequence[Input]) -> None:
    """Refuse a standard output (``stream``) redirected onto (or appended to) a file kiln reads.

    The shell opened it before kiln started (``>`` has already emptied it, and the error then
    says so); what kiln can still prevent is writing its output into the input."""
    try:
        fd = stream.fileno()
        info = os.fstat(fd)
    except (AttributeError, OSError, ValueError):  # not a file (captured, closed): nothing to check
        return
    if not stat.S_ISREG(info.st_mode):
        return
    try:
        where = Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        where = None
    for source in inputs:
        try:
            known = os.stat(source.path)
        except OSError:
            continue
        inside = where is not None and source.directory and source.path in where.parents
        if (known.st_dev, known.st_ino) == (info.st_dev, info.st_ino) or inside:
            emptied = " (it is empty now: a '>' redirection empties the file before kiln starts; restore it " \
                "from git or a backup)" if info.st_size == 0 and not inside else ""
            raise KilnError(f"standard output {where or 'file'}: is {'inside ' if inside else ''}{source.what} "
                            f"(an input){emptied}; redirect the output elsewhere")
