"""The overlay walk on synthetic layers: whiteouts, opaque dirs, stop rules, escapes."""

import io
import tarfile

import pytest

from kiln.errors import KilnError
from kiln.source.layerwalk import VllmLayerWalk

pytestmark = pytest.mark.isolated

SITE = "usr/local/lib/python3.12/dist-packages"
META = b"Metadata-Version: 2.1\nName: vllm\nVersion: 0.20.1\n"


def layer(entries: dict | list) -> tarfile.TarFile:
    """A stream-mode tar: values are bytes (file), ("sym", target), ("link", target) or None (dir);
    a list of (name, value) pairs may name an entry twice."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, value in (entries.items() if isinstance(entries, dict) else entries):
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
    ({f"{SITE}/vllm/x.py": ("link", "etc/shadow")}, r"layer L1: hard link .* does not name a file"),
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
    assert "alias.py" in walk.result().files
    assert (tmp_path / SITE / "vllm/alias.py").read_bytes() == b"R"
    assert (tmp_path / SITE / "vllm/hard.py").read_bytes() == b"R"


def special(name: str, kind: bytes, size: int = 0) -> tarfile.TarFile:
    """A one-entry stream tar whose header says ``kind`` (and ``size``) with no data behind it."""
    info = tarfile.TarInfo(name)
    info.type, info.size = kind, size
    buffer = io.BytesIO(info.tobuf(tarfile.PAX_FORMAT))
    return tarfile.open(fileobj=buffer, mode="r|")


@pytest.mark.parametrize(("kind", "word"), [(tarfile.CHRTYPE, "character device"), (tarfile.BLKTYPE, "block device"),
                                            (tarfile.FIFOTYPE, "FIFO")])
def test_special_files_in_the_package_are_refused(tmp_path, kind, word):
    walk = VllmLayerWalk(tmp_path)
    with pytest.raises(KilnError, match=rf"layer L1: entry '{SITE}/vllm/x\.py' in the vllm package is a {word}"):
        walk.add_layer(special(f"{SITE}/vllm/x.py", kind), "L1")
    assert list(tmp_path.iterdir()) == []


def test_special_files_elsewhere_are_never_written(tmp_path):
    walk = VllmLayerWalk(tmp_path)
    walk.add_layer(special("dev/null", tarfile.CHRTYPE), "rootfs")
    walk.add_layer(special("run/fifo", tarfile.FIFOTYPE), "rootfs")
    assert list(tmp_path.iterdir()) == []


def test_huge_entry_is_refused_on_its_header(tmp_path):
    walk = VllmLayerWalk(tmp_path)
    # declares 64 GiB but carries no data: refused before a byte of it is read
    with pytest.raises(KilnError, match=r"layer L1: entry .*vllm/big\.py' declares 68719476736 bytes, over"):
        walk.add_layer(special(f"{SITE}/vllm/big.py", tarfile.REGTYPE, 64 << 30), "L1")
    with pytest.raises(KilnError, match=r"layer L2: entry .*METADATA' declares .* dist-info"):
        VllmLayerWalk(tmp_path).add_layer(special(f"{SITE}/vllm-0.20.1.dist-info/METADATA", tarfile.REGTYPE, 1 << 40), "L2")


def test_write_through_a_symlink_is_refused(tmp_path):
    """``vllm/sub -> (anything)`` then ``vllm/sub/x.py``: would land wherever the link points."""
    for target in ("/tmp", "real", "../../../../../../.."):
        walk = VllmLayerWalk(tmp_path / "work")
        entries = {f"{SITE}/vllm/real/": None, f"{SITE}/vllm/sub": ("sym", target), f"{SITE}/vllm/sub/x.py": b"x"}
        with pytest.raises(KilnError, match=r"layer L1: (entry .*sub/x\.py' is below the symlink|symlink .*sub' ->)"):
            walk.add_layer(layer(entries), "L1")
    assert [p.name for p in tmp_path.iterdir()] in ([], ["work"])  # nothing written anywhere else


def test_link_chain_that_only_the_kernel_would_follow_out_is_refused(tmp_path):
    """A lexically harmless target through a deep link that points back up: resolving the
    chain (as the kernel would) leaves the package, so the link is refused."""
    deep = "/".join(f"d{i}" for i in range(12))
    up = "../" * 12
    entries = {
        f"{SITE}/vllm/t/keep.py": b"",
        f"{SITE}/vllm/{deep}/s.py": ("sym", f"{up}t"),  # -> vllm/t (inside)
        f"{SITE}/vllm/{deep}/e.py": ("sym", "s.py/" + "../" * 11 + "escape.py"),  # lexically inside
    }
    walk = VllmLayerWalk(tmp_path / "work")
    with pytest.raises(KilnError, match=r"layer L1: symlink .*e\.py.* leaves the vllm package"):
        walk.add_layer(layer(entries), "L1")


def test_links_are_materialised_as_copies_never_as_links(tmp_path):
    walk = VllmLayerWalk(tmp_path)
    entries = install({"__init__.py": b"", "impl/real.py": b"R"}, record=False)
    entries[f"{SITE}/vllm/impl_link"] = ("sym", "impl")
    entries[f"{SITE}/vllm/a.py"] = ("sym", "b.py")
    entries[f"{SITE}/vllm/b.py"] = ("sym", "impl_link/real.py")  # a chain through a directory link
    walk.add_layer(layer(entries), "install")
    walk.result()
    links = [p for p in tmp_path.rglob("*") if p.is_symlink()]
    assert links == []
    assert (tmp_path / SITE / "vllm/a.py").read_bytes() == b"R"
    loop = install({"__init__.py": b""}, record=False)
    loop[f"{SITE}/vllm/x.py"] = ("sym", "y.py")
    loop[f"{SITE}/vllm/y.py"] = ("sym", "x.py")
    walk = VllmLayerWalk(tmp_path / "loop")
    walk.add_layer(layer(loop), "L")
    with pytest.raises(KilnError, match="layer L: symlink .* too many levels of links"):
        walk.result()


def test_duplicate_entries_the_later_wins(tmp_path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in [*install({"__init__.py": b"", "a.py": b"first"}, record=False).items(),
                           (f"{SITE}/vllm/a.py", b"second")]:
            info = tarfile.TarInfo(name)
            if isinstance(data, bytes):
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    buffer.seek(0)
    walk = VllmLayerWalk(tmp_path)
    walk.add_layer(tarfile.open(fileobj=buffer, mode="r|"), "L")
    assert (tmp_path / SITE / "vllm/a.py").read_bytes() == b"second"


def test_file_over_a_directory_of_the_same_layer_is_refused(tmp_path):
    walk = VllmLayerWalk(tmp_path)
    with pytest.raises(KilnError, match=r"layer L: entry .*vllm/a\.py/b\.py' is below .*not a directory"):
        walk.add_layer(layer({f"{SITE}/vllm/a.py": b"f", f"{SITE}/vllm/a.py/b.py": b"g"}), "L")
    walk = VllmLayerWalk(tmp_path / "two")
    with pytest.raises(KilnError, match=r"layer L: entry .*vllm/d\.py' replaces a directory"):
        walk.add_layer(layer({f"{SITE}/vllm/d.py/b.py": b"g", f"{SITE}/vllm/d.py": b"f"}), "L")


TRITON_META = b"Metadata-Version: 2.1\nName: triton\nVersion: 3.6.0\n"
TRITON_RECORD = b"triton/_C/libtriton.so,sha256=KNqqcKkE5Pit11TlGFM-imm5SrixZDHOd9RfHyUoK4c,415617000\n"


def _triton(version: str = "3.6.0", record: bytes | None = TRITON_RECORD) -> dict:
    entries = {f"{SITE}/triton-{version}.dist-info/METADATA": TRITON_META.replace(b"3.6.0", version.encode())}
    if record is not None:
        entries[f"{SITE}/triton-{version}.dist-info/RECORD"] = record
    return entries


def test_triton_metadata_and_record_come_from_the_same_dist_info(tmp_path):
    walk = VllmLayerWalk(tmp_path)
    walk.add_layer(layer({**install({"__init__.py": b""}), **_triton(),
                          f"{SITE}/triton-3.5.0.dist-info/RECORD": b"stale\n"}), "install")
    found = walk.result()
    assert found.triton_version == "3.6.0" and found.triton_record == TRITON_RECORD.decode()


def test_triton_below_vllm_is_read_only_when_needed(tmp_path):
    top = layer(install({"__init__.py": b""}))
    plain = VllmLayerWalk(tmp_path / "plain")
    plain.add_layer(top, "vllm")
    assert plain.complete  # verify needs no Triton: vLLM's layer settles it
    assert plain.result().triton_version is None

    needing = VllmLayerWalk(tmp_path / "needing", need_triton=True)
    needing.add_layer(layer(install({"__init__.py": b""})), "vllm")
    assert not needing.complete  # torch and Triton may sit in a layer of their own, below
    needing.add_layer(layer(_triton()), "torch")
    assert needing.complete
    found = needing.result()
    assert found.triton_version == "3.6.0" and found.triton_record == TRITON_RECORD.decode()
    assert found.layers == ("vllm", "torch")


def test_a_whited_out_triton_is_not_found_below(tmp_path):
    walk = VllmLayerWalk(tmp_path, need_triton=True)
    walk.add_layer(layer({**install({"__init__.py": b""}), f"{SITE}/.wh.triton-3.5.0.dist-info": b""}), "vllm")
    walk.add_layer(layer(_triton("3.5.0")), "torch")
    assert not walk.complete  # every layer is read: the only Triton is deleted above
    found = walk.result()
    assert found.triton_version is None and found.triton_record is None


def test_files_are_written_beside_the_reading_and_all_there_when_the_layer_is(tmp_path):
    """The files are written by a thread while the tar is read: when ``add_layer`` returns every
    one is on disk, in the layer's order (a later duplicate replaces the earlier one, a hard link
    copies what was written before it); a write that fails is raised by ``add_layer``, and no
    write thread outlives it."""
    import threading

    files = {f"m{i}.py": f"# module {i}\n".encode() * i for i in range(200)}
    entries = [*install(files).items(), (f"{SITE}/vllm/m7.py", b"the later m7"),
               (f"{SITE}/vllm/hard.py", ("link", f"{SITE}/vllm/m9.py"))]
    walk = VllmLayerWalk(tmp_path / "a")
    walk.add_layer(layer(entries), "install")
    package = tmp_path / "a" / SITE / "vllm"
    assert (package / "m7.py").read_bytes() == b"the later m7"
    assert (package / "hard.py").read_bytes() == files["m9.py"]
    assert all((package / rel).read_bytes() == data for rel, data in files.items() if rel != "m7.py")
    assert not [t for t in threading.enumerate() if t.name.startswith("kiln-layer-write")]
    # a file already there (the walk is meant to be the only writer): O_EXCL refuses it
    taken = tmp_path / "b" / SITE / "vllm" / "m150.py"
    taken.parent.mkdir(parents=True)
    taken.write_bytes(b"someone else's")
    with pytest.raises(FileExistsError):
        VllmLayerWalk(tmp_path / "b").add_layer(layer(install(files)), "install")
    assert taken.read_bytes() == b"someone else's"
    assert not [t for t in threading.enumerate() if t.name.startswith("kiln-layer-write")]
