"""Gzip layers are inflated by ISA-L (``kiln.source.layerstream.Inflating``): same members as the
standard library's ``r|gz``, every member of a concatenated gzip, corrupt or cut data refused,
and no read larger than asked whatever the compression ratio. zstd layers
(``kiln.source.layerstream.Unzstd``) alike: every frame, skippable frames passed over, corrupt or
cut data refused, bounded reads, the same limits. Every layer's decompressed bytes are checked
against its diff_id."""

from __future__ import annotations

import gzip
import hashlib
import io
import struct
import tarfile
import zlib

import pytest

try:
    from compression import zstd
except ImportError:
    from backports import zstd

from kiln.errors import KilnError
from kiln.oci.limits import Budget, LimitExceeded, Limits
from kiln.source.layerstream import LAYER_BUFFER, Inflating, Unzstd, open_tar


def _tar(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


class _OneByOne(io.RawIOBase):
    """A source that hands out little at a time, as a network stream does."""

    def __init__(self, data: bytes):
        self._data = io.BytesIO(data)

    def read(self, size: int = -1) -> bytes:
        return self._data.read(min(size if size >= 0 else 1 << 30, 4099))


FILES = {f"usr/lib/vllm/m{i}.py": bytes([i % 251]) * (i * 997) for i in range(60)}


def _members(fileobj, mode: str, diff_id: str | None = None, limits: Limits | None = None) -> dict[str, bytes]:
    """The layer's files as the layer walk reads them (``open_tar``)."""
    with open_tar(fileobj, mode, "test layer", Budget(limits or Limits()), diff_id=diff_id) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _skippable(payload: bytes) -> bytes:
    """A zstd skippable frame (zstd:chunked keeps its table of contents in one)."""
    return struct.pack("<II", 0x184D2A50, len(payload)) + payload


def test_a_bomb_is_read_a_buffer_at_a_time():
    blob = gzip.compress(b"\0" * (64 << 20), mtime=0)  # 64 MiB of zeros, ~64 KiB compressed
    inflating = Inflating(io.BytesIO(blob))
    sizes = []
    while chunk := inflating.read(1 << 30):
        sizes.append(len(chunk))
    assert sum(sizes) == 64 << 20 and max(sizes) <= LAYER_BUFFER


def test_same_members_as_the_standard_library():
    blob = gzip.compress(_tar(FILES), mtime=0)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r|gz") as tar:
        expected = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}
    assert _members(_OneByOne(blob), "r|gz") == expected == FILES
    assert _members(io.BytesIO(_tar(FILES)), "r|") == FILES  # an uncompressed layer as it is


def test_concatenated_gzip_members_are_one_stream():
    raw = _tar(FILES)
    half = len(raw) // 2
    blob = gzip.compress(raw[:half], mtime=0) + gzip.compress(raw[half:], mtime=0)
    assert _members(_OneByOne(blob), "r|gz") == FILES


def test_corrupt_and_cut_streams_are_refused():
    blob = bytearray(gzip.compress(_tar(FILES), mtime=0))
    blob[len(blob) // 2] ^= 0xFF
    with pytest.raises(KilnError, match="test layer is not a readable tar .*checksum"):
        _members(io.BytesIO(bytes(blob)), "r|gz")  # the gzip trailer's CRC, read after the tar's end
    with pytest.raises(KilnError, match="ended before the end-of-stream marker"):
        _members(io.BytesIO(gzip.compress(_tar(FILES))[:-4000]), "r|gz")
    with pytest.raises(KilnError, match="Invalid deflate block"):
        _members(io.BytesIO(b"\x1f\x8b\x08\x00" + b"\x00" * 600), "r|gz")


# -- zstd ------------------------------------------------------------------------------------


def test_a_zstd_bomb_is_read_a_buffer_at_a_time():
    blob = zstd.compress(b"\0" * (256 << 20), 19)  # 256 MiB of zeros, ~8 KiB compressed
    assert len(blob) < 64 << 10
    unzstd = Unzstd(io.BytesIO(blob))
    sizes = []
    while chunk := unzstd.read(1 << 30):
        sizes.append(len(chunk))
    assert sum(sizes) == 256 << 20 and max(sizes) <= LAYER_BUFFER


def test_zstd_gives_the_same_members_frames_and_skippable_frames_included():
    raw = _tar(FILES)
    assert _members(_OneByOne(zstd.compress(raw)), "r|zst", _sha(raw)) == FILES
    third = len(raw) // 3
    frames = (zstd.compress(raw[:third]) + _skippable(b"toc") + zstd.compress(raw[third:2 * third], 19)
              + zstd.compress(raw[2 * third:]) + _skippable(b"footer"))
    assert _members(_OneByOne(frames), "r|zst", _sha(raw)) == FILES


def test_corrupt_and_cut_zstd_streams_are_refused():
    raw = _tar(FILES)
    blob = bytearray(zstd.compress(raw, options={zstd.CompressionParameter.checksum_flag: 1}))
    blob[len(blob) // 2] ^= 0xFF
    with pytest.raises(KilnError, match="test layer is not a readable tar .*"):
        _members(io.BytesIO(bytes(blob)), "r|zst")
    with pytest.raises(KilnError, match="ended before the end of a zstd frame"):
        _members(io.BytesIO(zstd.compress(raw)[:-4000]), "r|zst")
    with pytest.raises(KilnError, match="test layer is not a readable tar .*Unknown frame descriptor"):
        _members(io.BytesIO(zstd.compress(raw) + b"not zstd"), "r|zst")  # nothing but frames follows
    with pytest.raises(KilnError, match="Unknown frame descriptor"):
        _members(io.BytesIO(gzip.compress(raw)), "r|zst")  # a gzip blob the manifest calls zstd


def test_a_zstd_frame_asking_for_a_window_over_libzstds_limit_is_refused():
    """A frame may declare a window (the memory its decoder needs) of up to 2 GiB and more;
    libzstd's default limit (128 MiB) refuses one above it before allocating."""
    options = {zstd.CompressionParameter.window_log: 28, zstd.CompressionParameter.enable_long_distance_matching: 1}
    blob = zstd.compress(_tar({"big": b"\1" * (300 << 20)}), options=options)
    with pytest.raises(KilnError, match="test layer is not a readable tar .*"):
        _members(io.BytesIO(blob), "r|zst")


@pytest.mark.parametrize("mode", ["r|gz", "r|zst"])
def test_a_layer_stops_at_the_layer_limit(mode):
    raw = _tar({"opt/zeros": b"\0" * (64 << 20)})
    blob = gzip.compress(raw, mtime=0) if mode == "r|gz" else zstd.compress(raw, 19)
    with pytest.raises(LimitExceeded, match="test layer: decompresses to more than 8 MiB, kiln's limit for one layer"):
        _members(io.BytesIO(blob), mode, limits=Limits(layer_bytes=8 << 20))
    budget = Budget(Limits(build_bytes=96 << 20))
    with open_tar(io.BytesIO(blob), mode, "first", budget) as tar:
        list(tar)
    with pytest.raises(LimitExceeded, match="second: the layers read decompress to more than 96 MiB"):
        with open_tar(io.BytesIO(blob), mode, "second", budget) as tar:
            list(tar)


@pytest.mark.parametrize("mode", ["r|gz", "r|zst", "r|"])
def test_the_decompressed_bytes_must_be_the_diff_id(mode):
    raw = _tar(FILES)
    blob = {"r|gz": gzip.compress(raw, mtime=0), "r|zst": zstd.compress(raw), "r|": raw}[mode]
    assert _members(io.BytesIO(blob), mode, _sha(raw)) == FILES
    wrong = _sha(raw + b"\0" * 512)  # the same files, one more block of padding
    with pytest.raises(KilnError) as err:
        _members(io.BytesIO(blob), mode, wrong)
    assert str(err.value) == (f"test layer decompresses to {_sha(raw)}, not to its diff_id {wrong} in the image "
                              "config (rootfs.diff_ids): the layer or the config is corrupt")


class _Endless(io.RawIOBase):
    """A gzip layer that never ends: a first member, then zeros compressed on the fly."""

    def __init__(self):
        self._gzip = zlib.compressobj(6, zlib.DEFLATED, 31)
        self._first = _tar({"first.py": b"x"})[:1024]  # its header and data block

    def read(self, size: int = -1) -> bytes:
        data, self._first = self._first or b"\0" * (1 << 20), b""
        return self._gzip.compress(data) + self._gzip.flush(zlib.Z_SYNC_FLUSH)


class _Failing(io.RawIOBase):
    """Stored bytes that stop with the connection's error part-way."""

    def __init__(self, data: bytes, at: int):
        self._data, self._at = io.BytesIO(data), at

    def read(self, size: int = -1) -> bytes:
        if self._data.tell() >= self._at:
            raise ConnectionResetError("connection reset by peer")
        return self._data.read(min(size, self._at - self._data.tell()))


def _threads() -> set[str]:
    import threading
    return {t.name for t in threading.enumerate() if t.name.startswith("kiln-layer-")}


def test_the_fetch_and_inflate_threads_end_with_the_block_and_hand_on_their_errors():
    """A layer is fetched, inflated and hashed in threads while the caller parses the tar: a
    caller that stops part-way (its own error) leaves none behind, and the fetch's error reaches
    the caller, in one line naming the layer."""
    with pytest.raises(RuntimeError, match="the caller's"):
        with open_tar(_Endless(), "r|gz", "test layer", Budget()) as tar:
            assert next(iter(tar)).name == "first.py"
            raise RuntimeError("the caller's")
    assert not _threads()
    raw = _tar(FILES)
    blob = gzip.compress(raw, mtime=0)
    for diff_id in (None, _sha(raw)):  # (with a diff_id, the bytes are hashed in a third thread)
        with pytest.raises(KilnError, match=r"^test layer is not a readable tar \(connection reset by peer\)$"):
            _members(_Failing(blob, len(blob) // 2), "r|gz", diff_id)
        assert not _threads()
    assert _members(io.BytesIO(blob), "r|gz", _sha(raw)) == FILES
    assert not _threads()
