"""ci/gpu_serve_bundle.trim_wheel: a wheel repacked without some members, the rest copied as they
were compressed (no inflating and deflating again), its RECORD rewritten to match."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import zipfile

import gpu_serve_bundle  # ci/, on the tests' path (tests/__init__.py)
import pytest

from kiln.errors import KilnError


class _Unseekable(io.RawIOBase):
    """A stream zipfile cannot seek back on: it writes each member with a data descriptor."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.buffer += data
        return len(data)


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _wheel(path, members: dict[str, bytes], descriptors: bool) -> None:
    record = "pkg-1.dist-info/RECORD"
    lines = [_record_line(n, d) for n, d in members.items()] + [f"{record},,"]
    stream = _Unseekable() if descriptors else open(path, "wb")  # noqa: SIM115
    with zipfile.ZipFile(stream, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in members.items():
            wheel.writestr(zipfile.ZipInfo(name, (2024, 1, 2, 3, 4, 6)), data, compress_type=zipfile.ZIP_DEFLATED,
                           compresslevel=1)  # not the level a repack would deflate at: a copy keeps it
        wheel.writestr(record, "\n".join(lines) + "\n")
    if descriptors:
        path.write_bytes(bytes(stream.buffer))
    else:
        stream.close()


@pytest.mark.parametrize("descriptors", [False, True], ids=["sizes-in-headers", "data-descriptors"])
def test_kept_members_are_copied_compressed_and_the_record_matches(tmp_path, descriptors):
    members = {"pkg/__init__.py": b"x = 1\n" * 500, "pkg/_big.so": bytes(range(256)) * 4000,
               "pkg/ops/kernel.py": "déjà vu\n".encode() * 300}
    source = tmp_path / "pkg-1-py3-none-any.whl"
    _wheel(source, members, descriptors)
    with zipfile.ZipFile(source) as wheel:
        assert all(bool(i.flag_bits & 0x08) == descriptors for i in wheel.infolist())
    out = tmp_path / "out"
    out.mkdir()
    summary = gpu_serve_bundle.trim_wheel(source, out, {"pkg/_big.so": "not loaded"})
    assert summary["omitted"] == [{"path": "pkg/_big.so", "size": len(members["pkg/_big.so"]), "reason": "not loaded"}]
    with zipfile.ZipFile(out / source.name) as trimmed, zipfile.ZipFile(source) as original:
        assert trimmed.testzip() is None
        assert trimmed.namelist() == ["pkg/__init__.py", "pkg/ops/kernel.py", "pkg-1.dist-info/RECORD"]
        for name in ("pkg/__init__.py", "pkg/ops/kernel.py"):
            kept, was = trimmed.getinfo(name), original.getinfo(name)
            assert trimmed.read(name) == members[name]
            assert (kept.CRC, kept.compress_size, kept.date_time) == (was.CRC, was.compress_size, was.date_time)
        rows = list(csv.reader(io.StringIO(trimmed.read("pkg-1.dist-info/RECORD").decode())))
        assert [r[0] for r in rows] == ["pkg/__init__.py", "pkg/ops/kernel.py", "pkg-1.dist-info/RECORD"]
        assert all(",".join(r) == _record_line(r[0], trimmed.read(r[0])) for r in rows[:-1])


def test_a_member_to_leave_out_that_the_wheel_lacks_is_refused(tmp_path):
    source = tmp_path / "pkg-1-py3-none-any.whl"
    _wheel(source, {"pkg/__init__.py": b""}, descriptors=False)
    with pytest.raises(KilnError, match="has no pkg/gone.so to leave out"):
        gpu_serve_bundle.trim_wheel(source, tmp_path, {"pkg/gone.so": "why"})
