"""Unpacking a Triton wheel into the kiln cache: content alone decides what the compile reads.

A small wheel made here (same layout as Triton's: the package, a dist-info with RECORD, a
``.data/scripts`` entry) so every rule is checked without the network; the real 3.6.0 wheel
is checked in ``test_triton_aot.py``.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from kiln.errors import KilnError
from kiln.report import Recorder
from kiln.triton import toolchain as tc

RECORD = b"triton/__init__.py,sha256=x,1\ntriton/language/standard.py,sha256=y,2\n"


def _wheel(path: Path, extra: dict[str, bytes] | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data, mode in (
            ("triton/__init__.py", b"__version__ = '9.9.9'\n", 0o644),
            ("triton/language/standard.py", b"def f(): pass\n", 0o644),
            ("triton/backends/nvidia/bin/ptxas", b"\x7fELF", 0o755),
            ("triton-9.9.9.data/scripts/proton", b"#!/some/venv/bin/python\n", 0o755),
            ("triton-9.9.9.dist-info/RECORD", RECORD, 0o644),
        ):
            info = zipfile.ZipInfo(name, date_time=(2026, 1, 2, 3, 4, 5))
            info.external_attr = (0o100000 | mode) << 16
            archive.writestr(info, data)
        for name, data in (extra or {}).items():
            archive.writestr(name, data)
    return path


def test_unpack_fixes_mtimes_keeps_exec_bits_and_skips_scripts(tmp_path):
    into = tmp_path / "site"
    into.mkdir()
    record = tc._unpack(_wheel(tmp_path / "t.whl"), into)
    assert record == hashlib.sha256(RECORD).hexdigest()  # the wheel's RECORD: no install path in it
    files = [p for p in into.rglob("*") if p.is_file()]
    assert {int(p.stat().st_mtime) for p in files} == {tc.SOURCE_MTIME}
    assert (into / "triton/backends/nvidia/bin/ptxas").stat().st_mode & 0o777 == 0o755
    assert (into / "triton/language/standard.py").stat().st_mode & 0o777 == 0o644
    assert not list(into.rglob("proton"))  # a script's shebang names a venv: not installed


def test_unpack_refuses_a_member_outside_the_directory(tmp_path):
    into = tmp_path / "site"
    into.mkdir()
    with pytest.raises(KilnError, match=r"t\.whl: member '\.\./evil\.py' leaves the install directory"):
        tc._unpack(_wheel(tmp_path / "t.whl", {"../evil.py": b"x"}), into)
    assert not (tmp_path / "evil.py").exists()


def test_download_checks_the_index_sha256_and_reports_progress(tmp_path):
    wheel = _wheel(tmp_path / "t.whl")
    good = hashlib.sha256(wheel.read_bytes()).hexdigest()
    recorder = Recorder()
    tc._download(wheel.as_uri(), good, tmp_path / "copy.whl", "Triton 9.9.9 (cp311)", recorder)
    assert (tmp_path / "copy.whl").read_bytes() == wheel.read_bytes()
    assert recorder.tasks == ["copying Triton 9.9.9 (cp311)"]
    with pytest.raises(KilnError, match="sha256 .* differs from the index's " + "0" * 64):
        tc._download(wheel.as_uri(), "0" * 64, tmp_path / "bad.whl", "Triton 9.9.9", Recorder())


def test_fetched_once_then_reused_with_its_recorded_fingerprint(tmp_path, monkeypatch):
    monkeypatch.delenv("KILN_TRITON_TOOLCHAINS", raising=False)
    wheel = _wheel(tmp_path / "triton-9.9.9-cp311-cp311-linux_x86_64.whl")
    calls = []

    def choose(version, image):
        calls.append(version)
        return wheel.as_uri(), hashlib.sha256(wheel.read_bytes()).hexdigest()

    monkeypatch.setattr(tc, "_choose_wheel", choose)
    recorder = Recorder()
    first = tc.toolchain_for("9.9.9", "img", tmp_path / "cache", recorder)
    again = tc.toolchain_for("9.9.9", "img", tmp_path / "cache", recorder)
    assert calls == ["9.9.9"] and first == again
    assert first.site == tmp_path / "cache/triton/toolchains/triton-9.9.9"
    assert first.fingerprint == hashlib.sha256(RECORD).hexdigest() and first.wheel == wheel.name
    assert first.wheel_sha256 == hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert recorder.tasks == ["copying Triton 9.9.9 (cp311)"] and recorder.statuses == ["unpacking Triton 9.9.9"]
    assert not (first.site / wheel.name).exists()  # the wheel itself is not kept


def test_the_wheel_sha256_is_kept_even_when_the_index_gives_none(tmp_path, monkeypatch):
    """The marker round trip: the sha256 of the bytes kiln downloaded, written into the entry
    when it is filled and read back by the next build."""
    monkeypatch.delenv("KILN_TRITON_TOOLCHAINS", raising=False)
    wheel = _wheel(tmp_path / "triton-9.9.9-cp311-cp311-linux_x86_64.whl")
    monkeypatch.setattr(tc, "_choose_wheel", lambda version, image: (wheel.as_uri(), ""))
    first = tc.toolchain_for("9.9.9", "img", tmp_path / "cache")
    served = hashlib.sha256(wheel.read_bytes()).hexdigest()
    marker = json.loads((first.site / "kiln-toolchain.json").read_text())
    assert marker["wheel_sha256"] == served == first.wheel_sha256
    assert marker["record_sha256"] == first.fingerprint and marker["wheel"] == wheel.name
    monkeypatch.setattr(tc, "_choose_wheel", lambda version, image: pytest.fail("fetched again"))
    assert tc.toolchain_for("9.9.9", "img", tmp_path / "cache") == first


def _entry_without_wheel_sha256(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A toolchain entry as kiln left it when it kept only the index's (absent) hash."""
    monkeypatch.delenv("KILN_TRITON_TOOLCHAINS", raising=False)
    wheel = _wheel(tmp_path / "triton-9.9.9-cp311-cp311-linux_x86_64.whl")
    monkeypatch.setattr(tc, "_choose_wheel", lambda version, image: (wheel.as_uri(), ""))
    site = tc.toolchain_for("9.9.9", "img", tmp_path / "cache").site
    marker = json.loads((site / "kiln-toolchain.json").read_text())
    marker["wheel_sha256"] = ""
    (site / "kiln-toolchain.json").write_text(json.dumps(marker))
    return site, wheel


def test_an_entry_without_the_wheel_sha256_fetches_the_wheel_again_to_learn_it(tmp_path, monkeypatch):
    site, wheel = _entry_without_wheel_sha256(tmp_path, monkeypatch)
    recorder = Recorder()
    again = tc.toolchain_for("9.9.9", "img", tmp_path / "cache", recorder)
    served = hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert again.wheel_sha256 == served and recorder.tasks == ["copying Triton 9.9.9 (cp311)"]
    assert json.loads((site / "kiln-toolchain.json").read_text())["wheel_sha256"] == served
    assert not (site / wheel.name).exists() and recorder.statuses == []  # the entry is not unpacked again


def test_an_entry_the_index_wheel_does_not_match_is_refused_and_left_as_it_was(tmp_path, monkeypatch):
    site, wheel = _entry_without_wheel_sha256(tmp_path, monkeypatch)
    before = (site / "kiln-toolchain.json").read_bytes()
    other = tmp_path / "other"
    other.mkdir()
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(other / wheel.name, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, data + b"x" if info.filename.endswith("RECORD") else data)
    monkeypatch.setattr(tc, "_choose_wheel", lambda version, image: ((other / wheel.name).as_uri(), ""))
    with pytest.raises(KilnError, match=r"triton-9\.9\.9: the index's .* is not the wheel this entry holds"):
        tc.toolchain_for("9.9.9", "img", tmp_path / "cache")
    assert (site / "kiln-toolchain.json").read_bytes() == before


def test_shared_directory_wins_over_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_TRITON_TOOLCHAINS", str(tmp_path / "shared"))
    assert tc.toolchains_dir(tmp_path / "cache") == tmp_path / "shared"
    monkeypatch.delenv("KILN_TRITON_TOOLCHAINS")
    assert tc.toolchains_dir(tmp_path / "cache") == tmp_path / "cache/triton/toolchains"


@pytest.mark.network  # PyPI answers that it has no such wheel
def test_a_version_the_index_lacks_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("KILN_TRITON_TOOLCHAINS", raising=False)
    with pytest.raises(KilnError, match=r"img: no triton==0\.0\.1 wheel for this Python"):
        tc.toolchain_for("0.0.1", "img", tmp_path)
    assert not list((tmp_path / "triton" / "toolchains").glob("triton-*"))
