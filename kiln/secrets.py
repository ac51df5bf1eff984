"""The secrets kiln holds, and the scrubber every message and evidence file passes through.

kiln never puts a credential in a message itself, but it does show text that comes from
elsewhere: a registry's error body, an OpenAI server's 500 message, a streamed answer. Such a
server may echo what it was sent -- ``Authorization: Basic <base64 user:password>``, a bearer
token, an API key. So every secret is registered where kiln loads or obtains it, and every
line kiln shows (``KilnError`` text, warnings, ``--json``) and every evidence file it writes is
scrubbed of all of them, whatever the text's source.

Public API:
    register(secret)                    a token or key, as sent
    register_credentials(user, password) the password, base64 of ``user:password`` (the
                                        ``Basic`` header's value) and base64 of the password
    scrub(text) -> str                  each known secret replaced by ``REDACTED``
    scrub_data(value) -> value          the same through dicts, lists and strings (JSON data)
    REDACTED, MIN_LENGTH

A secret shorter than ``MIN_LENGTH`` characters is not scrubbed: blanking every ``abc`` in
every message would make them unreadable, and so short a secret protects nothing anyway.
"""

from __future__ import annotations

import base64
import threading

REDACTED = "<redacted>"
MIN_LENGTH = 4

_lock = threading.Lock()
_known: tuple[str, ...] = ()  # longest first, so a secret inside another goes with it


def register(secret: str | None) -> None:
    global _known
    if not secret or len(secret) < MIN_LENGTH:
        return
    with _lock:
        if secret not in _known:
            _known = tuple(sorted({*_known, secret}, key=len, reverse=True))


def register_credentials(user: str, password: str) -> None:
    register(password)
    if password:
        register(base64.b64encode(f"{user}:{password}".encode()).decode())
        register(base64.b64encode(password.encode()).decode())


def scrub(text: str) -> str:
    for secret in _known:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def scrub_data(value):
    """``value`` with every string in it (keys included) scrubbed; other values as they are."""
    if not _known:
        return value
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, dict):
        return {scrub_data(k): scrub_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrub_data(v) for v in value]
    return value
