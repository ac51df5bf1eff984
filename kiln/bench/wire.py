"""Reading an OpenAI server's answer within bounds: time, line length, body and stream size.

A socket timeout bounds one read, not an answer: a server that sends a byte every second, or
chunks forever, never trips it. So each request has a deadline, and a ``Watchdog`` shuts the
socket down when it passes (a blocked read then returns at once). Every read is capped: a
JSON body (``GET /v1/models``, an error) at ``max_body``, one event-stream line (and one
event) at ``max_line``, a whole stream at ``max_stream`` -- a server cannot make kiln hold more.

Public API:
    Bounds(max_line, max_body, max_stream)   the caps, in bytes (defaults: 1 MiB, 16 MiB, 64 MiB)
    DEFAULT_BOUNDS                           ``Bounds()``
    Watchdog(deadline)                       a context manager; ``.watch(sock)``; ``.fired``: it cut
    read_body(response, limit, what) -> bytes       at most ``limit`` bytes, else ``Oversize``
    events(response, bounds) -> iterator of str     each event's ``data``; ``Malformed``/``Oversize``
    Malformed, Oversize                      one-line reasons (``str(err)``) a sample fails with
    quote(text, limit=200) -> str            remote text as one printable line
    typed(obj, key, expected, where)         ``obj[key]`` if absent or of that type, else ``Malformed``
    kind(value) -> str                       "a string", "a number", ... (JSON's names)
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

from kiln.oci.limits import size_text

MiB = 1024 * 1024


class Malformed(Exception):
    """The server sent something that is not the protocol; the message is one line."""


class Oversize(Exception):
    """The server sent more than a bound allows; the message names the bound's option."""


@dataclass(frozen=True)
class Bounds:
    max_line: int = MiB  # one event-stream line, and one event (its data lines together)
    max_body: int = 16 * MiB  # a JSON body: the model list, /version, an error
    max_stream: int = 64 * MiB  # everything one streamed answer may send

    def to_json(self) -> dict:
        return {"max_line": self.max_line, "max_body": self.max_body, "max_stream": self.max_stream}


DEFAULT_BOUNDS = Bounds()


class Watchdog:
    """Shuts the socket it watches down at ``deadline`` (``time.perf_counter()``).

    It holds the socket itself: ``http.client`` drops the connection's reference to it once a
    ``Connection: close`` answer has begun, while the answer is still being read from it.
    """

    def __init__(self, deadline: float):
        self.fired = False
        self._sock = None
        self._lock = threading.Lock()
        delay = min(max(0.0, deadline - time.perf_counter()), threading.TIMEOUT_MAX)
        self._timer = threading.Timer(delay, self._fire)
        self._timer.daemon = True

    def watch(self, sock) -> None:
        """Watch ``sock`` (just connected); cut at once when the deadline has already passed."""
        with self._lock:
            self._sock = sock
            fired = self.fired
        if fired:
            self._shutdown(sock)

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            sock = self._sock
        if sock is not None:
            self._shutdown(sock)

    @staticmethod
    def _shutdown(sock) -> None:
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


def quote(text: str, limit: int = 200) -> str:
    """Remote text as one printable line of at most ``limit`` characters."""
    text = " ".join("".join(c if c.isprintable() else " " for c in text[: limit * 4]).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


TYPE_NAMES = {str: "a string", int: "an integer", list: "a list", dict: "an object"}


def kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return "a number" if isinstance(value, int | float) else TYPE_NAMES.get(type(value), type(value).__name__)


def _at(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def typed(obj: dict, key: str, expected: type, where: str):
    """``obj[key]`` when absent, null or of ``expected``; ``Malformed`` naming it otherwise."""
    value = obj.get(key)
    if value is None or (isinstance(value, expected) and not (expected is int and isinstance(value, bool))):
        return value
    raise Malformed(f"{_at(where, key)} is {kind(value)}, not {TYPE_NAMES[expected]}")


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
