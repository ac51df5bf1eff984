"""The wheel source provider and the cache, against a real HTTP index on loopback.

A small PEP 503 index is served by ``http.server`` from a temporary directory holding a
hand-built ``vllm`` wheel, so hash checking, extraction and concurrent fills are exercised
without depending on PyPI (the real wheels are covered by the patch tests).
"""

from __future__ import annotations

import hashlib
import http.server
import multiprocessing
import os
import threading
import zipfile
from pathlib import Path

import pytest

from kiln.cache import install_dir
from kiln.errors import KilnError
from kiln.source.wheel import WheelSource

WHEEL = "vllm-9.9.9-cp38-abi3-manylinux_2_35_x86_64.whl"


def make_wheel(path: Path, files: dict[str, str]) -> str:
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def index(tmp_path, monkeypatch):
    """Serve ``tmp_path/www`` on 127.0.0.1; returns a function that publishes a wheel."""
    www = tmp_path / "www"
    (www / "vllm").mkdir(parents=True)
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(www), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("KILN_PYPI_INDEX", f"http://127.0.0.1:{server.server_port}")

    def publish(files: dict[str, str], advertised_sha: str | None = None) -> str:
        sha = make_wheel(www / WHEEL, files)
        (www / "vllm" / "index.html").write_text(
            f'<html><body><a href="../{WHEEL}#sha256={advertised_sha or sha}">{WHEEL}</a></body></html>'
        )
        return sha

    yield publish
    server.shutdown()


FILES = {
    "vllm/__init__.py": "VERSION = '9.9.9'\n",
    "vllm/config/vllm.py": "class VllmConfig:\n    pass\n",
    "vllm/_C.abi3.so": "binary",
    "vllm-9.9.9.dist-info/METADATA": "Name: vllm\n",
}


def test_fetch_verifies_and_extracts_only_python(index, tmp_path):
    sha = index(FILES)
    tree = WheelSource("9.9.9", cache=tmp_path / "cache").fetch()
    assert tree.identity == f"sha256:{sha}"
    assert tree.python_files() == ["__init__.py", "config/vllm.py"]
    assert tree.read("config/vllm.py") == FILES["vllm/config/vllm.py"]


def test_warm_cache_needs_no_index(index, tmp_path, monkeypatch):
    index(FILES)
    cache = tmp_path / "cache"
    first = WheelSource("9.9.9", cache=cache).fetch()
    monkeypatch.setenv("KILN_PYPI_INDEX", "http://127.0.0.1:9")  # nothing listens there
    second = WheelSource("9.9.9", cache=cache).fetch()
    assert second == first


def test_hash_mismatch_is_refused_and_leaves_nothing(index, tmp_path):
    index(FILES, advertised_sha="0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(KilnError, match="sha256 mismatch"):
        WheelSource("9.9.9", cache=cache).fetch()
    assert not list((cache / "sources").glob("sha256-*"))
    assert not [p for p in (cache / "sources").iterdir() if p.name.startswith(".tmp")]


def test_unknown_release_is_a_clear_error(index, tmp_path):
    index(FILES)
    with pytest.raises(KilnError, match=r"vllm==1\.2\.3: no x86_64 Linux wheel"):
        WheelSource("1.2.3", cache=tmp_path / "cache").fetch()


def test_unreachable_index_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_PYPI_INDEX", "http://127.0.0.1:9")
    with pytest.raises(KilnError, match="cannot reach the package index"):
        WheelSource("9.9.9", cache=tmp_path / "cache").fetch()


def _slow_fill(final: str, marker: str) -> None:
    def fill(tmp: Path) -> None:
        for i in range(50):
            (tmp / f"f{i}").write_text(marker)
            os.sched_yield()

    install_dir(Path(final), fill)


def test_concurrent_fills_of_one_entry_do_not_corrupt_it(tmp_path):
    final = tmp_path / "entry"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_slow_fill, args=(str(final), f"writer{n}")) for n in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    contents = {p.read_text() for p in final.iterdir()}
    assert len(list(final.iterdir())) == 50 and len(contents) == 1  # one writer's complete fill
    assert [p.name for p in tmp_path.iterdir() if p.name != "entry"] == [".entry.lock"]


def test_concurrent_fetches_share_one_extraction(index, tmp_path):
    index(FILES)
    cache = tmp_path / "cache"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        identities = pool.map(_fetch_identity, [str(cache)] * 3)
    assert len(set(identities)) == 1
    assert len(list((cache / "sources").glob("sha256-*"))) == 1


def _fetch_identity(cache: str) -> str:
    return WheelSource("9.9.9", cache=Path(cache)).fetch().identity
