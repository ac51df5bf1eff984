"""Gzip layers are inflated by ISA-L (``open_layer_tar``): same members as the standard
library's ``r|gz``, every member of a concatenated gzip, and corrupt or cut data refused."""

from __future__ import annotations

import gzip
import io
import tarfile

import pytest

from kiln.oci.mediatypes import open_layer_tar


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
    with open_layer_tar(fileobj, mode) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}


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
    with pytest.raises((tarfile.ReadError, EOFError, OSError)):
        _members(io.BytesIO(bytes(blob)), "r|gz")
    with pytest.raises((tarfile.ReadError, EOFError)):
        _members(io.BytesIO(gzip.compress(_tar(FILES))[:-4000]), "r|gz")
    with pytest.raises(tarfile.ReadError, match="invalid compressed data"):
        _members(io.BytesIO(b"\x1f\x8b\x08\x00" + b"\x00" * 600), "r|gz")
