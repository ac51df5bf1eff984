"""Bounded retries on 429/5xx honouring Retry-After (a tiny flaky server, no registry needed)."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kiln.errors import KilnError
from kiln.oci.endpoints import Endpoint
from kiln.oci.registry import RegistryClient

pytestmark = pytest.mark.isolated

DIGEST = "sha256:" + "1" * 64


@pytest.fixture
def flaky_server():
    answers: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_HEAD(self):  # noqa: N802
            status = answers.pop(0) if answers else 200
            self.send_response(status)
            if status in (429, 503):
                self.send_header("Retry-After", "0")
            else:
                self.send_header("Docker-Content-Digest", DIGEST)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}", answers
    server.shutdown()
    server.server_close()


def test_retries_then_succeeds(flaky_server):
    host, answers = flaky_server
    answers.extend([503, 429])
    client = RegistryClient(Endpoint(host, host, insecure=True))
    assert client.resolve("a/b", "t") == DIGEST
    assert not answers


def test_gives_up_after_the_bound(flaky_server):
    host, answers = flaky_server
    answers.extend([503] * 10)
    client = RegistryClient(Endpoint(host, host, insecure=True), retries=2)
    with pytest.raises(KilnError, match="HTTP 503"):
        client.resolve("a/b", "t")
    assert len(answers) == 7  # 3 attempts used
