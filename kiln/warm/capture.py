"""What a warm boot wrote, as files of one more layer, and the bundle that carries them to a build.

vLLM's compile cache records the absolute paths it was made under (vllm#52154: a cache made in
``/home/me/.cache/vllm`` and copied elsewhere misses, or worse, points at files that are not
there). The warm step therefore boots the image in its own file system (a chroot or a container)
with the caches at their image paths (``/opt/kiln/warm/…``), so every path they record is the
one they have at run time; ``capture`` then refuses, in one line, any file that names the warm
host's own paths (the rootfs as the host sees it, the host's name when it is long enough to
search for) rather than bake a cache that only works on the machine that made it.

A bundle is a folder: ``warm.json`` (the key, its factors, what booted, each file's sha256) and
``files/<image path>``; ``read_bundle`` checks every file against the record.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from kiln.errors import KilnError
from kiln.image.warmlayer import WARM_ROOT

RECORD = "warm.json"
# Left out: locks and half-written temporaries of the compilers (no reader needs them)
_SKIP_SUFFIXES = (".lock", ".tmp")
HOSTNAME_MIN = 8  # a shorter host name ("vm") occurs by chance in compiled code: not searched for


def capture(rootfs: Path, host_paths: list[str], hostname: str = "") -> dict[str, bytes]:
    """Every file under the rootfs's warm root, by image path; refused if one names the warm host."""
    root = rootfs / WARM_ROOT
    if not root.is_dir():
        raise KilnError(f"{root}: the warm boot wrote no cache (is VLLM_CACHE_ROOT set to /{WARM_ROOT}/vllm?)")
    needles = [p.encode() for p in sorted(set(host_paths)) if p and p != "/"]
    if len(hostname) >= HOSTNAME_MIN:
        needles.append(hostname.encode())
    files: dict[str, bytes] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(rootfs).as_posix()
        if path.is_symlink():
            raise KilnError(f"/{rel}: a symbolic link in the warm cache (to {os.readlink(path)}); kiln bakes files only")
        if not path.is_file() or path.name.endswith(_SKIP_SUFFIXES):
            continue
        data = path.read_bytes()
        for needle in needles:
            if needle in data:
                raise KilnError(f"/{rel}: names the warm host's {needle.decode()!r} (vllm#52154: a cache that "
                                f"records where it was made); warm the image in its own file system")
        files[rel] = data
    if not files:
        raise KilnError(f"/{WARM_ROOT}: the warm boot wrote no file")
    return files


def write_bundle(out: Path, files: dict[str, bytes], record: dict) -> dict:
    """``out/warm.json`` and ``out/files/…``; ``out`` must be new or empty. The record, completed."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise KilnError(f"--out {out}: not a new or empty folder")
    staged = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(staged, ignore_errors=True)
    for rel, data in files.items():
        target = staged / "files" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    record = dict(record, files={rel: hashlib.sha256(data).hexdigest() for rel, data in sorted(files.items())},
                  bytes=sum(map(len, files.values())))
    (staged / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    if out.exists():
        out.rmdir()
    staged.rename(out)
    return record


def read_bundle(folder: Path) -> tuple[dict, dict[str, bytes]]:
    """The bundle's record and files, each file checked against the record's sha256."""
    try:
        record = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError) as err:
        raise KilnError(f"--warm {folder}: no readable {RECORD} ({err})") from None
    files = {}
    listed = record.get("files") or {}
    on_disk = {p.relative_to(folder / "files").as_posix() for p in (folder / "files").rglob("*") if p.is_file()}
    if on_disk != set(listed):
        extra = sorted(on_disk ^ set(listed))[0]
        raise KilnError(f"--warm {folder}: files/{extra} is not as {RECORD} lists the files")
    for rel, sha in sorted(listed.items()):
        data = (folder / "files" / rel).read_bytes()
        if not rel.startswith(f"{WARM_ROOT}/") or hashlib.sha256(data).hexdigest() != sha:
            raise KilnError(f"--warm {folder}: files/{rel} does not match its sha256 in {RECORD}")
        files[rel] = data
    return record, files

