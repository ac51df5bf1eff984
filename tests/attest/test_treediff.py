"""``check``'s file-by-file comparison (``kiln.attest.treediff.tar_difference``) reads a pulled
layer whatever its compression: gzip, zstd (an image recompressed on its way) or plain tar."""

from __future__ import annotations

import gzip
import io
import tarfile

import pytest

try:
    from compression import zstd
except ImportError:
    from backports import zstd

from kiln.attest.treediff import tar_difference

FILES = {"usr/lib/python3.12/vllm/envs.py": b"X = 1\n", "opt/kiln/manifest.json": b"{}\n"}


def _tar(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


COMPRESS = {"gzip": lambda raw: gzip.compress(raw, mtime=0), "zstd": zstd.compress, "tar": lambda raw: raw}


@pytest.mark.parametrize("pulled", sorted(COMPRESS))
def test_a_pulled_layer_is_compared_by_its_files_whatever_its_compression(tmp_path, pulled):
    ours = tmp_path / "ours"
    ours.write_bytes(gzip.compress(_tar(FILES), mtime=0))
    theirs = tmp_path / "theirs"
    theirs.write_bytes(COMPRESS[pulled](_tar(FILES)))
    assert tar_difference(theirs, ours) is None
    theirs.write_bytes(COMPRESS[pulled](_tar({**FILES, "usr/lib/python3.12/vllm/envs.py": b"X = 2\n"})))
    assert tar_difference(theirs, ours) == "file /usr/lib/python3.12/vllm/envs.py differs (content)"
