"""Hostile base images, served by the real registry: kiln refuses them clearly and writes nothing
outside its cache and output directories.

Every image here is assembled by the test itself -- layers with Python's ``tarfile``, configs
and manifests as JSON, uploaded with plain HTTP (POST/PUT) -- on top of the fixture base's
real blobs, never with kiln's own layer or manifest code. What the registry refuses to store
(an unknown manifest media type, a blob whose bytes do not match its name) is read from an OCI
layout the test writes by hand.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from kiln.errors import KilnError
from kiln.oci.image import OciLayoutImage
from kiln.source.image import read_vllm
from tests.support import TEST_IMAGES
from tests.support.hostile import (
    OCI_INDEX,
    OCI_MANIFEST,
    Images,
    entry,
    sha,
    tar_layer,
    truncated_layer,
)
from tests.support.kiln_process import run_kiln
from tests.support.registry import REPO, SITE, VLLM_VERSION

pytestmark = [pytest.mark.registry, pytest.mark.reliability]

IMAGES = TEST_IMAGES
TAG = f"cu130-sm120-v{VLLM_VERSION}"


@pytest.fixture(scope="module")
def images(registry_plain) -> Images:
    return Images(registry_plain)


# -- running a build and checking it left nothing behind -------------------------------------


def snapshot(root: Path, skip: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if skip not in (p, *p.parents)}


@dataclass
class Outcome:
    code: int
    err: str
    result: dict | None


def build(capsys, tmp_path: Path, registry, tag: str, digest: str, dest: str) -> Outcome:
    """``build.py build`` of the e2e image on ``tag`` (locked to ``digest``), to --oci and --push.
    The pins file lives in the cache directory, which the before/after snapshots leave out."""
    pins = tmp_path / "kiln-cache" / "pins.toml"
    pins.parent.mkdir(exist_ok=True)
    pins.write_text(f'[pins."v0.20.1"]\nrole = "current"\nimage = "docker.io/{REPO}:{tag}"\n'
                    f'vllm = "{VLLM_VERSION}"\ncuda = "cu130"\ndigest = "{digest}"\n')
    argv = ["--pins", str(pins), "--images", str(IMAGES), "build", "--image", "e2e-p65", "--pin", "v0.20.1",
            "--sm", "120", "--mirror", registry.mirror, "--json", "--oci", str(tmp_path / "out"),
            "--push", "--repository", f"{registry.host}/{dest}"]
    code, out, err = run_kiln(*argv)
    return Outcome(code, err, json.loads(out) if code == 0 else None)


def tag_exists(registry, repository: str, tag: str) -> bool:
    resp = requests.head(f"{registry.url}/v2/{repository}/manifests/{tag}",
                         headers={"Accept": OCI_MANIFEST}, timeout=10)
    return resp.status_code == 200


def assert_refused(outcome: Outcome, tmp_path: Path, registry, dest: str, *expected: str) -> str:
    assert outcome.code == 2, outcome.err
    lines = [line for line in outcome.err.strip().splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), outcome.err
    line = lines[-1]
    for text in expected:
        assert text in line, (text, line)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    assert not tag_exists(registry, dest, TAG)
    return line


def dest_for(tmp_path: Path) -> str:
    return "test/" + re.sub(r"[^a-z0-9]+", "-", tmp_path.name.lower()).strip("-")


# -- hostile layers --------------------------------------------------------------------------

VLLM = f"{SITE}/vllm"


def hostile_layers(outside: Path) -> dict[str, tuple[Callable[[], list], str]]:
    """case -> (entries of the top layer, the entry the error must name)."""
    up = "../" * 16  # from anywhere in the cache, far above the filesystem root
    rel_outside = up + str(outside).lstrip("/")
    return {
        "dot-dot path": (lambda: [entry(f"{VLLM}/{rel_outside}/dotdot.py")], f"{VLLM}/{rel_outside}/dotdot.py"),
        "dot-dot outside vllm": (lambda: [entry(f"{rel_outside}/rootfs.py")], f"{rel_outside}/rootfs.py"),
        "absolute path": (lambda: [entry(f"{outside}/absolute.py")], f"{outside}/absolute.py"),
        "absolute symlink": (lambda: [entry(f"{VLLM}/envs.py", tarfile.SYMTYPE, str(outside / "t.py"))],
                             f"{VLLM}/envs.py"),
        "relative symlink out": (lambda: [entry(f"{VLLM}/envs.py", tarfile.SYMTYPE, rel_outside + "/t.py")],
                                 f"{VLLM}/envs.py"),
        "symlinked dir, file written through it": (
            lambda: [entry(f"{VLLM}/evil", tarfile.SYMTYPE, str(outside)), entry(f"{VLLM}/evil/planted.py")],
            f"{VLLM}/evil"),
        "in-package symlinked dir, file written through it": (
            lambda: [entry(f"{VLLM}/lora", tarfile.DIRTYPE), entry(f"{VLLM}/alias", tarfile.SYMTYPE, "lora"),
                     entry(f"{VLLM}/alias/planted.py")],
            f"{VLLM}/alias/planted.py"),
        "hard link outside": (lambda: [entry(f"{VLLM}/envs.py", tarfile.LNKTYPE, rel_outside + "/secret")],
                              f"{VLLM}/envs.py"),
        "hard link to a system file": (lambda: [entry(f"{VLLM}/envs.py", tarfile.LNKTYPE, "etc/os-release")],
                                       f"{VLLM}/envs.py"),
        "character device": (lambda: [entry(f"{VLLM}/envs.py", tarfile.CHRTYPE)], f"{VLLM}/envs.py"),
        "block device": (lambda: [entry(f"{VLLM}/dev.py", tarfile.BLKTYPE)], f"{VLLM}/dev.py"),
        "fifo": (lambda: [entry(f"{VLLM}/fifo.py", tarfile.FIFOTYPE)], f"{VLLM}/fifo.py"),
    }


@pytest.fixture
def canary(tmp_path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("host secret\n")
    return outside


CASES = sorted(hostile_layers(Path("/x")))


@pytest.mark.parametrize("case", CASES)
def test_hostile_layer_is_refused_naming_layer_and_entry(case, capsys, tmp_path, canary, images, registry_plain):
    entries, named = hostile_layers(canary)[case]
    blob, raw = tar_layer(entries())
    tag = "hostile-" + re.sub(r"[^a-z0-9]+", "-", case)
    digest, layer = images.with_top_layer(tag, blob, sha(raw))
    before = snapshot(tmp_path, tmp_path / "kiln-cache")
    outcome = build(capsys, tmp_path, registry_plain, tag, digest, dest_for(tmp_path))
    assert_refused(outcome, tmp_path, registry_plain, dest_for(tmp_path), f"layer {layer}", repr(named))
    # nothing appeared anywhere outside the cache (the canary directory included)
    assert snapshot(tmp_path, tmp_path / "kiln-cache") == before
    assert sorted(p.name for p in canary.iterdir()) == ["secret"]
    cache = tmp_path / "kiln-cache"
    assert not [p for p in cache.rglob("*") if p.is_symlink()]
    assert not list((cache / "sources").glob("image-*"))  # no tree from a refused image


def test_huge_entry_is_refused_before_its_bytes_are_read(capsys, tmp_path, images, registry_plain):
    """A header declaring 1 TiB for a vLLM source file: refused on the header (the blob is a few
    hundred bytes; reading on would fail on truncation instead)."""
    blob, raw = truncated_layer(f"{VLLM}/huge.py", 1 << 40)
    digest, layer = images.with_top_layer("hostile-huge", blob, sha(raw))
    outcome = build(capsys, tmp_path, registry_plain, "hostile-huge", digest, dest_for(tmp_path))
    assert_refused(outcome, tmp_path, registry_plain, dest_for(tmp_path), f"layer {layer}",
                   f"'{VLLM}/huge.py' declares 1099511627776 bytes")


def test_huge_entry_outside_vllm_is_a_truncated_layer(capsys, tmp_path, images, registry_plain):
    blob, raw = truncated_layer("usr/lib/huge.so", 1 << 40)
    digest, layer = images.with_top_layer("hostile-huge-lib", blob, sha(raw))
    outcome = build(capsys, tmp_path, registry_plain, "hostile-huge-lib", digest, dest_for(tmp_path))
    assert_refused(outcome, tmp_path, registry_plain, dest_for(tmp_path), f"layer {layer} is not a readable tar")


def test_tolerated_entries_build_and_are_never_written(capsys, tmp_path, canary, images, registry_plain, base_layout):
    """Devices and FIFOs outside vllm/ are ignored (never written); duplicate entries of a layer
    resolve as tar extraction does (the later wins); in-package links become plain copies."""
    envs = base_layout.wheel_files["vllm/envs.py"]
    entries = [
        entry("dev", tarfile.DIRTYPE), entry("dev/null", tarfile.CHRTYPE), entry("dev/sda", tarfile.BLKTYPE),
        entry("run/fifo", tarfile.FIFOTYPE),
        entry(f"{VLLM}/envs.py", data=b"first = 1\n"), entry(f"{VLLM}/envs.py", data=envs + b"# second\n"),
        entry(f"{VLLM}/envs_alias.py", tarfile.SYMTYPE, "envs.py"),
    ]
    blob, raw = tar_layer(entries)
    digest, _ = images.with_top_layer("tolerated", blob, sha(raw))
    before = snapshot(tmp_path, tmp_path / "kiln-cache")
    outcome = build(capsys, tmp_path, registry_plain, "tolerated", digest, dest_for(tmp_path))
    assert outcome.code == 0, outcome.err
    assert snapshot(tmp_path, tmp_path / "kiln-cache") - before == {"out", *(
        str(p.relative_to(tmp_path)) for p in (tmp_path / "out").rglob("*"))}
    [tree] = (tmp_path / "kiln-cache" / "sources").glob("image-*")
    assert (tree / VLLM / "envs.py").read_bytes() == envs + b"# second\n"
    alias = tree / VLLM / "envs_alias.py"
    assert not alias.is_symlink() and alias.read_bytes() == envs + b"# second\n"
    assert not (tree / "dev").exists() and not (tree / "run").exists()
    assert not [p for p in (tmp_path / "kiln-cache").rglob("*") if p.is_symlink()]


# -- malformed manifests ---------------------------------------------------------------------


def _unknown_layer_type(images: Images) -> tuple[str, str, tuple[str, ...]]:
    blob, raw = tar_layer([entry("etc/motd")])
    digest, layer = images.with_top_layer("weird-layer-type", blob, sha(raw),
                                          media_type="application/vnd.example.layer.v1.squashfs")
    return "weird-layer-type", digest, (f"layer {layer}", "'application/vnd.example.layer.v1.squashfs' is not a tar layer")


def _artifact_config(images: Images) -> tuple[str, str, tuple[str, ...]]:
    digest = images.image("artifact", images.base.config, images.base.manifest["layers"],
                          config_type="application/vnd.cncf.helm.config.v1+json")
    return "artifact", digest, ("config media type 'application/vnd.cncf.helm.config.v1+json' is not a container image config",)


def _config_size_mismatch(images: Images) -> tuple[str, str, tuple[str, ...]]:
    digest = images.image("config-size", images.base.config, images.base.manifest["layers"], config_size_delta=7)
    return "config-size", digest, ("config", "descriptor says")


def _diff_ids_short(images: Images) -> tuple[str, str, tuple[str, ...]]:
    config = json.loads(json.dumps(images.base.config))
    config["rootfs"]["diff_ids"] = config["rootfs"]["diff_ids"][:-1]
    digest = images.image("diff-ids-short", config, images.base.manifest["layers"])
    return "diff-ids-short", digest, ("config rootfs.diff_ids lists 4 digests for 5 layers",)


def _diff_ids_a_string(images: Images) -> tuple[str, str, tuple[str, ...]]:
    """A string as long as the layer list: counting its characters would say "5 for 5 layers"."""
    config = json.loads(json.dumps(images.base.config))
    config["rootfs"]["diff_ids"] = "abcde"
    digest = images.image("diff-ids-string", config, images.base.manifest["layers"])
    return "diff-ids-string", digest, ('config rootfs.diff_ids is a string ("abcde"), not a list of the 5 layers\' digests',)


def _diff_id_not_a_digest(images: Images) -> tuple[str, str, tuple[str, ...]]:
    config = json.loads(json.dumps(images.base.config))
    config["rootfs"]["diff_ids"][2] = "abc"
    digest = images.image("diff-id-not-digest", config, images.base.manifest["layers"])
    return "diff-id-not-digest", digest, ("config rootfs.diff_ids[2]: 'abc' is not a sha256 digest",)


def _index_without_amd64(images: Images) -> tuple[str, str, tuple[str, ...]]:
    arm = json.loads(json.dumps(images.base.config))
    arm["architecture"] = "arm64"
    arm_digest = images.image("arm64-child", arm, images.base.manifest["layers"])
    digest = images.index("no-amd64", [(arm_digest, {"os": "linux", "architecture": "arm64"}, OCI_MANIFEST),
                                       (arm_digest, {"os": "linux", "architecture": "s390x"}, OCI_MANIFEST)])
    return "no-amd64", digest, ("has no linux/amd64 image; it has linux/arm64, linux/s390x",)


def _index_lies_about_platform(images: Images) -> tuple[str, str, tuple[str, ...]]:
    arm = json.loads(json.dumps(images.base.config))
    arm["architecture"] = "arm64"
    arm_digest = images.image("arm64-child", arm, images.base.manifest["layers"])
    digest = images.index("lying-index", [(arm_digest, {"os": "linux", "architecture": "amd64"}, OCI_MANIFEST)])
    return "lying-index", digest, ("image is linux/arm64, this build is for linux/amd64",)


def _nested_index(images: Images) -> tuple[str, str, tuple[str, ...]]:
    inner = images.index("inner-index", [(images.push.manifest("plain-base", images.base.manifest),
                                          {"os": "linux", "architecture": "amd64"}, OCI_MANIFEST)])
    digest = images.index("outer-index", [(inner, {"os": "linux", "architecture": "amd64"}, OCI_INDEX)])
    return "outer-index", digest, (f"nested index {inner} is not supported",)


MANIFEST_CASES = {
    "unknown layer media type": _unknown_layer_type,
    "artifact config media type": _artifact_config,
    "config size mismatch": _config_size_mismatch,
    "diff_ids count != layers": _diff_ids_short,
    "diff_ids a string": _diff_ids_a_string,
    "diff_id not a digest": _diff_id_not_a_digest,
    "index without linux/amd64": _index_without_amd64,
    "index entry lies about its platform": _index_lies_about_platform,
    "nested index": _nested_index,
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_malformed_manifest_is_a_clear_error(case, capsys, tmp_path, images, registry_plain):
    tag, digest, expected = MANIFEST_CASES[case](images)
    outcome = build(capsys, tmp_path, registry_plain, tag, digest, dest_for(tmp_path))
    assert_refused(outcome, tmp_path, registry_plain, dest_for(tmp_path), *expected)


def test_config_digest_mismatch_from_the_registry(capsys, tmp_path, start_registry, registry_plain):
    """The registry's stored config bytes no longer match their digest (disk corruption, or a
    hostile mirror): refused, nothing cached under that digest."""
    broken = start_registry("plain", copy_from=registry_plain)
    images = Images(broken)
    config_digest = images.base.manifest["config"]["digest"]
    path = broken.blob_file(config_digest)
    path.write_bytes(path.read_bytes().replace(b'"amd64"', b'"AMD64"'))
    digest = broken.digest_of(f"{REPO}:v{VLLM_VERSION}")
    outcome = build(capsys, tmp_path, broken, f"v{VLLM_VERSION}", digest, dest_for(tmp_path))
    assert_refused(outcome, tmp_path, broken, dest_for(tmp_path), config_digest, "digest mismatch")
    assert not (tmp_path / "kiln-cache/blobs/sha256" / config_digest.split(":")[1]).exists()


# -- what the registry will not store: an OCI layout written by hand -------------------------


def _layout(tmp_path: Path, base_layout, edit: Callable[[Path, dict], dict]) -> Path:
    """A copy of the fixture layout whose ``index.json`` entry for ``base`` is rewritten by ``edit``."""
    layout = tmp_path / "layout"
    os.makedirs(layout / "blobs/sha256")
    for blob in (base_layout.path / "blobs/sha256").iterdir():
        os.link(blob, layout / "blobs/sha256" / blob.name)
    (layout / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    index = json.loads((base_layout.path / "index.json").read_text())
    [base] = [m for m in index["manifests"] if m["annotations"]["org.opencontainers.image.ref.name"] == "base"]
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [edit(layout, dict(base))]}))
    return layout


def _blob_write(layout: Path, data: bytes, name: str | None = None) -> dict:
    digest = name or sha(data)
    path = layout / "blobs/sha256" / digest.split(":")[1]
    path.unlink(missing_ok=True)
    path.write_bytes(data)
    return {"digest": digest, "size": len(data)}


def _unknown_manifest_type(layout: Path, entry: dict) -> dict:
    return {**entry, "mediaType": "application/vnd.example.manifest.v9+json"}


def _config_bytes_swapped(layout: Path, entry: dict) -> dict:
    manifest = json.loads((layout / "blobs/sha256" / entry["digest"].split(":")[1]).read_bytes())
    config_path = layout / "blobs/sha256" / manifest["config"]["digest"].split(":")[1]
    config = config_path.read_bytes().replace(b'"amd64"', b'"AMD64"')  # same size, other bytes
    _blob_write(layout, config, manifest["config"]["digest"])
    return entry


LAYOUT_CASES = {
    "unknown manifest media type": (_unknown_manifest_type, "unsupported media type 'application/vnd.example.manifest.v9+json'"),
    "config digest mismatch": (_config_bytes_swapped, "digest mismatch"),
}


@pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
def test_malformed_oci_layout_is_a_clear_error(case, tmp_path, base_layout):
    edit, expected = LAYOUT_CASES[case]
    location = _layout(tmp_path, base_layout, edit)
    with pytest.raises(KilnError, match=re.escape(expected)) as err:
        read_vllm(OciLayoutImage(location, "base"), tmp_path / "kiln-cache")
    assert "\n" not in str(err.value)
    assert not list((tmp_path / "kiln-cache" / "sources").glob("image-*"))
