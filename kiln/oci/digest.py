"""sha256 digests: validation, and readers that verify a stream while it is consumed.

Public API:
    sha256_digest(data: bytes) -> str            "sha256:<hex>"
    sha256_text(text: str) -> str                <hex> of its UTF-8 bytes (a source file's, as records keep them)
    check_digest(digest: str, what: str) -> str  validated digest, or KilnError
    VerifyingReader(raw, digest, what, size=None, sink=None)
        .read(n) -> bytes   hashes (and copies to ``sink``) every byte handed out
        .finish()           drains the rest, then raises KilnError unless size and digest match
        .bytes_read   .verified
    BlobVerificationError(KilnError)    raised by VerifyingReader for a wrong size or digest

A blob is trusted only after ``finish()``: tar readers stop at the end-of-archive marker,
so callers must drain the remainder, or a corrupted tail would pass unnoticed.
"""

from __future__ import annotations

import hashlib
import re
from typing import BinaryIO, Protocol

from kiln.errors import KilnError

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_CHUNK = 1 << 20


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_digest(digest: str, what: str) -> str:
    """Return ``digest`` if it is ``sha256:<64 lower-case hex>``; other algorithms are refused."""
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise KilnError(f"{what}: {digest!r} is not a sha256 digest kiln can verify")
    return digest


class BlobVerificationError(KilnError):
    """The bytes read are not the blob the descriptor names."""


class _Readable(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


class VerifyingReader:
    """A file-like reader over ``raw`` that checks size and sha256 once drained."""

    def __init__(self, raw: _Readable, digest: str, what: str, size: int | None = None,
                 sink: BinaryIO | None = None):
        self._raw = raw
        self._digest = check_digest(digest, what)
        self._what = what
        self._size = size
        self._sink = sink
        self._sha = hashlib.sha256()
        self.bytes_read = 0
        self.verified = False

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n if n is not None and n >= 0 else _CHUNK * 64)
        if data:
            self._sha.update(data)
            self.bytes_read += len(data)
            if self._sink is not None:
                self._sink.write(data)
            if self._size is not None and self.bytes_read > self._size:
                raise BlobVerificationError(f"{self._what}: longer than the {self._size} bytes its descriptor declares")
        return data

    def finish(self) -> None:
        while self.read(_CHUNK):
            pass
        actual = "sha256:" + self._sha.hexdigest()
        if self._size is not None and self.bytes_read != self._size:
            raise BlobVerificationError(f"{self._what}: got {self.bytes_read} bytes, descriptor says {self._size}; refusing it")
        if actual != self._digest:
            raise BlobVerificationError(f"{self._what}: digest mismatch (expected {self._digest}, got {actual}); refusing the blob")
        self.verified = True
