"""Gzip layers are inflated by ISA-L (``kiln.source.layerstream.Inflating``): same members as the
standard library's ``r|gz``, every member of a concatenated gzip, corrupt or cut data refused,
and no read larger than asked whatever the compression ratio."""

from __future__ import annotations

import gzip
import io
import tarfile

import pytest

from kiln.errors import KilnError
from kiln.oci.limits import Budget, Limits
from kiln.source.layerstream import LAYER_BUFFER, Inflating, open_tar


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


def _members(fileobj, mode: str) -> dict[str, bytes]:
    """The layer's files as the layer walk reads them (``open_tar``)."""
    with open_tar(fileobj, mode == "r|gz", "test layer", Budget(Limits())) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}


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
