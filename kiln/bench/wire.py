"""Reading an OpenAI server's answer within bounds: time, line length, body and stream size.

A socket timeout bounds one read, not an answer: a server that sends a byte every second, or
chunks forever, never trips it. So each request has a deadline, and a ``Watchdog`` shuts the
socket down when it passes (a blocked read then returns at once). Every read is capped: a
JSON body (``GET /v1/models``, an error) at ``max_body``, one event-stream line (and one
event) at ``max_line``, a whole stream at ``max_stream`` -- a server cannot make kiln hold more.

Public API:
    Bounds(max_line, max_body, max_stream)   the caps, in bytes (defaults: 1 MiB, 16 MiB, 64 MiB)
    DEFAULT_BOUNDS                           ``Bounds()``
    Watchdog(connection, deadline)           a context manager; ``.fired``: it cut the connection
    read_body(response, limit, what) -> bytes       at most ``limit`` bytes, else ``Oversize``
    events(response, bounds) -> iterator of str     each event's ``data``; ``Malformed``/``Oversize``
    Malformed, Oversize                      one-line reasons (``str(err)``) a sample fails with
    size_text(n) -> str                      "1 MiB", "640 KiB", "12 bytes"
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

MiB = 1024 * 1024


class Malformed(Exception):
    """The server sent something that is not the protocol; the message is one line."""


class Oversize(Exception):
    """The server sent more than a bound allows; the message names the bound's option."""


def size_text(n: int) -> str:
    for unit, size in (("GiB", 1024 * MiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


@dataclass(frozen=True)
class Bounds:
    max_line: int = MiB  # one event-stream line, and one event (its data lines together)
    max_body: int = 16 * MiB  # a JSON body: the model list, /version, an error
    max_stream: int = 64 * MiB  # everything one streamed answer may send

    def to_json(self) -> dict:
        return {"max_line": self.max_line, "max_body": self.max_body, "max_stream": self.max_stream}


DEFAULT_BOUNDS = Bounds()


class Watchdog:
    """Shuts ``connection``'s socket down at ``deadline`` (``time.perf_counter()``)."""

    def __init__(self, connection, deadline: float):
        self.fired = False
        self._connection = connection
        self._timer = threading.Timer(max(0.0, deadline - time.perf_counter()), self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        self.fired = True
        sock = getattr(self._connection, "sock", None)
        if sock is not None:
            try:
                # the plain socket's shutdown, also under TLS: it wakes a read blocked in another
                # thread without touching the TLS state that read is using
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()


def read_body(response, limit: int, what: str) -> bytes:
    """The body, when it is at most ``limit`` bytes; ``Oversize`` without reading more otherwise."""
    declared = response.getheader("Content-Length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise Oversize(f"{what} declares {int(declared)} bytes, over the limit of {size_text(limit)} "
                       "(--max-body-bytes)")
    data = response.read(limit + 1)
    if len(data) > limit:
        raise Oversize(f"{what} is over the limit of {size_text(limit)} (--max-body-bytes)")
    return data


def events(response, bounds: Bounds):
    """The ``data`` of each server-sent event, as its last line arrives."""
    lines: list[str] = []
    event_size = 0
    received = 0
    number = 0
    while True:
        raw = response.readline(bounds.max_line + 1)
        if not raw:
            if lines:
                yield "\n".join(lines)
            return
        number += 1
        received += len(raw)
        if len(raw) > bounds.max_line:
            raise Oversize(f"event-stream line {number} is longer than {size_text(bounds.max_line)} "
                           "(--max-line-bytes)")
        if received > bounds.max_stream:
            raise Oversize(f"the stream sent more than {size_text(bounds.max_stream)} (--max-stream-bytes)")
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as err:
            raise Malformed(f"event-stream line {number} is not UTF-8 (byte {err.start}: "
                            f"{raw[err.start:err.start + 1]!r})") from None
        if line.startswith("data:"):
            data = line[5:].lstrip(" ")
            event_size += len(data)
            if event_size > bounds.max_line:
                raise Oversize(f"event at line {number} is longer than {size_text(bounds.max_line)} "
                               "(--max-line-bytes)")
            lines.append(data)
        elif not line and lines:
            yield "\n".join(lines)
            lines, event_size = [], 0
        # comments (":"), "event:" and "id:" lines carry nothing a chat stream needs
