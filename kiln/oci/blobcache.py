"""Content-addressed blob cache: ``<cache>/blobs/sha256/<hex>``, written only once verified.

Public API:
    BlobCache(root=None)                   root defaults to ``cache_root()/"blobs"``
        .path(digest) -> Path   .has(digest) -> bool
        .open(digest, what, fetch, size=None) -> ctx[VerifyingReader]
            yields a reader over the cached file, or over ``fetch()`` (a context manager giving
            the raw remote stream) teed into a temporary file; on leaving the block the rest is
            drained, size and sha256 checked, and only then the file is renamed into place.
        .read_bytes(digest, what, fetch, size=None) -> bytes

A cached file failing verification (disk corruption, a manual edit) is deleted and reported;
it is never handed out. Concurrent fillers each write a private temp file; the renames of
identical verified content are interchangeable, so no lock is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from kiln.cache import cache_root
from kiln.errors import KilnError, is_no_space, writing
from kiln.oci.digest import BlobVerificationError, VerifyingReader, check_digest
from kiln.oci.limits import LimitExceeded
from kiln.oci.retry import TransferError
from kiln.staging import streamed_file


class BlobCache:
    def __init__(self, root: Path | None = None):
        self.root = root or cache_root() / "blobs"

    def path(self, digest: str) -> Path:
        algorithm, _, hexdigest = check_digest(digest, "blob cache").partition(":")
        return self.root / algorithm / hexdigest

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    @contextmanager
    def open(self, digest: str, what: str, fetch: Callable[[], AbstractContextManager],
             size: int | None = None) -> Iterator[VerifyingReader]:
        final = self.path(digest)
        if final.is_file():
            with final.open("rb") as handle:
                reader = VerifyingReader(handle, digest, f"cached {what}", size)
                try:
                    with _blame_corruption(reader):
                        yield reader
                except BlobVerificationError:
                    final.unlink(missing_ok=True)
                    raise KilnError(f"cached {what} was corrupted and has been removed; run again") from None
            return
        with streamed_file(final.parent, f".tmp-{final.name[:16]}-") as out:
            sink = _NamedSink(out.handle, final, size, what)
            with fetch() as raw:
                reader = VerifyingReader(raw, digest, what, size, sink=sink)
                with _blame_corruption(reader):
                    yield reader
            with writing(final, size, what):
                out.land(final)

    def read_bytes(self, digest: str, what: str, fetch: Callable[[], AbstractContextManager],
                   size: int | None = None) -> bytes:
        chunks = []
        with self.open(digest, what, fetch, size) as reader:
            while chunk := reader.read(1 << 20):
                chunks.append(chunk)
        return b"".join(chunks)


class _NamedSink:
    """The cache file a download is copied into: a full disk names it and the blob's size."""

    def __init__(self, handle, path: Path, size: int | None, what: str):
        self.handle, self.path, self.size, self.what = handle, path, size, what

    def write(self, data: bytes) -> int:
        with writing(self.path, self.size, self.what):
            return self.handle.write(data)


@contextmanager
def _blame_corruption(reader: VerifyingReader) -> Iterator[None]:
    """Verify on leaving the block; if the consumer failed first, say whether the blob was bad.

    A corrupted gzip layer usually breaks the tar reader before the digest is known; the
    useful message is then "digest mismatch", not "not a gzip file". A transfer that already
    gave up is not drained again (that would only repeat its retries), nor one stopped by a
    limit (the rest of a bomb, or of a stalled download, is not worth fetching).
    """
    try:
        yield
    except (TransferError, LimitExceeded):
        raise
    except Exception as err:
        if not reader.verified and not is_no_space(err):  # (a full disk: draining would only fill it again)
            try:
                reader.finish()  # raises the mismatch when the bytes were bad
            except OSError as drained:  # the disk filled while draining: that is the error to report
                if is_no_space(drained):
                    raise drained from None
                raise err from None
        raise
    reader.finish()
