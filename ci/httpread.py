"""Every answer a ci/ script reads from the network, within a size and a time.

A socket timeout bounds one read, not an answer: a server that sends a byte a second, or a body
that never ends, never trips it (``ci/pin_bump_pr.py`` once read an endless body for 230 s under
a 30 s timeout, and a 400 MB one whole). So each request here has a deadline for its whole life
(connecting, the headers, every byte of the body, redirects included), enforced by kiln's
``kiln.bench.wire.Watchdog``, which shuts the socket down when it passes; and a body is read
no further than its cap (one declaring more is refused unread). JSON is then read through
``field``, so an answer of the wrong shape is one line naming the field, not a traceback.

Public API:
    Unreadable                 a ``KilnError``: one line naming the URL and what was wrong
    get(url, *, headers=None, method="GET", data=None, max_bytes=MAX_JSON, deadline=60.0) -> Answer
    get_json(url, **same) -> (Answer, object)     a non-JSON body is ``Unreadable``
    download(url, out, *, max_bytes, deadline, headers=None) -> int   the body streamed into ``out``
    field(obj, key, expected, where) -> value     ``obj[key]`` of type ``expected``, else ``Unreadable``
    of_type(value, expected, where) -> value      the same for a value

``$KILN_CI_HTTP_DEADLINE`` (seconds) and ``$KILN_CI_HTTP_MAX_BYTES`` (bytes), when set, replace
every call's deadline and cap (the tests use them to keep hostile servers short). Proxies come from
the usual ``https_proxy``/``http_proxy``/``no_proxy``; redirects are followed (5 at most), each
under the same deadline. No ``Accept-Encoding`` is sent: the cap counts the bytes as they arrive.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import sys
import time
import urllib.request
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

try:  # the installed kiln (ci/ scripts run with kiln's .venv/bin/python; on a GPU machine, PYTHONPATH=.)
    from kiln.bench.wire import Watchdog
    from kiln.errors import KilnError
    from kiln.oci.limits import size_text
except ImportError as err:
    sys.exit(f"{sys.argv[0]}: {err}: run ci/ scripts with kiln's own Python (.venv/bin/python, the README's set-up)")

MAX_JSON = 64 << 20  # PyPI's /vllm/json is ~2 MB, its simple page ~1 MB, GitHub's answers far less
MAX_REDIRECTS = 5
_READ = 1 << 16


class Unreadable(KilnError):
    """An answer kiln's ci scripts will not read: too big, too slow, not the shape expected."""


@dataclass
class Answer:
    status: int
    url: str  # the last one, after redirects
    headers: dict[str, str]  # lower-cased names
    body: bytes


def _env_number(name: str, default: float) -> float:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise Unreadable(f"${name}={text!r}: not a number") from None
    if value <= 0:
        raise Unreadable(f"${name}={text!r}: must be positive")
    return value


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Unreadable(f"{url}: not an http(s) URL")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and urllib.request.proxy_bypass(parts.hostname):
        proxy = None
    if proxy:
        via = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, proxy_port = via.hostname, via.port or 80
    else:
        host, proxy_port = parts.hostname, port
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(host, proxy_port, timeout=timeout, context=ssl.create_default_context())
        if proxy:
            conn.set_tunnel(parts.hostname, port)
    else:
        conn = http.client.HTTPConnection(host, proxy_port, timeout=timeout)
        if proxy:
            target = url
    return conn, target


def _request(url: str, method: str, headers: dict, data: bytes | None, max_bytes: int, deadline: float,
             sink, only_200: bool = False) -> tuple[int, str, dict[str, str], int]:
    """One exchange (redirects followed), the body handed to ``sink`` chunk by chunk (with
    ``only_200``, another status is ``Unreadable`` before any byte of its body)."""
    limit = _env_number("KILN_CI_HTTP_DEADLINE", deadline)
    cap = int(_env_number("KILN_CI_HTTP_MAX_BYTES", max_bytes))
    end = time.monotonic() + limit
    watchdog = Watchdog(time.perf_counter() + limit)
    late = f"{url}: no complete answer within {limit:g} s"
    with watchdog:
        for _ in range(MAX_REDIRECTS + 1):
            conn, target = _connection(url, max(0.001, min(limit, end - time.monotonic())))
            try:
                try:
                    conn.connect()
                    watchdog.watch(conn.sock)
                    conn.request(method, target, body=data, headers={"Accept-Encoding": "identity", **headers})
                    response = conn.getresponse()
                    answer = {k.lower(): v for k, v in response.getheaders()}
                    if response.status in (301, 302, 303, 307, 308) and "location" in answer and method == "GET":
                        url = urljoin(url, answer["location"])
                        continue
                    if only_200 and response.status != 200:
                        raise Unreadable(f"{url}: HTTP {response.status}")
                    declared = answer.get("content-length", "").strip()
                    if declared.isdigit() and int(declared) > cap:
                        raise Unreadable(f"{url}: declares {int(declared)} bytes, over the limit of {size_text(cap)}")
                    total = 0
                    while chunk := response.read1(_READ):
                        total += len(chunk)
                        if total > cap:
                            raise Unreadable(f"{url}: the answer is over the limit of {size_text(cap)}")
                        sink(chunk)
                        if time.monotonic() > end:
                            raise Unreadable(late)
                    if watchdog.fired or time.monotonic() > end:
                        raise Unreadable(late)
                    return response.status, url, answer, total
                except (OSError, http.client.HTTPException) as err:
                    if watchdog.fired or time.monotonic() > end or isinstance(err, (socket.timeout, TimeoutError)):
                        raise Unreadable(late) from None
                    raise Unreadable(f"{url}: {type(err).__name__}: {err}".splitlines()[0]) from None
            finally:
                conn.close()
    raise Unreadable(f"{url}: more than {MAX_REDIRECTS} redirects")


def get(url: str, *, headers: dict | None = None, method: str = "GET", data: bytes | None = None,
        max_bytes: int = MAX_JSON, deadline: float = 60.0) -> Answer:
    chunks: list[bytes] = []
    status, last, answer, _ = _request(url, method, headers or {}, data, max_bytes, deadline, chunks.append)
    return Answer(status, last, answer, b"".join(chunks))


def get_json(url: str, **kwargs) -> tuple[Answer, object]:
    answer = get(url, **kwargs)
    if not 200 <= answer.status < 300:
        return answer, None
    try:
        return answer, json.loads(answer.body)
    except (ValueError, RecursionError):
        raise Unreadable(f"{answer.url}: the answer is not JSON") from None


def download(url: str, out, *, max_bytes: int, deadline: float, headers: dict | None = None) -> int:
    """The body of a 200 answer written to the binary file ``out``; its size. Another status is
    ``Unreadable`` (nothing written)."""
    return _request(url, "GET", headers or {}, None, max_bytes, deadline, out.write, only_200=True)[3]


_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", bool: "a boolean",
          float: "a number"}


def _kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return _NAMES.get(type(value), type(value).__name__)


def of_type(value, expected: type | tuple, where: str):
    kinds = expected if isinstance(expected, tuple) else (expected,)
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    else:
        ok = isinstance(value, kinds)
    if not ok:
        wanted = " or ".join(_NAMES.get(k, k.__name__) for k in kinds)
        raise Unreadable(f"{where} is {_kind(value)}, not {wanted}")
    return value


def field(obj, key: str, expected: type | tuple, where: str):
    """``obj[key]`` when it is of ``expected``; ``Unreadable`` naming ``where.key`` otherwise."""
    if not isinstance(obj, dict):
        raise Unreadable(f"{where} is {_kind(obj)}, not an object")
    if key not in obj:
        raise Unreadable(f"{where}.{key} is missing")
    return of_type(obj[key], expected, f"{where}.{key}")
