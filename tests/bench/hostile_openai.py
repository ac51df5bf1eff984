"""A hostile OpenAI-compatible server on 127.0.0.1: it answers the way a broken or malicious one might.

``HostileOpenAI(*modes)`` lists one model on ``GET /v1/models`` (unless a mode is about that
list) and answers the n-th ``POST /v1/chat/completions`` as ``modes[n % len(modes)]`` says, so
one bench run with ``--runs len(modes)`` meets every mode in turn:

    endless          valid chunks every 20 ms, never [DONE]
    trickle          one byte of a data line every 100 ms, never a newline (no socket timeout fires)
    flood            valid chunks as fast as the socket takes them, never [DONE]
    long_line        one data line of 3 GB (1 MiB writes)
    not_utf8         a chunk with bytes that are not UTF-8
    choices_string   ``"choices": "abc"``
    content_int      ``"delta": {"content": 7}``
    usage_negative   ``usage.completion_tokens`` -7
    usage_huge       ``usage.completion_tokens`` 10**30
    nested           a data line of 100 000 ``[``
    echo_key         HTTP 500 whose message echoes the request's ``Authorization`` header
    huge_models      ``GET /v1/models`` declares and streams 4 GB
    huge_models_chunked   ``GET /v1/models`` streams 4 GB chunked, with no length

Every answer stops by itself (a byte and time budget per connection) or when the client hangs
up, so a client that reads everything is the one that suffers, not the test run.
"""

from __future__ import annotations

import json
import socketserver
import threading
import time

MODES = ("endless", "trickle", "flood", "long_line", "not_utf8", "choices_string", "content_int",
         "usage_negative", "usage_huge", "nested", "echo_key", "huge_models", "huge_models_chunked")
GIB = 1 << 30
TIME_BUDGET = 30.0  # seconds any one answer may run, whatever the client does
MODEL = "hostile-model"


def _chunk(delta: dict | None = None, **extra) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": None}]
    return {"id": "x", "object": "chat.completion.chunk", "model": MODEL, "choices": choices, **extra}


def _event(data) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n"


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        self.connection.settimeout(10)
        request = self.rfile.readline(65536).decode("latin-1")
        headers = {}
        while (line := self.rfile.readline(65536).decode("latin-1").strip()):
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        body = self.rfile.read(int(headers.get("content-length") or 0))
        method, path = (request.split() + ["", ""])[:2]
        server: HostileOpenAI = self.server.owner  # type: ignore[attr-defined]
        with server.lock:
            posts = sum(1 for m, *_ in server.requests if m == "POST")
            server.requests.append((method, path, headers, body))
        started = time.monotonic()
        try:
            if method == "GET":
                self._models(server.modes[0], path, started)
            else:
                self._post(server.modes[posts % len(server.modes)], headers, started)
        except OSError:  # the client hung up: what a bounded client does
            pass

    def _send_head(self, status: str, kind: str, extra: str = "") -> None:
        self.wfile.write(f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nConnection: close\r\n{extra}\r\n".encode())

    def _chunked(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _models(self, mode: str, path: str, started: float) -> None:
        if path != "/v1/models":
            self._send_head("404 Not Found", "application/json", "Content-Length: 2\r\n")
            self.wfile.write(b"{}")
            return
        if mode not in ("huge_models", "huge_models_chunked"):
            data = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
            self._send_head("200 OK", "application/json", f"Content-Length: {len(data)}\r\n")
            self.wfile.write(data)
            return
        chunked = mode == "huge_models_chunked"
        self._send_head("200 OK", "application/json",
                        "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {4 * GIB}\r\n")
        piece = b'{"object": "list", "data": [' + b" " * (1 << 20)
        sent = 0
        while sent < 4 * GIB and time.monotonic() - started < TIME_BUDGET:
            self._chunked(piece) if chunked else self.wfile.write(piece)
            sent += len(piece)
            piece = b" " * (1 << 20)

    def _post(self, mode: str, headers: dict, started: float) -> None:
        if mode == "echo_key":
            message = json.dumps({"error": {"message": f"bad credentials: {headers.get('authorization')}"}}).encode()
            self._send_head("500 Internal Server Error", "application/json", f"Content-Length: {len(message)}\r\n")
            self.wfile.write(message)
            return
        self._send_head("200 OK", "text/event-stream", "Transfer-Encoding: chunked\r\n")
        self._chunked(_event(_chunk({"role": "assistant", "content": ""})))
        in_time = lambda: time.monotonic() - started < TIME_BUDGET  # noqa: E731
        if mode in ("endless", "flood"):
            event = _event(_chunk({"content": "tok "}))
            batch = event * (1 if mode == "endless" else 256)
            while in_time():
                self._chunked(batch)
                if mode == "endless":
                    self.wfile.flush()
                    time.sleep(0.02)
            return
        if mode == "trickle":
            self._chunked(b'data: {"choices": [{"delta": {"content": "')
            while in_time():
                self._chunked(b"x")
                self.wfile.flush()
                time.sleep(0.1)
            return
        if mode == "long_line":
            self._chunked(b'data: {"choices": [{"index": 0, "delta": {"content": "')
            piece, sent = b"x" * (1 << 20), 0
            while sent < 3 * GIB and in_time():
                self._chunked(piece)
                sent += len(piece)
            return
        bad = {
            "not_utf8": b'{"choices": [{"index": 0, "delta": {"content": "caf\xe9 \xff"}}]}',
            "choices_string": json.dumps(_chunk(None, choices="abc")).encode(),
            "content_int": json.dumps(_chunk({"content": 7})).encode(),
            "usage_negative": json.dumps(_chunk(None, usage={"prompt_tokens": 5, "completion_tokens": -7})).encode(),
            "usage_huge": json.dumps(_chunk(None, usage={"prompt_tokens": 5, "completion_tokens": 10**30})).encode(),
            "nested": b"[" * 100_000,
        }[mode]
        for _ in range(5):
            self._chunked(_event(_chunk({"content": "tok "})))
        self._chunked(_event(bad))
        self._chunked(_event(b"[DONE]"))
        self._chunked(b"")


class HostileOpenAI:
    def __init__(self, *modes: str):
        if not modes or any(mode not in MODES for mode in modes):
            raise ValueError(modes)
        self.modes = modes
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, dict, bytes]] = []  # method, path, headers, body
        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Handler, bind_and_activate=True)
        self._server.daemon_threads = True
        self._server.owner = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> HostileOpenAI:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
