"""The one line a full disk gives (``kiln.errors``): the path written, the bytes needed, the space left."""

from __future__ import annotations

import errno

import pytest

from kiln.errors import no_space_line, writing


def _raise_full(filename=None, filename2=None):
    err = OSError(errno.ENOSPC, "No space left on device")
    err.filename, err.filename2 = filename, filename2
    raise err


def test_a_named_write_says_its_path_what_and_bytes_needed(tmp_path):
    with pytest.raises(OSError) as caught:
        with writing(tmp_path / "blob", 1234, "layer sha256:ab"):
            _raise_full()
    line = no_space_line(caught.value)
    assert line.startswith(f"layer sha256:ab: no space left on device writing {tmp_path / 'blob'} (1234 bytes needed; ")
    assert line.endswith(" free there)")


def test_the_innermost_name_wins_and_a_copy_names_its_target(tmp_path):
    with pytest.raises(OSError) as caught:
        with writing(tmp_path / "outer", 1):
            with writing(tmp_path / "inner", 2):
                _raise_full()
    assert f"writing {tmp_path / 'inner'} (2 bytes needed" in no_space_line(caught.value)
    with pytest.raises(OSError) as caught:
        _raise_full(str(tmp_path / "source"), str(tmp_path / "target"))  # as shutil's copies raise it
    assert f"writing {tmp_path / 'target'} (" in no_space_line(caught.value)


def test_an_unnamed_write_names_the_fullest_directory_written_under(tmp_path):
    with pytest.raises(OSError) as caught:
        _raise_full()
    line = no_space_line(caught.value, [str(tmp_path)])
    assert line.startswith(f"no space left on device writing {tmp_path} (") and "\n" not in line


def test_other_errors_pass_through_unchanged(tmp_path):
    with pytest.raises(PermissionError):
        with writing(tmp_path / "x", 1):
            raise PermissionError(errno.EACCES, "Permission denied")
