"""A fault-injecting HTTP proxy for registry tests (127.0.0.1 only).

``FaultProxy(upstream)`` forwards every request to a real ``docker-registry`` (keeping the
``Host`` header, so upload ``Location`` URLs point back at the proxy) and applies ``Fault``
rules chosen by method, path pattern and occurrence:

    Fault("GET", r"/blobs/sha256:ab", "reset", after=65536)      # RST after 64 KiB of the body
    Fault("HEAD", r"/manifests/", "status", status=503)           # answer 503 instead of forwarding
    Fault("GET", r"/blobs/", "status", status=429, headers={"Retry-After": "1"})
    Fault("GET", r"/blobs/", "truncate", after=1000)              # 1000 bytes, then FIN (short of Content-Length)
    Fault("GET", r"/blobs/", "corrupt", after=5000)               # byte 5000 flipped, length unchanged
    Fault("PUT", r"/blobs/uploads/", "reset_upload", after=4096)  # read 4 KiB of the request body, then RST
    Fault("GET", r"/blobs/", "expire_token")                      # 401 + a fresh Bearer challenge
    Fault("GET", r"/blobs/", "stall", after=100_000, pause=30)    # 100 kB, then nothing for 30 s, then the rest

    Fault("GET", r"/manifests/", "status", status=403, only_with="Authorization", echo="Authorization")
                                                                  # 403 whose error message quotes the request's
                                                                  # Authorization (and a Basic one decoded)

``nth`` is the first matching occurrence hit (1-based), ``times`` how many in a row (None: all
from ``nth`` on). ``proxy.strip_range = True`` makes the proxy drop ``Range`` request headers
(a registry that always answers 200 with the whole blob). ``proxy.seen`` records every request (method, path, headers, what was done,
when), so tests assert what the client actually sent, not what it says it did.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import json
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}
_CHUNK = 64 * 1024
ACTIONS = ("status", "reset", "truncate", "corrupt", "reset_upload", "expire_token", "stall")


@dataclass
class Fault:
    method: str  # "GET", "HEAD", "PUT", ... or "*"
    path: str  # regex searched in the request path (query excluded)
    action: str  # one of ACTIONS
    nth: int = 1
    times: int | None = 1
    status: int = 503
    headers: dict[str, str] = field(default_factory=dict)
    after: int = 0  # body bytes sent (reset, truncate, stall), flipped byte (corrupt), bytes read (reset_upload)
    pause: float = 0.0  # seconds a stall lasts
    only_with: str | None = None  # match only requests carrying this header
    echo: str | None = None  # a status fault's error message quotes this request header
    matched: int = 0  # occurrences seen so far
    fired: int = 0  # times the fault was applied

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(self.action)
        self._pattern = re.compile(self.path)

    def take(self, method: str, path: str, headers=None) -> bool:
        if self.method not in ("*", method) or not self._pattern.search(path):
            return False
        if self.only_with and (headers is None or self.only_with not in headers):
            return False
        self.matched += 1
        last = None if self.times is None else self.nth + self.times - 1
        hit = self.matched >= self.nth and (last is None or self.matched <= last)
        self.fired += hit
        return hit


@dataclass
class Seen:
    method: str
    path: str  # without the query
    query: str
    headers: dict[str, str]
    fault: str | None  # the action applied, or None when forwarded untouched
    status: int | None  # what the client was sent (None: the connection was cut first)
    at: float  # time.monotonic() when the request arrived
    body_bytes: int = 0  # response body bytes sent


class FaultProxy:
    def __init__(self, upstream: str):
        self.upstream = upstream  # "127.0.0.1:PORT"
        self.faults: list[Fault] = []
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        self._challenge: dict[str, str] = {}  # realm/service of the last Bearer challenge from upstream
        self.strip_range = False
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                owner._handle(self)

            do_HEAD = do_PUT = do_POST = do_PATCH = do_DELETE = do_GET  # noqa: N815

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):  # a cut connection is the point
                pass

        self._server = Server(("127.0.0.1", 0), Handler)
        self.host = f"127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def mirror(self) -> str:
        return f"docker.io=http://{self.host}"

    def add(self, *faults: Fault) -> FaultProxy:
        with self._lock:
            self.faults.extend(faults)
        return self

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()
            self.seen.clear()

    def requests(self, method: str | None = None, path: str = "") -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if (method is None or s.method == method) and re.search(path, s.path)]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- one request ---------------------------------------------------------------------------

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        method = handler.command
        path, _, query = handler.path.partition("?")
        with self._lock:
            fault = next((f for f in self.faults if f.take(method, path, handler.headers)), None)
            seen = Seen(method, path, query, dict(handler.headers.items()), fault.action if fault else None,
                        None, time.monotonic())
            self.seen.append(seen)
        if fault and fault.action == "reset_upload":
            _read_body(handler, limit=fault.after)
            _reset(handler)
            return
        body = _read_body(handler)
        if fault and fault.action in ("status", "expire_token"):
            self._answer_fault(handler, fault, method, path, seen)
            return
        upstream = http.client.HTTPConnection(self.upstream, timeout=60)
        try:
            dropped = _HOP_BY_HOP | ({"range"} if self.strip_range else set())
            headers = {k: v for k, v in handler.headers.items() if k.lower() not in dropped}
            upstream.request(method, handler.path, body=body if body else None, headers=headers)
            resp = upstream.getresponse()
            self._learn_challenge(resp)
            self._relay(handler, resp, method, fault, seen)
        finally:
            upstream.close()

    def _learn_challenge(self, resp: http.client.HTTPResponse) -> None:
        header = resp.getheader("Www-Authenticate", "")
        if header.lower().startswith("bearer"):
            params = dict(re.findall(r'(\w+)="([^"]*)"', header))
            with self._lock:
                self._challenge = {k: params[k] for k in ("realm", "service") if k in params}

    def _answer_fault(self, handler, fault: Fault, method: str, path: str, seen: Seen) -> None:
        status, headers = fault.status, dict(fault.headers)
        if fault.action == "expire_token":
            status = 401
            headers["Www-Authenticate"] = self._fresh_challenge(method, path)
            code = "UNAUTHORIZED"
        else:
            code = "UNAVAILABLE" if status >= 500 else "TOOMANYREQUESTS" if status == 429 else "DENIED"
        message = "injected by the fault proxy"
        if fault.echo:  # as a registry that quotes the request it refuses
            value = handler.headers.get(fault.echo, "")
            message += f"; you sent {fault.echo}: {value}"
            scheme, _, credential = value.partition(" ")
            if scheme.lower() == "basic":
                try:
                    message += f" ({base64.b64decode(credential, validate=True).decode()})"
                except (binascii.Error, UnicodeDecodeError):
                    pass
        payload = json.dumps({"errors": [{"code": code, "message": message}]}).encode()
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        if method != "HEAD":
            handler.wfile.write(payload)
        seen.status = status

    def _fresh_challenge(self, method: str, path: str) -> str:
        """What distribution answers for a token that no longer verifies (expired)."""
        match = re.match(r"/v2/(.+?)/(?:blobs|manifests|tags)/", path)
        actions = "pull" if method in ("GET", "HEAD") else "pull,push"
        with self._lock:
            realm = self._challenge.get("realm", "")
            service = self._challenge.get("service", "")
        scope = f',scope="repository:{match.group(1)}:{actions}"' if match else ""
        return f'Bearer realm="{realm}",service="{service}"{scope},error="invalid_token"'

    def _relay(self, handler, resp: http.client.HTTPResponse, method: str, fault: Fault | None, seen: Seen) -> None:
        no_body = method == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
        length_header = resp.getheader("Content-Length")
        if no_body:
            payload, length = b"", int(length_header or 0)
            resp.read()
        elif length_header is None:
            payload = resp.read()
            length = len(payload)
        else:
            payload, length = None, int(length_header)
        handler.send_response(resp.status)
        for key, value in resp.getheaders():
            if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                handler.send_header(key, value)
        handler.send_header("Content-Length", str(length))
        handler.end_headers()
        seen.status = resp.status
        if no_body:
            return
        action = fault.action if fault else None
        sent = 0
        while True:
            if payload is not None:  # a buffered payload goes out in one piece
                data, payload = payload, b""
            else:
                data = resp.read(_CHUNK)
            if not data:
                break
            if action in ("reset", "truncate") and sent + len(data) >= fault.after:
                data = data[: fault.after - sent]
                handler.wfile.write(data)
                seen.body_bytes = sent + len(data)
                if action == "reset":
                    time.sleep(0.2)  # let the client take in what was sent: the RST drops unread bytes
                    _reset(handler)
                else:
                    _close(handler)
                return
            if action == "stall" and sent <= fault.after < sent + len(data):
                cut = fault.after - sent
                handler.wfile.write(data[:cut])
                handler.wfile.flush()
                time.sleep(fault.pause)  # the client sees nothing (it may give up and hang up)
                data, sent = data[cut:], sent + cut
            if action == "corrupt" and sent <= fault.after < sent + len(data):
                index = fault.after - sent
                data = data[:index] + bytes([data[index] ^ 0xFF]) + data[index + 1:]
            handler.wfile.write(data)
            sent += len(data)
        seen.body_bytes = sent


def _read_body(handler: BaseHTTPRequestHandler, limit: int | None = None) -> bytes:
    length = int(handler.headers.get("Content-Length") or 0)
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        raise NotImplementedError("chunked request bodies are not proxied")
    want = length if limit is None else min(limit, length)
    chunks, got = [], 0
    while got < want:
        data = handler.rfile.read(min(_CHUNK, want - got))
        if not data:
            break
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


def _reset(handler: BaseHTTPRequestHandler) -> None:
    """Close with SO_LINGER 0: the peer gets a TCP RST (ECONNRESET), not an orderly end."""
    handler.wfile.flush()
    handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    handler.connection.close()
    handler.close_connection = True


def _close(handler: BaseHTTPRequestHandler) -> None:
    handler.wfile.flush()
    try:
        handler.connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    handler.connection.close()
    handler.close_connection = True
