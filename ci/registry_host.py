"""A docker-registry process and the real vLLM wheel: what ci/bench_build.py and kiln's registry
tests (``tests/support/registry.py``, which imports this) both stand up.

Independent tools only (docker-registry, skopeo, GNU tar, pip), never kiln's own OCI code.

Public API:
    VLLM_VERSION, SITE, BASE_REPO, TOOLS, TRITON_CP312_RECORD
    missing_tools() -> list[str]
    free_port() -> int
    run(*cmd, cwd=None) -> str                      stdout; RuntimeError on failure
    tar(src, out) -> Path                           a reproducible tar of ``src``'s contents
    RegistryServer                                  .host .url .mirror .push() .digest_of() .log() .stop()
    dies_with_us() -> preexec_fn                    the child is SIGKILLed when this process dies
    start_registry_server(root, auth="", ...) -> RegistryServer   a docker-registry on a free port
    fetch_vllm_wheel(wheels, arch, version) -> Path the real wheel, pip-downloaded once into ``wheels``
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from kiln.lifeline import child_of

REPO_ROOT = Path(__file__).resolve().parent.parent

VLLM_VERSION = "0.20.1"
SITE = "usr/local/lib/python3.12/dist-packages"
BASE_REPO = "vllm/vllm-openai"
# the manylinux tags of vLLM's wheels for each machine architecture, as PyPI lists them (0.20.1's
# ``manylinux_2_35``, 0.33.0's ``manylinux_2_28``): pip expands no custom --platform to older glibcs
WHEEL_PLATFORMS = {arch: (f"manylinux_2_35_{arch}", f"manylinux_2_28_{arch}") for arch in ("x86_64", "aarch64")}
TOOLS = ("docker-registry", "skopeo", "umoci", "openssl", "htpasswd", "busybox", "tar")
# The RECORD of Triton 3.6.0's cp312 wheel (what vLLM's images install): a data file of the tests'
# (tests/support/registry.py says where it was copied from), read, not imported.
TRITON_CP312_RECORD = REPO_ROOT / "tests" / "support" / "triton-3.6.0-cp312.RECORD"


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(*cmd: str | Path, cwd: Path | None = None) -> str:
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({result.returncode}): {result.stderr[-2000:]}")
    return result.stdout


def tar(src: Path, out: Path) -> Path:
    run("tar", "--sort=name", "--owner=0", "--group=0", "--numeric-owner", "--format=pax",
        "--mtime=2024-01-01T00:00:00Z", "-C", src, "-cf", out, ".")
    return out


@dataclass
class RegistryServer:
    flavour: str  # "plain", "basic", "token"
    host: str  # "127.0.0.1:PORT"
    root: Path
    pid: int
    token_server: object | None = None  # has .stop()
    username: str | None = None
    password: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    @property
    def mirror(self) -> str:
        """The ``--mirror`` option making this registry stand in for Docker Hub."""
        return f"docker.io=http://{self.host}"

    def blob_file(self, digest: str) -> Path:
        """Where the filesystem driver keeps a blob (tests corrupt it to check verification)."""
        hexdigest = digest.split(":", 1)[1]
        return self.root / "data/docker/registry/v2/blobs/sha256" / hexdigest[:2] / hexdigest / "data"

    def log(self) -> str:
        return (self.root / "log.txt").read_text(errors="replace")

    def skopeo_creds(self, direction: str) -> list[str]:
        flags = [f"--{direction}-tls-verify=false"]
        if self.username:
            flags.append(f"--{direction}-creds={self.username}:{self.password}")
        return flags

    def push(self, source: str, name: str, *extra: str) -> None:
        run("skopeo", "copy", "--quiet", *self.skopeo_creds("dest"), *extra, source, f"docker://{self.host}/{name}")

    def digest_of(self, name: str) -> str:
        """The manifest digest as skopeo (not kiln) sees it: sha256 of the raw manifest bytes."""
        flags = ["--tls-verify=false"] + ([f"--creds={self.username}:{self.password}"] if self.username else [])
        result = subprocess.run(["skopeo", "inspect", "--raw", *flags, f"docker://{self.host}/{name}"],
                                capture_output=True, check=True)
        return "sha256:" + hashlib.sha256(result.stdout).hexdigest()

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGTERM)
            for _ in range(50):
                if reaped(self.pid):
                    break
                time.sleep(0.1)
            else:
                os.kill(self.pid, signal.SIGKILL)
                reaped(self.pid)
        except ProcessLookupError:
            pass
        if self.token_server:
            self.token_server.stop()


def reaped(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == pid
    except ChildProcessError:
        return True


def start_registry_server(root: Path, auth: str = "", token_server=None, user: str | None = None,
                          password: str | None = None, copy_from: RegistryServer | None = None,
                          port: int | None = None) -> RegistryServer:
    """docker-registry serving ``root/data`` (``copy_from``'s storage copied in) with the ``auth``
    section of its config (YAML, "" for none), waited for until it answers."""
    root.mkdir(parents=True, exist_ok=True)
    if copy_from:
        shutil.copytree(copy_from.root / "data", root / "data")
    else:
        (root / "data").mkdir(exist_ok=True)
    port = port or free_port()
    flavour = "token" if token_server else "basic" if user else "plain"
    (root / "config.yml").write_text(
        "version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: false\n"
        f"storage:\n  filesystem:\n    rootdirectory: {root}/data\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n{auth}"
    )
    with open(root / "log.txt", "wb") as log:
        process = subprocess.Popen(["docker-registry", "serve", str(root / "config.yml")],
                                   stdout=log, stderr=subprocess.STDOUT, preexec_fn=dies_with_us())
    server = RegistryServer(flavour, f"127.0.0.1:{port}", root, process.pid, token_server, user,
                            password if user else None)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"docker-registry exited: {server.log()[-2000:]}")
        try:
            requests.get(f"{server.url}/v2/", timeout=1)
            return server
        except requests.RequestException:
            time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"docker-registry did not answer on {server.host}: {server.log()[-2000:]}")


def dies_with_us():
    """A ``preexec_fn``: the server is killed when this test process dies, even by SIGKILL (a
    pytest run that is killed leaves no registry behind; ``kiln.lifeline`` does the same for
    kiln's own children)."""
    return functools.partial(child_of, os.getpid())


def fetch_vllm_wheel(wheels: Path, arch: str = "x86_64", version: str = VLLM_VERSION) -> Path:
    """vLLM ``version``'s real wheel for ``arch`` (``x86_64`` or ``aarch64``), downloaded once with
    pip into ``wheels`` (reused across runs; pip checks it against the index's sha256)."""
    if arch not in WHEEL_PLATFORMS:
        raise ValueError(f"no vLLM wheel platform for {arch!r}: one of {', '.join(WHEEL_PLATFORMS)}")
    found = sorted(wheels.glob(f"vllm-{version}-*_{arch}.whl"))
    if found:
        return found[0]
    wheels.mkdir(parents=True, exist_ok=True)
    staging = wheels / f".tmp-{os.getpid()}-{version}-{arch}"
    try:
        # --platform: the aarch64 wheel is fetched on an x86_64 machine (nothing of it runs here)
        platforms = [flag for tag in WHEEL_PLATFORMS[arch] for flag in ("--platform", tag)]
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *platforms,
                        "--python-version", "3.12", f"vllm=={version}", "-d", str(staging)],
                       check=True, capture_output=True)
        wheel = next(staging.glob(f"vllm-{version}-*_{arch}.whl"))
        os.replace(wheel, wheels / wheel.name)
        return wheels / wheel.name
    except (subprocess.CalledProcessError, StopIteration) as err:
        raise RuntimeError(f"cannot download vllm=={version} ({arch}) with pip: {err}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
