"""A base whose layers are zstd (``tar+zstd``, what BuildKit pushes with ``compression=zstd``),
built on end to end against a real docker-registry.

The base is the fixture base (umoci, real vLLM 0.20.1 files) recompressed by skopeo
(``--dest-compress-format zstd``, into an OCI layout first so that no gzip blob of the
registry is reused) and pushed under ``vllm/vllm-openai:v0.20.1-zstd``: the same config, hence
the same diff_ids, over zstd blobs. The build must read it as it reads the gzip base, give the
same patched files, leave every base layer as it is (digest, size, media type), and refuse a
zstd layer whose bytes are not its diff_id in one line naming the layer.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

try:
    from compression import zstd
except ImportError:
    from backports import zstd

from tests.image.test_build_e2e import (  # noqa: F401  (podman_store: a fixture)
    IMAGES,
    TAG,
    Project,
    _assert_failed_cleanly,
    _check_running_image,
    _outputs,
    _podman,
    _skopeo_inspect,
    podman_store,
)
from tests.support.hostile import HandPusher
from tests.support.kiln_process import run_kiln
from tests.support.registry import REPO, SITE, VLLM_VERSION, run

pytestmark = pytest.mark.registry

OCI_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
ZSTD_TAG = f"v{VLLM_VERSION}-zstd"
ROLES = ("rootfs", "filler-cuda", "filler-torch", "vllm", "app")


@pytest.fixture(scope="module")
def zstd_base(tmp_path_factory, registry_plain, base_layout) -> dict:
    """The fixture base with zstd layers, in the registry; its manifest and config as JSON."""
    layout = tmp_path_factory.mktemp("zstd-base") / "layout"
    run("skopeo", "copy", "--quiet", "--dest-compress-format", "zstd", base_layout.oci("base"), f"oci:{layout}:base")
    registry_plain.push(f"oci:{layout}:base", f"{REPO}:{ZSTD_TAG}")
    push = HandPusher(registry_plain)
    manifest = json.loads(push.get("manifests", ZSTD_TAG))
    assert {layer["mediaType"] for layer in manifest["layers"]} == {OCI_LAYER_ZSTD}
    gzip_manifest = json.loads(push.get("manifests", f"v{VLLM_VERSION}"))
    assert manifest["config"] == gzip_manifest["config"]  # the same config: the same diff_ids
    blobs = {layer["digest"]: push.get("blobs", layer["digest"]) for layer in manifest["layers"]}
    config = json.loads(push.get("blobs", manifest["config"]["digest"]))
    for layer, diff_id in zip(manifest["layers"], config["rootfs"]["diff_ids"], strict=True):
        data = blobs[layer["digest"]]
        assert data[:4] == b"\x28\xb5\x2f\xfd"  # zstd's magic: recompressed, not a gzip blob relabelled
        assert "sha256:" + hashlib.sha256(zstd.decompress(data)).hexdigest() == diff_id
    return {"manifest": manifest, "config": config, "blobs": blobs,
            "digest": registry_plain.digest_of(f"{REPO}:{ZSTD_TAG}")}


def _build(project: Project, capsys, tag: str, digest: str, *extra: str) -> tuple[int, dict | None, str]:
    pins = project.pins(digest=digest, image=f"docker.io/{REPO}:{tag}")
    return project.build(capsys, *extra, pins=pins)


def _layout(out: Path) -> tuple[dict, dict, dict[str, bytes]]:
    """(manifest, config, blobs) of the one image in a layout, every blob checked against its digest."""
    index = json.loads((out / "index.json").read_text())
    [entry] = [m for m in index["manifests"] if "artifactType" not in m]

    def blob(digest: str) -> bytes:
        data = (out / "blobs/sha256" / digest.split(":")[1]).read_bytes()
        assert "sha256:" + hashlib.sha256(data).hexdigest() == digest
        return data

    manifest = json.loads(blob(entry["digest"]))
    config = json.loads(blob(manifest["config"]["digest"]))
    return manifest, config, {layer["digest"]: blob(layer["digest"]) for layer in manifest["layers"]}


def _site_files(gzip_layer: bytes) -> dict[str, bytes]:
    """The files kiln's layer puts under the site dir (the audit file names the base: left out)."""
    with tarfile.open(fileobj=io.BytesIO(gzip_layer), mode="r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile() and m.name.startswith(SITE)}


def test_a_build_on_a_zstd_base_gives_the_gzip_bases_files_over_its_untouched_layers(project, capsys, tmp_path,
                                                                                       zstd_base):
    code, built, err = _build(project, capsys, ZSTD_TAG, zstd_base["digest"], "--oci", str(tmp_path / "zstd"),
                              "--push", "--repository", f"{project.registry.host}/{project.dest}")
    assert code == 0, err
    assert built["base_digest"] == zstd_base["digest"]
    code, plain, err = project.build(capsys, "--oci", str(tmp_path / "gzip"))
    assert code == 0, err

    manifest, config, blobs = _layout(tmp_path / "zstd")
    # the base's layers as the base has them: digest, size, media type (zstd), bytes
    assert manifest["layers"][:len(ROLES)] == zstd_base["manifest"]["layers"]
    for layer in zstd_base["manifest"]["layers"]:
        assert blobs[layer["digest"]] == zstd_base["blobs"][layer["digest"]]
    # kiln's own layer stays gzip, its diff_id that of its tar
    [ours] = manifest["layers"][len(ROLES):]
    assert ours["mediaType"] == OCI_LAYER_GZIP and ours["digest"] == built["layer_digest"]
    assert config["rootfs"]["diff_ids"] == [*zstd_base["config"]["rootfs"]["diff_ids"],
                                            "sha256:" + hashlib.sha256(gzip.decompress(blobs[ours["digest"]])).hexdigest()]
    # the same patched files as the build on the gzip base (the same vLLM, the same patches)
    gzip_manifest, _, gzip_blobs = _layout(tmp_path / "gzip")
    zstd_files = _site_files(blobs[ours["digest"]])
    assert zstd_files and zstd_files == _site_files(gzip_blobs[gzip_manifest["layers"][-1]["digest"]])
    assert f"{SITE}/vllm/v1/attention/backends/turboquant_attn.py" in zstd_files
    # pushed: the registry holds the same image, its base layers still zstd
    target = f"docker://{project.registry.host}/{project.dest}:{TAG}"
    assert _skopeo_inspect(target, "--tls-verify=false")["Digest"] == built["manifest_digest"]
    assert _skopeo_inspect(target, "--tls-verify=false", "--raw")["layers"] == manifest["layers"]
    # and ``check`` re-derives it from the zstd base: the same image
    pins = project.pins(digest=zstd_base["digest"], image=f"docker.io/{REPO}:{ZSTD_TAG}")
    code, out, err = run_kiln("--pins", pins, "--images", IMAGES, "check",
                          f"{project.registry.host}/{project.dest}:{TAG}", "--mirror", project.registry.mirror)
    assert code == 0, err
    assert out.startswith("identical:") and built["manifest_digest"] in out


def test_the_image_on_a_zstd_base_runs_with_podman(project, capsys, zstd_base, podman_store, base_layout):  # noqa: F811
    code, _, err = _build(project, capsys, ZSTD_TAG, zstd_base["digest"], "--push", "--repository",
                          f"{project.registry.host}/{project.dest}")
    assert code == 0, err
    ref = f"{project.registry.host}/{project.dest}:{TAG}"
    pulled = _podman(podman_store, "pull", "--tls-verify=false", ref)
    assert pulled.returncode == 0, pulled.stderr.decode()
    _check_running_image(podman_store, ref, base_layout)


def test_the_docker_archive_on_a_zstd_base_loads_with_podman(project, capsys, tmp_path, zstd_base, podman_store,  # noqa: F811
                                                            base_layout):
    archive = tmp_path / "out" / "image.tar"
    code, _, err = _build(project, capsys, ZSTD_TAG, zstd_base["digest"], "--docker-archive", str(archive))
    assert code == 0, err
    with tarfile.open(archive) as tar:
        [entry] = json.loads(tar.extractfile("manifest.json").read())
        layers = [tar.extractfile(name).read() for name in entry["Layers"]]
        config = json.loads(tar.extractfile(entry["Config"]).read())
    # the base's zstd blobs as they are, kiln's gzip layer on top
    assert layers[:len(ROLES)] == [zstd_base["blobs"][layer["digest"]] for layer in zstd_base["manifest"]["layers"]]
    assert [name.split(".", 1)[1] for name in entry["Layers"]] == ["tar.zst"] * len(ROLES) + ["tar.gz"]
    tars = [zstd.decompress(data) for data in layers[:len(ROLES)]] + [gzip.decompress(layers[-1])]
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(raw).hexdigest() for raw in tars]
    loaded = _podman(podman_store, "load", "-i", str(archive))
    assert loaded.returncode == 0, loaded.stderr.decode()
    _check_running_image(podman_store, f"docker.io/kiln/e2e-p65:{TAG}", base_layout)


@pytest.mark.reliability
@pytest.mark.parametrize("corruption", ["diff_id", "stream"])
def test_a_corrupt_zstd_layer_is_refused_in_one_line_naming_it(project, capsys, tmp_path, zstd_base, corruption):
    """``diff_id``: the config gives the vLLM layer another diff_id (its bytes are another tar
    than the config says); ``stream``: one byte of the vLLM layer's zstd stream flipped, served
    under the digest of the flipped bytes (a registry that hashes what it stores agrees)."""
    push = HandPusher(project.registry)
    manifest = json.loads(json.dumps(zstd_base["manifest"]))
    config = json.loads(json.dumps(zstd_base["config"]))
    position = ROLES.index("vllm")
    layer = manifest["layers"][position]
    if corruption == "diff_id":
        config["rootfs"]["diff_ids"][position] = "sha256:" + hashlib.sha256(b"another tar").hexdigest()
    else:
        data = bytearray(zstd_base["blobs"][layer["digest"]])
        data[len(data) // 2] ^= 0xFF
        layer.update(push.blob(bytes(data)))
    manifest["config"].update(push.blob(json.dumps(config).encode()))
    tag = f"{ZSTD_TAG}-bad-{corruption}"
    digest = push.manifest(tag, manifest)
    code, _, err = _build(project, capsys, tag, digest, *_outputs(project, tmp_path))
    _assert_failed_cleanly(code, err, tmp_path, project.registry, f"layer {layer['digest']}", project.dest)
    line = [line for line in err.splitlines() if line.strip()][-1]
    print(f"kiln said: {line}")  # docs/RELIABILITY.md quotes it
    assert line.startswith("error: ") and f"layer {layer['digest']}" in line and "Traceback" not in err
    if corruption == "diff_id":
        assert f"not to its diff_id {config['rootfs']['diff_ids'][position]}" in line
    else:
        assert "is not a readable tar" in line or "not to its diff_id" in line


def test_a_zstd_chunked_base_is_read_and_its_diff_ids_held_to_its_bytes(project, capsys, tmp_path, registry_plain,
                                                                       base_layout):
    """zstd:chunked (podman's: the files' table in skippable frames) is zstd to kiln. skopeo 1.9.3
    writes its tar without the gzip layers' trailing padding yet keeps their config, so its
    diff_ids may not be its bytes' (containerd's unpack compares them too): kiln builds it when
    they are, and refuses it naming the first layer read when they are not."""
    layout = tmp_path / "chunked"
    run("skopeo", "copy", "--quiet", "--dest-compress-format", "zstd:chunked", base_layout.oci("base"),
        f"oci:{layout}:base")
    tag = f"v{VLLM_VERSION}-zstd-chunked"
    registry_plain.push(f"oci:{layout}:base", f"{REPO}:{tag}")
    push = HandPusher(registry_plain)
    manifest = json.loads(push.get("manifests", tag))
    assert {layer["mediaType"] for layer in manifest["layers"]} == {OCI_LAYER_ZSTD}
    config = json.loads(push.get("blobs", manifest["config"]["digest"]))
    top, top_diff_id = manifest["layers"][-1], config["rootfs"]["diff_ids"][-1]
    held = "sha256:" + hashlib.sha256(zstd.decompress(push.get("blobs", top["digest"]))).hexdigest() == top_diff_id
    code, built, err = _build(project, capsys, tag, registry_plain.digest_of(f"{REPO}:{tag}"), "--oci",
                              str(tmp_path / "out"))
    print(f"diff_ids held: {held}; kiln: {err.strip().splitlines()[-1] if err.strip() else 'built'}")
    if held:
        assert code == 0, err
    else:
        line = [line for line in err.splitlines() if line.strip()][-1]
        assert code == 2 and line.startswith("error: ") and f"layer {top['digest']} decompresses to" in line, err
        assert f"not to its diff_id {top_diff_id}" in line
