"""A base layer's tar bytes as the layer walk reads them: fetched ahead, decompressed, bounded.

Public API:
    open_tar(reader, mode, name, budget, reporter=SILENT, advance=None, diff_id=None)
            -> ctx[tarfile.TarFile]
        ``reader``: the layer's verifying reader (bytes as stored); ``mode``: how they are stored,
        ``kiln.oci.mediatypes.tar_mode`` ("r|gz", "r|zst" or "r|"); the tar is opened in stream
        mode over the decompressed bytes; ``advance(n)`` is told of the stored bytes read;
        ``name`` ("<image>: layer <digest>") starts every error; ``diff_id``: the config's
        ``rootfs.diff_ids`` entry, checked against the sha256 of every decompressed byte once
        the stream has ended (None: not checked)
    Inflating(raw)       a gzip stream (every member) decompressed by ISA-L, bounded per read
    Unzstd(raw)          a zstd stream (every frame, skippable ones too) decompressed, bounded per read
    LAYER_BUFFER         decompressed bytes handed on at a time (the most one read returns)

Every decompressed byte is counted against the build's ``Budget`` (``kiln.oci.limits``): a layer
that inflates past the per-layer or per-build limit stops there, in one line naming the limit,
gzip and zstd alike (the count is of what the decompressor hands out, whatever it is).
Decompression happens here, by ISA-L (``isal``: measured 2.1-2.3x the standard zlib on vLLM's
layer, ahead of zlib-ng and rapidgzip, docs/BENCHMARKS.md), every gzip member of the stream, at
most ``LAYER_BUFFER`` decompressed bytes per read, never in tarfile's ``r|gz`` mode, whose
10 KiB reads re-copy a whole decompressed chunk per read: an 8 GiB run of zeros took minutes to
skip that way, and memory grew with the compression ratio.
Skipping an entry kiln does not need still means decompressing it (gzip cannot seek); only
layers below those holding vLLM are never fetched or decompressed at all (``layerwalk``).

zstd layers (``tar+zstd``, what BuildKit pushes with ``compression=zstd``) are decompressed by
libzstd through Python 3.14's ``compression.zstd`` (its backport, ``backports.zstd``, before
3.14), the same way: at most ``LAYER_BUFFER`` bytes per read (``max_length``), every frame of
a concatenated stream, skippable frames (zstd:chunked's metadata) passed over, a stream cut
before its frame's end refused. libzstd's default window limit (128 MiB) bounds the memory a
frame can ask for: a frame declaring a larger window is refused, not allocated.

A download that brings no byte for ``limits.stall_warning`` seconds says so through the
``Reporter`` (once per stall, naming the layer and the read timeout that will end the attempt),
and the build's deadline is checked while waiting.
"""

from __future__ import annotations

import hashlib
import queue
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

from isal import isal_zlib

try:
    from compression import zstd  # Python 3.14
except ImportError:
    from backports import zstd

from kiln.errors import KilnError, is_no_space
from kiln.oci.limits import Budget, seconds_text
from kiln.report import SILENT, Reporter

_READ_CHUNK = 1 << 20
LAYER_BUFFER = 1 << 20
# tarfile's own reads: its stream mode copies what is left of its buffer at every read (each
# 512-byte header), so a 1 MiB buffer copied ~20,000 times 0.5 MiB on vLLM's layer (0.8 s under cProfile)
_TAR_READ = 64 << 10
_POLL = 0.25  # seconds between deadline checks while a download brings nothing


_DECOMPRESSORS = {"r|gz": lambda raw: Inflating(raw), "r|zst": lambda raw: Unzstd(raw), "r|": lambda raw: raw}


@contextmanager
def open_tar(reader, mode: str, name: str, budget: Budget, reporter: Reporter = SILENT,
             advance: Callable[[int], object] | None = None, diff_id: str | None = None) -> Iterator[tarfile.TarFile]:
    stop = threading.Event()  # every thread's, set by the first stage to close
    stored = _Advancing(reader, advance) if advance else reader
    with _Hashing(stop) if diff_id is not None else nullcontext() as hashing, \
            _Ahead(stored, stop, "kiln-layer-fetch") as fetched, \
            _Ahead(_Counted(_DECOMPRESSORS[mode](fetched), name, budget, hashing), stop,
                   "kiln-layer-inflate", (name, budget, reporter)) as counted:
        try:
            with tarfile.open(fileobj=counted, mode="r|", bufsize=_TAR_READ) as tar:
                yield tar
            # the rest after the tar's end (padding) up to the stream's end: the gzip trailer,
            # whose CRC is checked, or the zstd frame's end (and its checksum, when it has one)
            while counted.read(LAYER_BUFFER):
                pass
        except (tarfile.TarError, EOFError, OSError, isal_zlib.error, zstd.ZstdError) as err:
            if is_no_space(err):  # the disk filled (the tree, or the blob cache's copy): not the layer's fault
                raise
            raise KilnError(f"{name} is not a readable tar ({err})") from None
        if diff_id is not None and counted.reader.diff_id != diff_id:
            raise KilnError(f"{name} decompresses to {counted.reader.diff_id}, not to its diff_id {diff_id} in the "
                            f"image config (rootfs.diff_ids): the layer or the config is corrupt")


class Inflating:
    """The bytes of a gzip stream, every member (a layer may be concatenated gzip), inflated by
    ISA-L; one ``read`` never returns more than asked, whatever the compression ratio."""

    def __init__(self, raw) -> None:
        self._raw = raw
        self._inflate = isal_zlib.decompressobj(31)
        self._pending = b""  # compressed input not yet given to the inflater
        self._started = False  # the current member has consumed input

    def read(self, n: int = -1) -> bytes:
        want = LAYER_BUFFER if n is None or n < 0 else max(1, min(n, LAYER_BUFFER))
        while True:
            if self._inflate.eof:
                rest = self._inflate.unused_data + self._pending
                self._pending = b""
                if not rest:
                    rest = self._raw.read(_READ_CHUNK)
                    if not rest:
                        return b""
                self._inflate, self._started, self._pending = isal_zlib.decompressobj(31), False, rest
            if not self._pending:
                self._pending = self._inflate.unconsumed_tail or self._raw.read(_READ_CHUNK)
                if not self._pending:
                    raise EOFError("compressed data ended before the end-of-stream marker")
            data = self._inflate.decompress(self._pending, want)
            self._pending = self._inflate.unconsumed_tail
            self._started = True
            if data:
                return data


class Unzstd:
    """The bytes of a zstd stream, every frame (a layer may be concatenated frames, and
    zstd:chunked's carry skippable ones), decompressed by libzstd; one ``read`` never returns
    more than asked, whatever the compression ratio."""

    def __init__(self, raw) -> None:
        self._raw = raw
        self._frame = zstd.ZstdDecompressor()

    def read(self, n: int = -1) -> bytes:
        want = LAYER_BUFFER if n is None or n < 0 else max(1, min(n, LAYER_BUFFER))
        while True:
            if self._frame.eof:  # the next frame starts with what the last one left
                data = self._frame.unused_data or self._raw.read(_READ_CHUNK)
                if not data:
                    return b""
                self._frame = zstd.ZstdDecompressor()
            elif self._frame.needs_input:
                data = self._raw.read(_READ_CHUNK)
                if not data:
                    raise EOFError("compressed data ended before the end of a zstd frame")
            else:
                data = b""  # output held back by max_length comes out before more input goes in
            out = self._frame.decompress(data, want)
            if out:
                return out


class _Counted:
    """Decompressed bytes, counted against the budget and hashed (the layer's diff_id) as they
    are handed on."""

    def __init__(self, raw, name: str, budget: Budget, hashing: _Hashing | None):
        self._raw, self._name, self._budget = raw, name, budget
        self.total = 0
        self._hashing = hashing

    @property
    def diff_id(self) -> str:
        return f"sha256:{self._hashing.hexdigest()}"

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(LAYER_BUFFER if n is None or n < 0 else min(n, LAYER_BUFFER))
        if data:
            if self._hashing is not None:
                self._hashing.update(data)
            self.total += len(data)
            self._budget.inflated(self._name, self.total, len(data))
            self._budget.check_deadline(self._name)
        return data


class _Hashing:
    """sha256 of the bytes handed to ``update``, computed in a thread of its own: on the inflate
    thread it was 0.45 s of the pull's 2.3 s on vLLM's layer, one after the other (hashlib
    releases the GIL, so here it runs on the core the tar's parsing leaves). At most ``depth``
    chunks wait; the thread ends at ``hexdigest`` or when ``stop`` is set (the stream closed)."""

    def __init__(self, stop: threading.Event, depth: int = 16):
        self._stop = stop
        self._sha256 = hashlib.sha256()
        self._queue: queue.Queue = queue.Queue(depth)
        self._thread = threading.Thread(target=self._run, name="kiln-layer-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                data = self._queue.get(timeout=_POLL)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            if data is None:
                return
            self._sha256.update(data)

    def update(self, data: bytes) -> None:
        if not _offer(self._queue, data, self._stop):
            raise _Stopped()

    def hexdigest(self) -> str:
        self.update(None)
        self._thread.join()
        return self._sha256.hexdigest()

    def __enter__(self) -> _Hashing:
        return self

    def __exit__(self, *exc) -> None:  # (after the stages: ``stop`` is set, the thread ends)
        self._stop.set()
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join()


class _Advancing:
    """``reader``, telling ``advance`` of every stored byte read (the layer's progress)."""

    def __init__(self, reader, advance: Callable[[int], object]):
        self._reader, self._advance = reader, advance

    def read(self, n: int = -1) -> bytes:
        data = self._reader.read(n)
        self._advance(len(data))
        return data


class _Stopped(Exception):
    """The reading side closed the stream while a thread still waited on it."""


def _offer(into: queue.Queue, item, stop: threading.Event) -> bool:
    """``item`` put in ``into`` once it has room; False (not put) once ``stop`` is set."""
    while not stop.is_set():
        try:
            into.put(item, timeout=_POLL)
            return True
        except queue.Full:
            continue
    return False


class _Ahead:
    """Reads ``reader`` ahead in a thread, 1 MiB at a time, while the caller goes on.

    A layer is read in stages, so that what releases the GIL overlaps what does not: a thread
    fetches the stored bytes (HTTP, their sha256, the blob-cache write), a second decompresses
    them (ISA-L or libzstd; the diff_id's sha256 in a third, ``_Hashing``), and the caller parses
    the tar, which is Python (the files are written by yet another thread: ``layerwalk``). With the
    inflate on the caller's thread, it alone took longer than the fetch; moved beside the fetch,
    that thread became the slower side. Reads are 1 MiB: one call per tarfile-sized read through
    the digest, cache and HTTP layers cost ~0.5 s per 250 MB.

    ``stop`` is shared by a stream's stages: ``close`` (on leaving the block) sets it and joins
    the thread, and a stage waiting on another stops waiting (the blob cache then drains and
    verifies the rest of the blob on the caller's thread). An error in the thread (the layer's,
    the budget's, the deadline's) is raised to whoever reads next. ``watch`` (name, budget,
    reporter): the reader is the build's own thread, which meanwhile checks the deadline, and
    warns once a stall lasts.
    """

    def __init__(self, reader, stop: threading.Event, thread_name: str,
                 watch: tuple[str, Budget, Reporter] | None = None, depth: int = 8):
        self.reader, self._stop, self._watch = reader, stop, watch
        self._queue: queue.Queue = queue.Queue(depth)
        self._pending = memoryview(b"")
        self._eof = False
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def __enter__(self) -> _Ahead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                data = self.reader.read(_READ_CHUNK)
                self._put(data)
                if not data:
                    return
        except BaseException as err:  # handed to the reading side
            self._put(err)

    def _put(self, item) -> None:
        _offer(self._queue, item, self._stop)  # (once the stream is closed, nobody reads it)

    def _next(self):
        """The next item from the thread; meanwhile the deadline is checked and a stall reported."""
        since = time.monotonic()
        warned = False
        while True:
            try:
                return self._queue.get(timeout=_POLL)
            except queue.Empty:
                pass
            if self._stop.is_set():
                raise _Stopped()
            if self._watch is None:
                continue
            name, budget, reporter = self._watch
            budget.check_deadline(f"{name}: waiting for the registry")
            waited = time.monotonic() - since
            limits = budget.limits
            if not warned and waited >= limits.stall_warning:
                warned = True
                reporter.warn(
                    f"{name}: no bytes for {seconds_text(round(waited, 1))}; still waiting for the registry "
                    f"(a read gives up after {seconds_text(limits.read_timeout)} and resumes; "
                    f"{limits.raise_hint('read_timeout')})")

    def read(self, n: int = -1) -> bytes:
        while not self._pending:
            if self._eof:
                return b""
            item = self._next()
            if isinstance(item, BaseException):
                self._eof = True
                raise item
            if not item:
                self._eof = True
                return b""
            self._pending = memoryview(item)
        n = len(self._pending) if n is None or n < 0 else n
        data, self._pending = self._pending[:n], self._pending[n:]
        return bytes(data)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
