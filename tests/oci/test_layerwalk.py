"""The overlay walk on synthetic layers: whiteouts, opaque dirs, stop rules, escapes."""

import io
import tarfile

import pytest

from kiln.errors import KilnError
from kiln.oci.layerwalk import VllmLayerWalk

SITE = "usr/local/lib/python3.12/dist-packages"
META = b"Metadata-Version: 2.1\nName: vllm\nVersion: 0.20.1\n"


def layer(entries: dict) -> tarfile.TarFile:
    """A stream-mode tar: values are bytes (file), ("sym", target), ("link", target) or None (dir)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, value in entries.items():
            info = tarfile.TarInfo(name)
            if value is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif isinstance(value, tuple):
                info.type = tarfile.SYMTYPE if value[0] == "sym" else tarfile.LNKTYPE
                info.linkname = value[1]
                tar.addfile(info)
            else:
                info.size = len(value)
                tar.addfile(info, io.BytesIO(value))
    buffer.seek(0)
    return tarfile.open(fileobj=buffer, mode="r|")


def install(files: dict[str, bytes], record: bool = True, site: str = SITE) -> dict:
    entries = {f"{site}/vllm/{k}": v for k, v in files.items()}
    entries[f"{site}/vllm-0.20.1.dist-info/METADATA"] = META
    if record:
        entries[f"{site}/vllm-0.20.1.dist-info/RECORD"] = "".join(
            f"vllm/{k},sha256=x,1\n" for k in files).encode()
    return entries


def test_whiteout_and_override_from_upper_layer(tmp_path):
    walk = VllmLayerWalk(tmp_path)
    walk.add_layer(layer({f"./{SITE}/vllm/a.py": b"new a", f"{SITE}/vllm/.wh.b.py": b""}), "top")
    assert not walk.complete
    walk.add_layer(layer(install({"__init__.py": b"", "a.py": b"old a", "b.py": b"b", "c.py": b"c"})), "install")
    assert walk.complete  # RECORD's files are all decided
    found = walk.result()
    assert found.site_dir == SITE and str(found.vllm_version) == "0.20.1"
    assert found.files == ("__init__.py", "a.py", "c.py")
    assert (tmp_path / SITE / "vllm/a.py").read_bytes() == b"new a"
    assert not (tmp_path / SITE / "vllm/b.py").exists()


def test_opaque_dir_hides_lower_contents_but_keeps_its_own(tmp_path):
    walk = VllmLayerWalk(tmp_path)
    walk.add_layer(layer({f"{SITE}/vllm/sub/.wh..wh..opq": b"", f"{SITE}/vllm/sub/mine.py": b"m"}), "top")
    walk.add_layer(layer(install({"__init__.py": b"", "sub/old.py": b"o"}, record=False)), "install")
    assert walk.result().files == ("__init__.py", "sub/mine.py")


def test_record_incomplete_means_keep_reading(tmp_path):
    walk = VllmLayerWalk(tmp_path)
    entries = install({"__init__.py": b"", "a.py": b"a"})
    del entries[f"{SITE}/vllm/a.py"]  # listed in RECORD, but only a lower layer holds it
    walk.add_layer(layer(entries), "upper")
    assert not walk.complete
    walk.add_layer(layer({f"{SITE}/vllm/a.py": b"a from below"}), "lower")
    assert walk.complete
    assert (tmp_path / SITE / "vllm/a.py").read_bytes() == b"a from below"


def test_without_record_the_install_layer_settles_it(tmp_path):
    walk = VllmLayerWalk(tmp_path)
    walk.add_layer(layer(install({"__init__.py": b"", "x.py": b""}, record=False)), "install")
    assert walk.complete


def test_opaque_package_settles_it(tmp_path):
    walk = VllmLayerWalk(tmp_path)
    entries = install({"__init__.py": b""}, record=False)
    entries[f"{SITE}/vllm/__init__.py"] = b"override"
    entries[f"{SITE}/vllm/.wh..wh..opq"] = b""
    del entries[f"{SITE}/vllm-0.20.1.dist-info/METADATA"]
    walk.add_layer(layer(entries), "top")
    assert not walk.complete  # version still unknown
    walk.add_layer(layer({f"{SITE}/vllm-0.20.1.dist-info/METADATA": META, f"{SITE}/vllm/stale.py": b""}), "lower")
    assert walk.complete
    assert walk.result().files == ("__init__.py",)


def test_site_packages_and_other_python_versions(tmp_path):
    site = "opt/venv/lib/python3.11/site-packages"
    walk = VllmLayerWalk(tmp_path)
    walk.add_layer(layer(install({"__init__.py": b""}, site=site)), "install")
    assert walk.result().site_dir == site


def test_no_vllm_is_a_clear_error(tmp_path):
    walk = VllmLayerWalk(tmp_path)
    walk.add_layer(layer({"bin/sh": b""}), "only")
    with pytest.raises(KilnError, match="no vLLM in the image"):
        walk.result()


@pytest.mark.parametrize(("entries", "message"), [
    ({"../evil.py": b"x"}, r"layer L1: entry '\.\./evil\.py' climbs out"),
    ({"/etc/passwd": b"x"}, r"layer L1: entry '/etc/passwd' has an absolute path"),
    ({f"{SITE}/vllm/x.py": ("sym", "../../../../../../etc/passwd")}, r"layer L1: symlink .*x\.py.* leaves the vllm package"),
    ({f"{SITE}/vllm/x.py": ("sym", "/etc/passwd")}, r"leaves the vllm package"),
    ({f"{SITE}/vllm/x.py": ("link", "etc/shadow")}, r"layer L1: hard link .* outside"),
])
def test_escapes_are_refused_naming_layer_and_entry(tmp_path, entries, message):
    walk = VllmLayerWalk(tmp_path / "work")
    with pytest.raises(KilnError, match=message):
        walk.add_layer(layer(entries), "L1")
    assert not (tmp_path / "etc").exists()


def test_links_inside_the_package_are_kept(tmp_path):
    walk = VllmLayerWalk(tmp_path)
    entries = install({"__init__.py": b"", "real.py": b"R"}, record=False)
    entries[f"{SITE}/vllm/alias.py"] = ("sym", "real.py")
    entries[f"{SITE}/vllm/hard.py"] = ("link", f"{SITE}/vllm/real.py")
    walk.add_layer(layer(entries), "install")
    assert (tmp_path / SITE / "vllm/alias.py").read_bytes() == b"R"
    assert (tmp_path / SITE / "vllm/hard.py").read_bytes() == b"R"
