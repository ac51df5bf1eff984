"""How registry transfers retry: how often, how long to wait, and what counts as transient.

Public API:
    RetryPolicy(retries=3, backoff=0.5, backoff_max=8.0, retry_after_max=30.0)
        RetryPolicy.from_env() -> RetryPolicy
        .delay(attempt, retry_after=None) -> float     seconds to wait before retry ``attempt`` (0-based)
    retry_after(response, policy) -> float | None      a 429/503 answer's ``Retry-After``, capped
    TransferError(KilnError)    a transfer that broke (connection reset, truncated body, 429/5xx);
                                ``.retry_after`` carries the registry's requested wait, if any
    BROKEN_CONNECTION           exception classes meaning "the connection broke mid-transfer"
    RETRY_STATUS                HTTP statuses worth retrying

Environment (every registry client reads it when created; tests use it to run fast):
    KILN_REGISTRY_RETRIES          retries after the first attempt, per request, per blob download
                                   (resumes) and per blob upload (fresh upload sessions); default 3
    KILN_REGISTRY_BACKOFF          first backoff in seconds, doubled per retry; default 0.5
    KILN_REGISTRY_BACKOFF_MAX      backoff cap in seconds; default 8
    KILN_REGISTRY_RETRY_AFTER_MAX  cap on a registry's ``Retry-After`` in seconds; default 30

Bounded everywhere: a registry that keeps failing costs at most ``retries + 1`` attempts of each
operation, and no wait is longer than its cap.
"""

from __future__ import annotations

import http.client
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

import requests
import urllib3

from kiln.errors import KilnError

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})

# A read from a streamed body raises urllib3's errors (ProtocolError wraps a reset or an
# IncompleteRead), not requests' ones; a send raises requests' ConnectionError.
BROKEN_CONNECTION = (
    requests.ConnectionError,
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,
    urllib3.exceptions.HTTPError,
    http.client.HTTPException,
    ConnectionError,
    TimeoutError,
)


class TransferError(KilnError):
    """A registry transfer that broke or was refused for now (retried by its caller, bounded)."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 3
    backoff: float = 0.5
    backoff_max: float = 8.0
    retry_after_max: float = 30.0

    @classmethod
    def from_env(cls) -> RetryPolicy:
        return cls(
            retries=int(_env_number("KILN_REGISTRY_RETRIES", cls.retries, integer=True)),
            backoff=_env_number("KILN_REGISTRY_BACKOFF", cls.backoff),
            backoff_max=_env_number("KILN_REGISTRY_BACKOFF_MAX", cls.backoff_max),
            retry_after_max=_env_number("KILN_REGISTRY_RETRY_AFTER_MAX", cls.retry_after_max),
        )

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.retry_after_max)
        return min(self.backoff * 2**attempt, self.backoff_max)


def retry_after(response: requests.Response) -> float | None:
    """``Retry-After`` as seconds (delta or HTTP date); None when absent or unreadable."""
    value = response.headers.get("Retry-After", "").strip()
    if not value:
        return None
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max((when - datetime.now(UTC)).total_seconds(), 0.0)


def _env_number(name: str, default: float, integer: bool = False) -> float:
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        raise KilnError(f"${name}={text!r}: expected {'a whole number' if integer else 'a number'}") from None
    if value < 0:
        raise KilnError(f"${name}={text!r}: must not be negative")
    return value
