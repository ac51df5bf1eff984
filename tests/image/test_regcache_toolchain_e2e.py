"""The registry build cache's ``toolchain`` entry (``kiln.image.wheelcache``) with a real registry.

Build A compiles sm 86 with ``--cache-to`` on a fresh toolchain directory: it fetches the Triton
wheel from the test's package index and writes it as an entry. Build B, on a fresh kiln cache
and toolchain directory, with ``--cache-from``, compiles sm 120 (A's kernel entry is for sm 86):
it takes the wheel from the entry, never downloads it from the index (the index only tells its
sha256, with its metadata, as PyPI does), and gives the digest a build without cache gives. A
poisoned toolchain entry is a miss with a warning: the wheel comes from the index again.
"""

from __future__ import annotations

import hashlib
import threading
import zipfile
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from kiln.image.cachekeys import KERNELS, PATCHED
from kiln.image.wheelcache import TOOLCHAIN
from tests.image.test_regcache_kinds_e2e import MANIFEST, _build, _entries, images, pins, work  # noqa: F401

pytestmark = [pytest.mark.registry, pytest.mark.reliability]

WHEEL = Path("/opt/pypi/files/triton-3.6.0-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl")


@pytest.fixture
def index(monkeypatch):
    """A package index on 127.0.0.1 serving the Triton 3.6.0 wheel, its sha256 and its metadata
    (PEP 658, as PyPI); ``index.gets`` counts kiln's own GETs per path (not pip's: pip 23.2 downloads the wheel even
to choose it, pip 26 reads only its metadata). pip is pointed at it alone."""
    if not WHEEL.is_file():
        pytest.skip(f"{WHEEL} is not on this machine")
    data = WHEEL.read_bytes()
    sha256 = hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(WHEEL) as archive:
        metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA")))
    meta_sha = hashlib.sha256(metadata).hexdigest()
    page = (f'<!DOCTYPE html><html><body><a href="/files/{WHEEL.name}#sha256={sha256}" '
            f'data-dist-info-metadata="sha256={meta_sha}" data-core-metadata="sha256={meta_sha}">{WHEEL.name}</a>'
            "</body></html>").encode()
    routes = {"/simple/triton/": (page, "text/html"), f"/files/{WHEEL.name}": (data, "application/octet-stream"),
              f"/files/{WHEEL.name}.metadata": (metadata, "text/plain")}
    gets: Counter = Counter()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):  # noqa: N802 (http.server's naming)
            if not self.headers.get("User-Agent", "").startswith("pip/"):
                gets[self.path] += 1  # kiln's own requests
            body, kind = routes.get(self.path, (None, None))
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_port}/simple/")
    monkeypatch.setenv("PIP_TRUSTED_HOST", "127.0.0.1")
    server.gets, server.wheel_path, server.sha256 = gets, f"/files/{WHEEL.name}", sha256
    yield server
    server.shutdown()
    server.server_close()


def test_a_build_that_compiles_takes_the_toolchain_wheel_from_the_cache_not_the_index(
        capsys, monkeypatch, tmp_path, registry_plain, start_registry, pins, images, work, index):  # noqa: F811
    cache = start_registry("plain")  # a registry of its own: corrupting its blobs touches no image
    where = (f"{cache.host}/kiln-cache", "--insecure-registry", cache.host)

    def build(runner: str, sm: int, *extra: str) -> dict:
        monkeypatch.setenv("KILN_TRITON_TOOLCHAINS", str(tmp_path / runner / "toolchains"))  # a fresh machine
        return _build(capsys, monkeypatch, tmp_path, runner, registry_plain, pins, images, "e2e-triton", sm, *extra)

    # A fetches the wheel from the index and writes it as the toolchain entry
    a = build("a", 86, "--cache-to", *where)
    assert index.gets[index.wheel_path] == 1
    toolchain = _entries(a)[TOOLCHAIN]
    assert toolchain["key"] == index.sha256 and toolchain["hit"] is None
    assert len(a["cache"]["written"]) == 5  # patched (by layers, by source), kernels, the catalogue's facts, the toolchain
    entry = requests.get(f"{cache.url}/v2/kiln-cache/manifests/{toolchain['tag']}", headers={"Accept": MANIFEST},
                         timeout=10).json()
    assert [layer["digest"] for layer in entry["layers"]] == [f"sha256:{index.sha256}"]

    # B compiles sm 120 with the entry's wheel: the index is asked for its sha256, never for the wheel
    b = build("b", 120, "--cache-from", *where)
    assert index.gets[index.wheel_path] == 1, "B downloaded the wheel from the index"
    assert work["compiled"] == [86, 120]
    assert _entries(b)[KERNELS]["hit"] is None and _entries(b)[PATCHED]["hit"]
    assert _entries(b)[TOOLCHAIN]["hit"] == f"{cache.host}/kiln-cache:{toolchain['tag']}"
    assert b["triton"]["triton_wheel_sha256"] == index.sha256

    # the image a build without any registry cache gives
    reference = build("reference", 120)
    assert index.gets[index.wheel_path] == 2
    assert reference["manifest_digest"] == b["manifest_digest"]

    # a poisoned toolchain entry: a miss with a warning, the wheel from the index, the same image
    stored = cache.blob_file(f"sha256:{index.sha256}")
    good = stored.read_bytes()
    stored.write_bytes(good[:-64] + bytes(64))  # same length: only the digest can tell
    c = build("c", 120, "--cache-from", *where)
    assert index.gets[index.wheel_path] == 3, "the poisoned entry's wheel was used"
    assert _entries(c)[TOOLCHAIN]["hit"] is None
    assert any("build cache entry" in w and toolchain["tag"] in w for w in c["warnings"]), c["warnings"]
    assert c["manifest_digest"] == b["manifest_digest"]
