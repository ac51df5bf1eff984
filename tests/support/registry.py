"""Real-registry fixtures: ``docker-registry`` processes and a vLLM-shaped base image.

Everything here uses independent tools (docker-registry, umoci, skopeo, GNU tar, openssl,
PyJWT) and never kiln's own OCI code, so the tests check kiln against the real thing.

Fixtures (all session-scoped; re-exported by ``tests/oci/conftest.py``):
    vllm_wheel        Path of the real vllm 0.20.1 wheel (pip-downloaded once into the kiln
                      cache's ``test-assets/wheels``; outside this session's KILN_CACHE_DIR)
    base_layout       BaseLayout: OCI layout built with umoci (tags ``base``, ``overlay``, ``index``)
                      plus the facts tests assert (layer digests by role, the overlay's edits)
    registry_plain    RegistryServer, no auth, holding every fixture image
    registry_basic    RegistryServer, htpasswd Basic auth (testuser/testpass), holding ``base``
    registry_token    RegistryServer, Bearer tokens from a TokenServer (anonymous: pull;
                      testuser/testpass: pull+push), holding ``base``
    start_registry    factory(flavour="plain", copy_from=None, password=PASSWORD) -> RegistryServer,
                      stopped at session end; ``copy_from`` clones another server's storage (for
                      tests that corrupt blobs); ``password`` is testuser's (basic and token)

Images, under the real Docker Hub name so a mirror ``docker.io=<host>`` stands in for Hub:
    vllm/vllm-openai:v0.20.1          rootfs, filler-cuda, filler-torch, vllm, app (top)
    vllm/vllm-openai:v0.20.1-overlay  rootfs, filler-cuda, filler-torch, vllm, overlay
    vllm/vllm-openai:v0.20.1-docker   ``base`` converted to Docker v2 schema 2 by skopeo
    vllm/vllm-openai:v0.20.1-index    OCI index: attestation (unknown/unknown), linux/arm64
                                      (no vLLM), linux/amd64 (= ``base``)
    vllm/vllm-openai:v0.20.1-multi    OCI index: linux/amd64 (= ``base``), linux/arm64 (``base``'s layers
                                      under an arm64 config, by umoci, but for vLLM's: the real
                                      aarch64 wheel's files and dist-info): a two-platform base
    vllm/vllm-openai:v0.20.1-triton36 ``base`` + a layer replacing triton 3.5.0's dist-info with
                                      3.6.0's (the Triton the test toolchain runs), whose RECORD
                                      is the real cp312 wheel's (``TRITON_CP312_RECORD``)
    vllm/vllm-openai:v0.20.1-multi36  OCI index: linux/amd64 (= ``triton36``), linux/arm64 (``multi``'s arm64
                                      half + a layer with Triton 3.6.0's real aarch64 cp312 dist-info,
                                      ``TRITON_CP312_AARCH64_RECORD``): a two-platform base with kernels
    vllm/vllm-openai:v0.20.1-triton38 the same with Triton 3.8.0's real cp312 dist-info (vLLM 0.33.0's)
    vllm/vllm-openai:v0.20.1-tritonvendor  the same as triton36 with triton/language/core.py's hash
                                      changed: a Triton that is not the PyPI wheel
    vllm/vllm-openai:v0.20.1-notriton ``base`` + a layer whiting out triton's dist-info
    vllm/vllm-openai:nightly-<sha>    nightly-shaped: ``base`` + a layer replacing vLLM's dist-info by
                                      one carrying the dev version ``NIGHTLY_VERSION`` (no wheel on
                                      PyPI has it) and rewriting ``vllm/_version.py`` (plain only)
    test/no-vllm:1                    rootfs + filler-cuda only (plain registry only)
registry_basic and registry_token hold only ``vllm/vllm-openai:v0.20.1``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
import shutil
import threading
import time
import uuid
import zipfile
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

# the registry process and the wheel, shared with ci/bench_build.py (which imports no tests/);
# ci/ is on the tests' path (tests/__init__.py)
from registry_host import (  # noqa: F401  (re-exported: the registry tests import them from here)
    BASE_REPO,
    SITE,
    TOOLS,
    VLLM_VERSION,
    RegistryServer,
    dies_with_us,
    free_port,
    missing_tools,
    run,
    start_registry_server,
)
from registry_host import fetch_vllm_wheel as _fetch_vllm_wheel
from registry_host import tar as _tar

from kiln.cache import cache_root

# A nightly build's version, as vLLM's nightly images carry one (0.20.1's files under it).
NIGHTLY_VERSION = "0.20.2rc1.dev424+g3f5a1e173"
NIGHTLY_TAG = "nightly-3f5a1e1733200760169ff31ebe60a271072b199e"
NIGHTLY_MARK = "# kiln fixture: a nightly build's own file"
# The RECORD of Triton 3.6.0's wheel for CPython 3.12 (what vLLM's images install), copied out of
# triton-3.6.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl from PyPI, sha256
# 74caf5e34b66d9f3a429af689c1c7128daba1d8208df60e81106b115c00d6fca.
TRITON_CP312_RECORD = Path(__file__).with_name("triton-3.6.0-cp312.RECORD")
# The same for every Triton the pins' images carry (torch 2.14.0 in vLLM 0.33.0 requires
# triton~=3.8.0): 3.8.0's RECORD copied out of
# triton-3.8.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl from PyPI, sha256
# e91ffa46d095b252248297292dd22bcbacd53a125a0c2eefbbbf74925a320bc3.
# The RECORD of triton-3.6.0-cp312-cp312-manylinux_2_27_aarch64.manylinux_2_28_aarch64.whl from PyPI,
# sha256 374f52c11a711fd062b4bfbb201fd9ac0a5febd28a96fb41b4a0f51dde3157f4 (an arm64 image's Triton).
TRITON_CP312_AARCH64_RECORD = Path(__file__).with_name("triton-3.6.0-cp312-aarch64.RECORD")
TRITON_CP312_RECORDS = {"3.6.0": TRITON_CP312_RECORD,
                        "3.8.0": Path(__file__).with_name("triton-3.8.0-cp312.RECORD")}
# And the RECORDs of the cp311 wheels of both (kiln on Python 3.11 compiles with those), copied out of
# triton-3.6.0-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl, sha256
# e8e323d608e3a9bfcc2d9efcc90ceefb764a82b99dea12a86d643c72539ad5d3, and
# triton-3.8.0-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl, sha256
# 68988ac85d5e7086baeda0ddc175af9667db7529b3c5e11a5c0601b8bef2200a.
TRITON_CP311_RECORDS = {version: Path(__file__).with_name(f"triton-{version}-cp311.RECORD")
                        for version in ("3.6.0", "3.8.0")}
REPO = BASE_REPO
USER, PASSWORD = "testuser", "testpass"

# Resolved at import, before any test points KILN_CACHE_DIR at a temporary directory.
_ASSETS = cache_root() / "test-assets"
# A kiln cache holding only Triton toolchains (``triton/toolchains/``), shared by every test and
# session so each Triton version is fetched once; isolated tests link their cache's to it.
TOOLCHAIN_CACHE = _ASSETS / "toolchain-cache"


def require_tools() -> None:
    missing = missing_tools()
    if missing:
        # ci/test installs them; a missing tool is a broken environment, never a pass
        pytest.fail(f"registry tools missing: {', '.join(missing)} (run ci/test, which installs them)")


# -- token server --------------------------------------------------------------------------------


@dataclass
class TokenServer:
    """A minimal distribution token service: RS256 JWTs carrying the cert in ``x5c``."""

    port: int
    key_pem: bytes
    cert_der: bytes
    service: str = "test-registry"
    issuer: str = "test-issuer"
    password: str = PASSWORD  # testuser's
    requests_seen: list[dict] = field(default_factory=list)
    issued: list[str] = field(default_factory=list)  # every token handed out (tests grep for leaks)
    _server: ThreadingHTTPServer | None = None

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def start(self) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_GET(self):  # noqa: N802 (http.server's naming)
                owner._answer(self)

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()

    def _answer(self, handler: BaseHTTPRequestHandler) -> None:
        import jwt  # PyJWT, a test dependency

        query = parse_qs(urlsplit(handler.path).query)
        scopes = [s for value in query.get("scope", []) for s in value.split()]
        user = None
        header = handler.headers.get("Authorization", "")
        if header.startswith("Basic "):
            user, _, password = base64.b64decode(header[6:]).decode().partition(":")
            if (user, password) != (USER, self.password):
                self.requests_seen.append({"scopes": scopes, "user": user, "ok": False})
                handler.send_response(401)
                handler.send_header("Content-Type", "application/json")
                handler.end_headers()
                handler.wfile.write(b'{"details":"wrong credentials"}')
                return
        access = []
        for scope in scopes:
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            granted = [a for a in actions.split(",") if user == USER or a == "pull"]
            access.append({"type": kind, "name": name, "actions": granted})
        self.requests_seen.append({"scopes": scopes, "user": user, "ok": True})
        now = int(time.time())
        claims = {"iss": self.issuer, "sub": user or "", "aud": self.service, "exp": now + 300,
                  "nbf": now - 10, "iat": now, "jti": uuid.uuid4().hex, "access": access}
        x5c = [base64.b64encode(self.cert_der).decode()]
        token = jwt.encode(claims, self.key_pem, algorithm="RS256", headers={"x5c": x5c})
        self.issued.append(token)
        body = json.dumps({"token": token, "access_token": token, "expires_in": 300,
                           "issued_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))}).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)


# -- registry processes -------------------------------------------------------------------------


def start_registry_process(root: Path, flavour: str = "plain", copy_from: RegistryServer | None = None,
                           password: str = PASSWORD) -> RegistryServer:
    root.mkdir(parents=True, exist_ok=True)
    auth, token_server, user = "", None, None
    if flavour == "basic":
        run("htpasswd", "-Bbc", root / "htpasswd", USER, password)
        auth = f"auth:\n  htpasswd:\n    realm: basic-realm\n    path: {root}/htpasswd\n"
        user = USER
    elif flavour == "token":
        run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", root / "key.pem",
            "-out", root / "cert.pem", "-days", "2", "-subj", "/CN=test-issuer",
            "-addext", "basicConstraints=critical,CA:TRUE")
        cert_der = base64.b64decode("".join(
            line for line in (root / "cert.pem").read_text().splitlines() if not line.startswith("-----")))
        token_server = TokenServer(free_port(), (root / "key.pem").read_bytes(), cert_der, password=password)
        token_server.start()
        auth = (f"auth:\n  token:\n    realm: {token_server.realm}\n    service: {token_server.service}\n"
                f"    issuer: {token_server.issuer}\n    rootcertbundle: {root}/cert.pem\n")
        user = USER
    elif flavour != "plain":
        raise ValueError(flavour)
    return start_registry_server(root, auth, token_server, user, password, copy_from)


# -- the base image -----------------------------------------------------------------------------


def fetch_vllm_wheel(arch: str = "x86_64", version: str = VLLM_VERSION) -> Path:
    """vLLM ``version``'s real wheel of ``arch``, downloaded once with pip into the kiln cache
    (reused across sessions)."""
    try:
        return _fetch_vllm_wheel(_ASSETS / "wheels", arch, version)
    except RuntimeError as err:
        pytest.fail(str(err))


@dataclass
class BaseLayout:
    path: Path  # OCI layout (umoci) holding tags stem, base, overlay, novllm, arm64, index
    layers: dict[str, str]  # role -> layer digest (compressed): rootfs, filler-cuda, filler-torch, vllm, app, overlay
    layer_sizes: dict[str, int]
    wheel_files: dict[str, bytes]  # "vllm/..." .py path relative to site dir -> bytes (from the wheel)
    overridden: str  # vllm-relative path the overlay replaces
    override_bytes: bytes
    whited_out: str  # vllm-relative path the overlay deletes
    opaque_dir: str  # vllm-relative dir the overlay marks opaque
    opaque_files: dict[str, bytes]  # what the overlay puts in that dir

    def oci(self, tag: str) -> str:
        return f"oci:{self.path}:{tag}"


def _blob(layout: Path, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs/sha256" / digest).write_bytes(data)
    return f"sha256:{digest}", len(data)


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _nightly_layer(dest: Path, release_site: Path) -> None:
    """A layer over ``base`` making it a nightly: the dev dist-info, and its ``_version.py``."""
    release_info = f"vllm-{VLLM_VERSION}.dist-info"
    info = f"vllm-{NIGHTLY_VERSION}.dist-info"
    (dest / info).mkdir(parents=True)
    (dest / f".wh.{release_info}").write_bytes(b"")
    version_py = (f"{NIGHTLY_MARK}\n__version__ = version = {NIGHTLY_VERSION!r}\n"
                  f"__version_tuple__ = version_tuple = (0, 20, 2, 'rc1', 'dev424', 'g3f5a1e173')\n").encode()
    (dest / "vllm").mkdir()
    (dest / "vllm/_version.py").write_bytes(version_py)
    metadata = (release_site / release_info / "METADATA").read_text().replace(
        f"\nVersion: {VLLM_VERSION}\n", f"\nVersion: {NIGHTLY_VERSION}\n", 1)
    assert f"Version: {NIGHTLY_VERSION}" in metadata
    (dest / info / "METADATA").write_text(metadata)
    lines = []
    for line in (release_site / release_info / "RECORD").read_text().splitlines():
        path = line.split(",", 1)[0].replace(release_info + "/", info + "/")
        if path == "vllm/_version.py":
            line = f"{path},{_record_hash(version_py)},{len(version_py)}"
        elif path == f"{info}/METADATA":
            line = f"{path},{_record_hash(metadata.encode())},{len(metadata.encode())}"
        elif path.startswith(info + "/"):
            line = f"{path},,"
        lines.append(line)
    (dest / info / "RECORD").write_text("\n".join(lines) + "\n")


def _vllm_site(site: Path, wheel: Path, version: str = VLLM_VERSION, triton: str = "3.5.0",
               triton_record: bytes | None = None) -> dict[str, bytes]:
    """``wheel``'s python files and dist-info under ``site``, as pip installs them, and Triton
    ``triton``'s metadata beside them (with ``triton_record`` as its RECORD when given); returns
    the ``vllm/*.py`` files read."""
    wheel_files: dict[str, bytes] = {}
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            keep_py = name.startswith("vllm/") and name.endswith(".py")
            if keep_py or name.startswith(f"vllm-{version}.dist-info/"):
                data = archive.read(name)
                (site / name).parent.mkdir(parents=True, exist_ok=True)
                (site / name).write_bytes(data)
                if keep_py:
                    wheel_files[name] = data
    info = site / f"triton-{triton}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: triton\nVersion: {triton}\n")
    if triton_record is not None:
        (info / "RECORD").write_bytes(triton_record)
    return wheel_files


def build_base_layout(work: Path, wheel: Path, arm64_wheel: Path) -> BaseLayout:
    """Every tag the registry tests push (``BaseLayout.path``); ``wheel`` is vLLM's x86_64 wheel,
    ``arm64_wheel`` its aarch64 one (the arm64 halves of the two-platform bases)."""
    work.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(20240101)
    trees = {role: work / "trees" / role for role in ("rootfs", "filler-cuda", "filler-torch", "vllm", "app", "overlay")}
    for tree in trees.values():
        tree.mkdir(parents=True)
    # rootfs: busybox-static with a few applets, as a distro base would provide a shell.
    bin_dir = trees["rootfs"] / "bin"
    bin_dir.mkdir()
    shutil.copy(shutil.which("busybox"), bin_dir / "busybox")
    for applet in ("sh", "cat", "ls", "sha256sum"):
        (bin_dir / applet).symlink_to("busybox")
    (trees["rootfs"] / "etc").mkdir()
    (trees["rootfs"] / "etc/os-release").write_text("ID=kiln-fixture\n")
    # fillers standing in for CUDA and torch: incompressible, so their bytes are noticed if pulled.
    cuda = trees["filler-cuda"] / "usr/local/cuda/lib64"
    cuda.mkdir(parents=True)
    (cuda / "libcudart.so.13").write_bytes(rnd.randbytes(3 << 20))
    torch = trees["filler-torch"] / SITE / "torch"
    (torch / "lib").mkdir(parents=True)
    (torch / "lib/libtorch_cuda.so").write_bytes(rnd.randbytes(3 << 20))
    (torch / "__init__.py").write_text("__version__ = '2.9.0'\n")
    # vllm: the wheel's python files and dist-info, as pip installs them; plus triton's metadata.
    wheel_files = _vllm_site(trees["vllm"] / SITE, wheel)
    # app: a small top layer that touches no vLLM file (the real image has a few like it).
    (trees["app"] / "usr/local/bin").mkdir(parents=True)
    (trees["app"] / "usr/local/bin/serve.sh").write_text("#!/bin/sh\nexec vllm serve \"$@\"\n")
    # overlay: replaces one file, whites out one, makes one directory opaque with a new file.
    overridden, whited_out, opaque_dir = "envs.py", "collect_env.py", "benchmarks"
    osite = trees["overlay"] / SITE / "vllm"
    (osite / opaque_dir).mkdir(parents=True)
    override = wheel_files[f"vllm/{overridden}"] + b"\n# overridden by the kiln fixture overlay layer\n"
    (osite / overridden).write_bytes(override)
    (osite / f".wh.{whited_out}").write_bytes(b"")
    (osite / opaque_dir / ".wh..wh..opq").write_bytes(b"")
    opaque_files = {"__init__.py": b"# opaque replacement\n", "only_in_overlay.py": b"X = 1\n"}
    for name, data in opaque_files.items():
        (osite / opaque_dir / name).write_bytes(data)

    layout = work / "layout"
    run("umoci", "init", "--layout", layout)
    run("umoci", "new", "--image", f"{layout}:stem")
    run("umoci", "config", "--image", f"{layout}:stem", "--architecture", "amd64", "--os", "linux",
        "--config.cmd", "/bin/sh")
    for role in ("rootfs", "filler-cuda", "filler-torch", "vllm"):
        run("umoci", "raw", "add-layer", "--image", f"{layout}:stem", "--history.created_by", f"fixture {role}",
            _tar(trees[role], work / f"{role}.tar"))
    for role, tag in (("app", "base"), ("overlay", "overlay")):
        run("umoci", "raw", "add-layer", "--image", f"{layout}:stem", "--tag", tag,
            "--history.created_by", f"fixture {role}", _tar(trees[role], work / f"{role}.tar"))
    # Triton variants of ``base`` (kernel-cache builds): the real cp312 dist-info of 3.6.0 or of
    # 3.8.0 (vLLM 0.33.0's) instead of 3.5.0's; 3.6.0's with one file triton_key() reads changed
    # (a vendor build: no kernel layer the image can use); or none.
    vendor = TRITON_CP312_RECORD.read_text().replace("triton/language/core.py,sha256=",
                                                     "triton/language/core.py,sha256=AAAA", 1)
    for tag, triton, record in (("triton36", "3.6.0", TRITON_CP312_RECORD.read_text()),
                                ("triton38", "3.8.0", TRITON_CP312_RECORDS["3.8.0"].read_text()),
                                ("tritonvendor", "3.6.0", vendor), ("notriton", None, None)):
        site = work / "trees" / tag / SITE
        site.mkdir(parents=True)
        (site / ".wh.triton-3.5.0.dist-info").write_bytes(b"")
        if triton:
            (site / f"triton-{triton}.dist-info").mkdir()
            (site / f"triton-{triton}.dist-info/METADATA").write_text(
                f"Metadata-Version: 2.1\nName: triton\nVersion: {triton}\n")
            (site / f"triton-{triton}.dist-info/RECORD").write_text(record)
        run("umoci", "raw", "add-layer", "--image", f"{layout}:base", "--tag", tag,
            "--history.created_by", f"fixture {tag}", _tar(work / "trees" / tag, work / f"{tag}.tar"))
    # a nightly-shaped image: the dist-info of a dev build (its RECORD and METADATA name the dev
    # version) replaces the release's, and one module differs from every wheel.
    _nightly_layer(work / "trees" / "nightly" / SITE, trees["vllm"] / SITE)
    run("umoci", "raw", "add-layer", "--image", f"{layout}:base", "--tag", "nightly",
        "--history.created_by", "fixture nightly", _tar(work / "trees" / "nightly", work / "nightly.tar"))
    # an amd64 image without vLLM (rootfs + a filler), for the "base has no vLLM" error.
    run("umoci", "new", "--image", f"{layout}:novllm")
    run("umoci", "config", "--image", f"{layout}:novllm", "--architecture", "amd64", "--os", "linux")
    for role in ("rootfs", "filler-cuda"):
        run("umoci", "raw", "add-layer", "--image", f"{layout}:novllm", work / f"{role}.tar")
    # an arm64 image without vLLM: picking it instead of amd64 would fail loudly.
    run("umoci", "new", "--image", f"{layout}:arm64")
    run("umoci", "config", "--image", f"{layout}:arm64", "--architecture", "arm64", "--os", "linux")
    run("umoci", "raw", "add-layer", "--image", f"{layout}:arm64", work / "rootfs.tar")

    # the arm64 half of a two-platform base (``multi``): ``base``'s layers under an arm64 config,
    # but for vLLM's, made from the real aarch64 wheel as vLLM's arm64 images install it (its own
    # dist-info RECORD; the same .py files, which kiln must find equal, not assume)
    _vllm_site(work / "trees" / "vllm-arm64" / SITE, arm64_wheel)
    _tar(work / "trees" / "vllm-arm64", work / "vllm-arm64.tar")
    run("umoci", "new", "--image", f"{layout}:arm64vllm")
    run("umoci", "config", "--image", f"{layout}:arm64vllm", "--architecture", "arm64", "--os", "linux",
        "--config.cmd", "/bin/sh")
    for role in ("rootfs", "filler-cuda", "filler-torch", "vllm", "app"):
        tar = "vllm-arm64" if role == "vllm" else role
        run("umoci", "raw", "add-layer", "--image", f"{layout}:arm64vllm", "--history.created_by",
            f"fixture {role} (arm64)", work / f"{tar}.tar")

    # its Triton 3.6.0 twin: the aarch64 wheel's real dist-info over it (``multi36``'s arm64 half)
    site = work / "trees" / "triton36-arm64" / SITE
    site.mkdir(parents=True)
    (site / ".wh.triton-3.5.0.dist-info").write_bytes(b"")
    (site / "triton-3.6.0.dist-info").mkdir()
    (site / "triton-3.6.0.dist-info/METADATA").write_text("Metadata-Version: 2.1\nName: triton\nVersion: 3.6.0\n")
    (site / "triton-3.6.0.dist-info/RECORD").write_bytes(TRITON_CP312_AARCH64_RECORD.read_bytes())
    run("umoci", "raw", "add-layer", "--image", f"{layout}:arm64vllm", "--tag", "arm64triton36",
        "--history.created_by", "fixture triton36 (arm64)",
        _tar(work / "trees" / "triton36-arm64", work / "triton36-arm64.tar"))

    index = json.loads((layout / "index.json").read_text())
    by_tag = {m["annotations"]["org.opencontainers.image.ref.name"]: m for m in index["manifests"]}
    layers: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for tag, roles in (("base", ("rootfs", "filler-cuda", "filler-torch", "vllm", "app")),
                       ("overlay", ("rootfs", "filler-cuda", "filler-torch", "vllm", "overlay"))):
        manifest = json.loads((layout / "blobs/sha256" / by_tag[tag]["digest"].split(":")[1]).read_bytes())
        for role, layer in zip(roles, manifest["layers"], strict=True):
            layers[role], sizes[role] = layer["digest"], layer["size"]
    # the OCI index with a BuildKit-style attestation entry first.
    att_layer = _blob(layout, json.dumps({"_type": "https://in-toto.io/Statement/v0.1"}).encode())
    att_config = _blob(layout, json.dumps({"architecture": "unknown", "os": "unknown", "rootfs": {"type": "layers", "diff_ids": [att_layer[0]]}}).encode())
    att_manifest = _blob(layout, json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": att_config[0], "size": att_config[1]},
        "layers": [{"mediaType": "application/vnd.in-toto+json", "digest": att_layer[0], "size": att_layer[1]}],
    }).encode())
    entry = lambda tag, plat: {  # noqa: E731
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": by_tag[tag]["digest"],
        "size": by_tag[tag]["size"], "platform": plat}
    image_index = _blob(layout, json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": att_manifest[0], "size": att_manifest[1],
             "platform": {"architecture": "unknown", "os": "unknown"},
             "annotations": {"vnd.docker.reference.type": "attestation-manifest",
                             "vnd.docker.reference.digest": by_tag["base"]["digest"]}},
            entry("arm64", {"architecture": "arm64", "os": "linux"}),
            entry("base", {"architecture": "amd64", "os": "linux"}),
        ],
    }).encode())
    index["manifests"].append({"mediaType": "application/vnd.oci.image.index.v1+json", "digest": image_index[0],
                               "size": image_index[1], "annotations": {"org.opencontainers.image.ref.name": "index"}})
    # a two-platform base as vLLM's release tags are: linux/amd64 (= ``base``) and linux/arm64, both with vLLM
    multi = _blob(layout, json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [entry("base", {"architecture": "amd64", "os": "linux"}),
                      entry("arm64vllm", {"architecture": "arm64", "os": "linux"})],
    }).encode())
    index["manifests"].append({"mediaType": "application/vnd.oci.image.index.v1+json", "digest": multi[0],
                               "size": multi[1], "annotations": {"org.opencontainers.image.ref.name": "multi"}})
    multi36 = _blob(layout, json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [entry("triton36", {"architecture": "amd64", "os": "linux"}),
                      entry("arm64triton36", {"architecture": "arm64", "os": "linux"})],
    }).encode())
    index["manifests"].append({"mediaType": "application/vnd.oci.image.index.v1+json", "digest": multi36[0],
                               "size": multi36[1], "annotations": {"org.opencontainers.image.ref.name": "multi36"}})
    (layout / "index.json").write_text(json.dumps(index))
    return BaseLayout(layout, layers, sizes, wheel_files, overridden, override, whited_out, opaque_dir, opaque_files)


# -- a release's two-platform base --------------------------------------------------------------

# vLLM 0.33.0's images: torch 2.14.0 requires triton~=3.8.0; each platform's RECORD is its real
# cp312 wheel's (x86_64: ``TRITON_CP312_RECORDS``; aarch64: copied out of
# triton-3.8.0-cp312-cp312-manylinux_2_27_aarch64.manylinux_2_28_aarch64.whl from PyPI, sha256
# a9c404c69ed4a39e8ec632eaf6b9fe058a060bf98979c177f6ef666f06bb8d50)
RELEASE_TRITON = {"0.33.0": ("3.8.0", {"amd64": TRITON_CP312_RECORDS["3.8.0"],
                                       "arm64": Path(__file__).with_name("triton-3.8.0-cp312-aarch64.RECORD")})}


def build_release_multi(work: Path, version: str) -> Path:
    """An OCI layout whose tag ``multi`` is vLLM ``version``'s base as its release tags are: an index
    of linux/amd64 and linux/arm64, each half a small rootfs, a filler standing in for CUDA and
    torch, and one layer with that platform's real vLLM wheel (``.py`` files and dist-info) and its
    real Triton cp312 dist-info (``RELEASE_TRITON``). Returns the layout."""
    triton, records = RELEASE_TRITON[version]
    layout = work / "layout"
    run("umoci", "init", "--layout", layout)
    rootfs = work / "trees" / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    shutil.copy(shutil.which("busybox"), rootfs / "bin/busybox")
    (rootfs / "bin/sh").symlink_to("busybox")
    filler = work / "trees" / "filler" / "usr/local/cuda/lib64"
    filler.mkdir(parents=True)
    (filler / "libcudart.so.13").write_bytes(random.Random(version).randbytes(1 << 20))
    entries = []
    for arch, machine in (("amd64", "x86_64"), ("arm64", "aarch64")):
        site = work / "trees" / f"vllm-{arch}" / SITE
        _vllm_site(site, fetch_vllm_wheel(machine, version), version, triton, records[arch].read_bytes())
        image = f"{layout}:{arch}"
        run("umoci", "new", "--image", image)
        run("umoci", "config", "--image", image, "--architecture", arch, "--os", "linux", "--config.cmd", "/bin/sh")
        for role, tree in (("rootfs", rootfs), ("filler", work / "trees" / "filler"),
                           ("vllm", work / "trees" / f"vllm-{arch}")):
            run("umoci", "raw", "add-layer", "--image", image, "--history.created_by", f"fixture {role} ({arch})",
                _tar(tree, work / f"{role}-{arch}.tar"))
        index = json.loads((layout / "index.json").read_text())
        [ref] = [m for m in index["manifests"] if m["annotations"]["org.opencontainers.image.ref.name"] == arch]
        entries.append({"mediaType": ref["mediaType"], "digest": ref["digest"], "size": ref["size"],
                        "platform": {"architecture": arch, "os": "linux"}})
    multi = _blob(layout, json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                                      "manifests": entries}).encode())
    index = json.loads((layout / "index.json").read_text())
    index["manifests"].append({"mediaType": "application/vnd.oci.image.index.v1+json", "digest": multi[0],
                               "size": multi[1], "annotations": {"org.opencontainers.image.ref.name": "multi"}})
    (layout / "index.json").write_text(json.dumps(index))
    return layout


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def vllm_wheel() -> Path:
    return fetch_vllm_wheel()


@pytest.fixture(scope="session")
def vllm_wheel_aarch64() -> Path:
    return fetch_vllm_wheel("aarch64")


@pytest.fixture(scope="session")
def base_layout(tmp_path_factory, vllm_wheel, vllm_wheel_aarch64) -> BaseLayout:
    require_tools()
    return build_base_layout(tmp_path_factory.mktemp("base-image"), vllm_wheel, vllm_wheel_aarch64)


@pytest.fixture(scope="session")
def start_registry(tmp_path_factory):
    require_tools()
    servers: list[RegistryServer] = []

    def start(flavour: str = "plain", copy_from: RegistryServer | None = None, password: str = PASSWORD) -> RegistryServer:
        server = start_registry_process(tmp_path_factory.mktemp(f"registry-{flavour}"), flavour, copy_from, password)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def _push_all(server: RegistryServer, layout: BaseLayout, full: bool) -> None:
    server.push(layout.oci("base"), f"{REPO}:v{VLLM_VERSION}")
    if full:
        server.push(layout.oci("overlay"), f"{REPO}:v{VLLM_VERSION}-overlay")
        server.push(layout.oci("base"), f"{REPO}:v{VLLM_VERSION}-docker", "--format", "v2s2")
        server.push(layout.oci("index"), f"{REPO}:v{VLLM_VERSION}-index", "--all")
        server.push(layout.oci("multi"), f"{REPO}:v{VLLM_VERSION}-multi", "--all")
        server.push(layout.oci("multi36"), f"{REPO}:v{VLLM_VERSION}-multi36", "--all")
        server.push(layout.oci("novllm"), "test/no-vllm:1")
        for variant in ("triton36", "triton38", "tritonvendor"):
            server.push(layout.oci(variant), f"{REPO}:v{VLLM_VERSION}-{variant}")
        server.push(layout.oci("notriton"), f"{REPO}:v{VLLM_VERSION}-notriton")
        server.push(layout.oci("nightly"), f"{REPO}:{NIGHTLY_TAG}")


@pytest.fixture(scope="session")
def registry_plain(start_registry, base_layout) -> RegistryServer:
    server = start_registry("plain")
    _push_all(server, base_layout, full=True)
    return server


@pytest.fixture(scope="session")
def release_multi(tmp_path_factory, registry_plain) -> str:
    """``vllm/vllm-openai:v0.33.0`` in ``registry_plain``: vLLM 0.33.0's two-platform base made
    from both its real wheels (``build_release_multi``); its name under the registry."""
    require_tools()
    layout = build_release_multi(tmp_path_factory.mktemp("release-multi"), "0.33.0")
    name = f"{REPO}:v0.33.0"
    registry_plain.push(f"oci:{layout}:multi", name, "--all")
    return name


@pytest.fixture(scope="session")
def registry_basic(start_registry, base_layout) -> RegistryServer:
    server = start_registry("basic")
    _push_all(server, base_layout, full=False)
    return server


@pytest.fixture(scope="session")
def registry_token(start_registry, base_layout) -> RegistryServer:
    server = start_registry("token")
    _push_all(server, base_layout, full=False)
    return server


def read_blob(client, repo: str, digest: str, size: int | None = None) -> bytes:
    """A whole blob through the client's verifying reader (tests only; kiln streams blobs)."""
    chunks = []
    with client.open_blob(repo, digest, size) as reader:
        while chunk := reader.read(1 << 20):
            chunks.append(chunk)
    return b"".join(chunks)
