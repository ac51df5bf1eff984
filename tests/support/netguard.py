"""The `network` marker's guard (tests/conftest.py), in the pytest worker and in every Python
process a test starts: a socket to any host but this one, or a name reserved never to resolve, is
refused with an OSError naming the test.

A child finds the guard through ``offline_site/sitecustomize.py`` (the worker puts that folder on
PYTHONPATH) and the test through ``KILN_TEST_OFFLINE`` ("<test id>\\n<file>"), set only while a
test not marked network runs; the child appends each host it was refused to <file>, which the
worker reads at the test's teardown, so a child that swallowed the refusal still fails the test.
Not covered: a child started with ``-I``/``-S`` or an environment of its own, and programs that
are not Python (git, skopeo, podman).
"""

from __future__ import annotations

import sys
from pathlib import Path

ENV = "KILN_TEST_OFFLINE"
SITE = Path(__file__).resolve().parent / "offline_site"
LOOPBACK = ("127.", "::1", "localhost", "0.0.0.0")
# names reserved never to resolve (RFC 2606, RFC 6761): tests of a DNS failure use them
RESERVED = (".invalid", ".test", ".example", ".localhost")


def host_of(event: str, args: tuple) -> str | None:
    """The host a socket audit event reaches, or None for an event that reaches none."""
    if event == "socket.getaddrinfo":
        host = args[0]
    elif event == "socket.connect" and isinstance(args[1], tuple):
        host = args[1][0]
    else:
        return None
    return host.decode() if isinstance(host, bytes) else str(host or "")


def outside(host: str | None) -> bool:
    """True for a host an offline test may not reach ("": this host)."""
    return bool(host) and not host.startswith(LOOPBACK) and not host.rstrip(".").endswith(RESERVED)


def refusal(test: str, host: str) -> OSError:
    return OSError(f"{test} reached {host} but is not marked network (tests/conftest.py)")


def guard_child(value: str) -> None:
    """In a child of an offline test (``value``: the ENV variable's): refuse, and record, any
    socket to another host."""
    test, _, record = value.partition("\n")

    def audit(event: str, args: tuple) -> None:
        if event.startswith("socket."):
            host = host_of(event, args)
            if outside(host):
                with open(record, "a") as f:
                    f.write(host + "\n")
                raise refusal(test, host)

    sys.addaudithook(audit)


def reached_by_children(value: str | None) -> list[str]:
    """The hosts the children of the test ``value`` names were refused (and the record removed)."""
    if not value:
        return []
    record = Path(value.partition("\n")[2])
    try:
        return record.read_text().split()
    except FileNotFoundError:
        return []
    finally:
        record.unlink(missing_ok=True)
