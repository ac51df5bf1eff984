"""``build.py build`` end to end against a real docker-registry, read back with skopeo and podman.

The base is the vLLM-shaped fixture image (umoci/skopeo, real vLLM 0.20.1 files) served under
``vllm/vllm-openai:v0.20.1`` by a local registry that stands in for Docker Hub (``--mirror``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from kiln import commands
from tests.support import TEST_IMAGES, podman_store_dir
from tests.support.kiln_process import run_kiln
from tests.support.registry import SITE, VLLM_VERSION

pytestmark = pytest.mark.registry

OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
IMAGE = "e2e-p65"
IMAGES = TEST_IMAGES
SM = 120
TAG = f"cu130-sm{SM}-v{VLLM_VERSION}"
PATCHED = "v1/attention/backends/turboquant_attn.py"  # what P65 edits
UNPATCHED = "envs.py"


@dataclass
class Project:
    root: Path
    registry: object  # RegistryServer holding the base
    base_digest: str
    # a build runs as its own process (tests/support/kiln_process.py) unless a test counts what
    # it does in this one (the patch_runs fixture, tests/image/conftest.py)
    in_process: bool = False

    @property
    def dest(self) -> str:
        """A destination repository of this test's own (the registries are shared by the session)."""
        return "test/" + re.sub(r"[^a-z0-9]+", "-", self.root.name.lower()).strip("-")

    def pins(self, digest: str | None = None, vllm: str = VLLM_VERSION, image: str | None = None) -> Path:
        path = self.root / f"pins-{hashlib.sha256(f'{digest}{vllm}{image}'.encode()).hexdigest()[:8]}.toml"
        lock = self.base_digest if digest is None else digest
        path.write_text(
            '[pins."v0.20.1"]\nrole = "current"\n'
            f'image = "{image or "docker.io/vllm/vllm-openai:v0.20.1"}"\n'
            f'vllm = "{vllm}"\ncuda = "cu130"\ndigest = "{lock}"\n'
        )
        return path

    def build(self, capsys, *extra: str, pins: Path | None = None, mirror: str | None = None) -> tuple[int, dict | None, str]:
        argv = ["--pins", str(pins or self.pins()), "--images", str(IMAGES), "build", "--image", IMAGE,
                "--pin", "v0.20.1", "--sm", str(SM), "--mirror", mirror or self.registry.mirror, "--json", *extra]
        if self.in_process:
            capsys.readouterr()
            code = commands.main(argv)
            out, err = capsys.readouterr()
        else:
            code, out, err = run_kiln(*argv)
        return code, (json.loads(out) if code == 0 else None), err


def _skopeo_inspect(target: str, *flags: str) -> dict:
    result = subprocess.run(["skopeo", "inspect", *flags, target], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _tag_exists(registry, repository: str, tag: str) -> bool:
    resp = requests.head(f"{registry.url}/v2/{repository}/manifests/{tag}",
                         headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=10)
    return resp.status_code == 200


def _check_layout(layout: Path, tag: str) -> dict:
    """Every blob present and matching its digest; every diff_id = sha256 of the uncompressed layer."""
    index = json.loads((layout / "index.json").read_text())
    assert json.loads((layout / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    [entry] = [m for m in index["manifests"] if "artifactType" not in m]  # the rest: SBOM, provenance
    assert entry["annotations"]["org.opencontainers.image.ref.name"] == tag

    def blob(digest: str) -> bytes:
        data = (layout / "blobs/sha256" / digest.split(":")[1]).read_bytes()
        assert "sha256:" + hashlib.sha256(data).hexdigest() == digest
        return data

    manifest = json.loads(blob(entry["digest"]))
    config = json.loads(blob(manifest["config"]["digest"]))
    diff_ids = [
        "sha256:" + hashlib.sha256(gzip.decompress(blob(layer["digest"]))).hexdigest()
        for layer in manifest["layers"]
    ]
    assert config["rootfs"]["diff_ids"] == diff_ids  # podman would not notice a wrong one
    non_empty = [h for h in config["history"] if not h.get("empty_layer")]
    assert len(non_empty) == len(diff_ids)
    return {"manifest": manifest, "config": config, "digest": entry["digest"]}


def _layer_files(layout: Path, digest: str) -> dict[str, bytes]:
    with tarfile.open(layout / "blobs/sha256" / digest.split(":")[1], "r:gz") as tar:
        return {m.name: tar.extractfile(m).read() if m.isfile() else b"" for m in tar.getmembers() if not m.isdir()}


def test_build_oci_layout_is_complete_and_reproducible(project, capsys, tmp_path, base_layout):
    code, first, err = project.build(capsys, "--oci", str(tmp_path / "one"))
    assert code == 0, err
    assert first["tag"] == TAG
    assert first["outputs"]["oci"] == f"oci:{tmp_path / 'one'}:{TAG}"
    found = _check_layout(tmp_path / "one", TAG)
    assert found["digest"] == first["manifest_digest"]
    manifest, config = found["manifest"], found["config"]
    base_layers = [base_layout.layers[r] for r in ("rootfs", "filler-cuda", "filler-torch", "vllm", "app")]
    assert [layer["digest"] for layer in manifest["layers"]] == [*base_layers, first["layer_digest"]]
    annotations = manifest["annotations"]
    assert annotations["org.opencontainers.image.base.name"] == "docker.io/vllm/vllm-openai:v0.20.1"
    assert annotations["org.opencontainers.image.base.digest"] == project.base_digest
    assert annotations["io.kiln.pin"] == "v0.20.1" and annotations["io.kiln.sm"] == str(SM)
    assert annotations["io.kiln.patches"] == "P65"
    assert config["config"]["Labels"]["io.kiln.patches"] == "P65"

    # the new layer: the patched module, its bytecode whiteouts, the audit file and nothing else
    files = _layer_files(tmp_path / "one", first["layer_digest"])
    assert set(files) == {
        f"{SITE}/vllm/{PATCHED}",
        *(f"{SITE}/vllm/v1/attention/backends/__pycache__/.wh.turboquant_attn.cpython-312{s}.pyc"
          for s in ("", ".opt-1", ".opt-2")),
        "opt/kiln/manifest.json",
    }
    audit = json.loads(files["opt/kiln/manifest.json"])
    original = base_layout.wheel_files[f"vllm/{PATCHED}"]
    patched = files[f"{SITE}/vllm/{PATCHED}"]
    assert patched != original
    assert audit["files"] == {f"/{SITE}/vllm/{PATCHED}": {
        "before": hashlib.sha256(original).hexdigest(), "after": hashlib.sha256(patched).hexdigest()}}
    assert audit["base"] == {"reference": "docker.io/vllm/vllm-openai:v0.20.1", "digest": project.base_digest}
    assert audit["pin"]["name"] == "v0.20.1" and audit["sm"] == SM
    assert [(p["patch"], p["verdict"]) for p in audit["patches"]] == [("P65", "APPLIES")]
    assert audit["kiln"]["version"]

    # skopeo reads the layout
    inspected = _skopeo_inspect(f"oci:{tmp_path / 'one'}:{TAG}")
    assert inspected["Digest"] == first["manifest_digest"]
    assert inspected["Labels"]["io.kiln.pin"] == "v0.20.1"

    # same inputs, warm cache -> same digest; cold cache (fresh process state) -> same digest
    code, second, err = project.build(capsys, "--oci", str(tmp_path / "two"))
    assert code == 0, err
    assert second["manifest_digest"] == first["manifest_digest"]
    assert second["bytes_pulled"] < first["bytes_pulled"]  # base layers came from the cache
    shutil.rmtree(tmp_path / "kiln-cache")
    code, third, err = project.build(capsys, "--oci", str(tmp_path / "one"))  # replaces the layout
    assert code == 0, err
    assert third["manifest_digest"] == first["manifest_digest"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left


def test_build_reads_only_the_vllm_layers_for_push(project, capsys, base_layout):
    code, result, err = project.build(capsys, "--push", "--repository", f"{project.registry.host}/{project.dest}")
    assert code == 0, err
    # same registry: every base blob is mounted, only the new layer and config are uploaded, and
    # the attestations' blobs (the empty config, the SBOM, the provenance envelope)
    assert result["blobs_mounted"] == 5 and result["blobs_uploaded"] == 2 + 3
    # only the layers holding vLLM (the app layer on top, then the vllm layer) were downloaded;
    # the fillers (incompressible, 3 MiB each) never were
    needed = base_layout.layer_sizes["vllm"] + base_layout.layer_sizes["app"]
    assert needed <= result["bytes_pulled"] <= needed * 1.05 + 64 * 1024
    host = project.registry.host
    inspected = _skopeo_inspect(f"docker://{host}/{project.dest}:{TAG}", "--tls-verify=false")
    assert inspected["Digest"] == result["manifest_digest"]
    assert result["outputs"]["push"] == f"{project.registry.host}/{project.dest}:{TAG}@{result['manifest_digest']}"
    # pushing again finds everything present and gives the same digest
    code, again, err = project.build(capsys, "--push", "--repository", f"{project.registry.host}/{project.dest}")
    assert code == 0, err
    assert again["manifest_digest"] == result["manifest_digest"]
    assert again["blobs_uploaded"] == 0 and again["blobs_mounted"] == 0


def test_build_push_to_another_registry_uploads(project, capsys, start_registry, base_layout):
    other = start_registry("plain")
    code, result, err = project.build(capsys, "--push", "--repository", f"{other.host}/{project.dest}",
                                      "--insecure-registry", other.host)
    assert code == 0, err
    assert result["blobs_mounted"] == 0 and result["blobs_uploaded"] == 7 + 3  # + the attestations' 3
    assert result["bytes_pushed"] > sum(base_layout.layer_sizes[r] for r in ("filler-cuda", "filler-torch"))
    assert other.digest_of(f"{project.dest}:{TAG}") == result["manifest_digest"]


def _podman(store: Path, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    cmd = ["podman", "--root", str(store / "root"), "--runroot", str(store / "run"), "--runtime", "runc", *args]
    env = {k: v for k, v in os.environ.items() if k != "DOCKER_CONFIG"}  # the isolating fixture's dir is empty
    return subprocess.run(cmd, capture_output=True, input=stdin, timeout=300, env=env)


def _podman_cat(store: Path, image: str, *paths_in_image: str) -> subprocess.CompletedProcess:
    return _podman(store, "run", "--rm", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
                   "--network", "none", image, "cat", *paths_in_image)


@pytest.fixture
def podman_store():
    if shutil.which("podman") is None or shutil.which("runc") is None:
        pytest.fail("podman/runc not installed (run ci/test, which installs them)")
    store = podman_store_dir("kp-")
    yield store
    _podman(store, "system", "reset", "--force")
    shutil.rmtree(store, ignore_errors=True)


def test_pushed_image_runs_with_podman(project, capsys, podman_store, base_layout):
    code, result, err = project.build(capsys, "--push", "--repository", f"{project.registry.host}/{project.dest}")
    assert code == 0, err
    ref = f"{project.registry.host}/{project.dest}:{TAG}"
    pulled = _podman(podman_store, "pull", "--tls-verify=false", ref)
    assert pulled.returncode == 0, pulled.stderr.decode()
    _check_running_image(podman_store, ref, base_layout)


def test_docker_archive_loads_with_podman(project, capsys, tmp_path, podman_store, base_layout):
    archive = tmp_path / "out" / "image.tar"
    code, result, err = project.build(capsys, "--docker-archive", str(archive))
    assert code == 0, err
    with tarfile.open(archive) as tar:
        index = json.loads(tar.extractfile("manifest.json").read())
        assert index[0]["RepoTags"] == [f"docker.io/kiln/e2e-p65:{TAG}"]
        config = json.loads(tar.extractfile(index[0]["Config"]).read())
        diff_ids = ["sha256:" + hashlib.sha256(gzip.decompress(tar.extractfile(n).read())).hexdigest()
                    for n in index[0]["Layers"]]
        assert config["rootfs"]["diff_ids"] == diff_ids
    loaded = _podman(podman_store, "load", "-i", str(archive))
    assert loaded.returncode == 0, loaded.stderr.decode()
    _check_running_image(podman_store, f"docker.io/kiln/e2e-p65:{TAG}", base_layout)


def _check_running_image(store: Path, ref: str, base_layout) -> None:
    ran = _podman_cat(store, ref, "/opt/kiln/manifest.json")
    if ran.returncode != 0 and b"rlimit" in ran.stderr + ran.stdout:
        pytest.fail(f"podman cannot run containers here: {ran.stderr.decode()[-300:]}")
    assert ran.returncode == 0, ran.stderr.decode()
    audit = json.loads(ran.stdout)
    patched = _podman_cat(store, ref, f"/{SITE}/vllm/{PATCHED}")
    assert patched.returncode == 0, patched.stderr.decode()
    assert hashlib.sha256(patched.stdout).hexdigest() == audit["files"][f"/{SITE}/vllm/{PATCHED}"]["after"]
    # files kiln did not touch are byte-identical to the base
    for rel in (UNPATCHED, "__init__.py", "v1/attention/backends/registry.py"):
        seen = _podman_cat(store, ref, f"/{SITE}/vllm/{rel}")
        assert seen.returncode == 0, seen.stderr.decode()
        assert seen.stdout == base_layout.wheel_files[f"vllm/{rel}"], rel


# -- bad input: one clear error each, exit 2, nothing pushed, nothing written ------------------


def _assert_failed_cleanly(code: int, err: str, tmp_path: Path, registry, expect: str, dest: str) -> None:
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines and "error:" in lines[-1] and expect in " ".join(lines), err
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []
    assert not _tag_exists(registry, dest, TAG)


def _outputs(project: Project, tmp_path: Path) -> tuple[str, ...]:
    return ("--oci", str(tmp_path / "out"), "--push", "--repository", f"{project.registry.host}/{project.dest}")


def test_unlocked_pin_is_refused(project, capsys, tmp_path):
    code, _, err = project.build(capsys, *_outputs(project, tmp_path), pins=project.pins(digest=""))
    _assert_failed_cleanly(code, err, tmp_path, project.registry, "is not locked", project.dest)
    code, result, err = project.build(capsys, "--allow-unlocked", pins=project.pins(digest=""))
    assert code == 0, err
    assert result["base_digest"] == project.base_digest


def test_digest_mismatch_is_refused(project, capsys, tmp_path):
    code, _, err = project.build(capsys, *_outputs(project, tmp_path), pins=project.pins(digest="sha256:" + "0" * 64))
    _assert_failed_cleanly(code, err, tmp_path, project.registry, "now resolves to", project.dest)


def test_vllm_version_mismatch_is_refused(project, capsys, tmp_path):
    code, _, err = project.build(capsys, *_outputs(project, tmp_path), pins=project.pins(vllm="0.20.0"))
    _assert_failed_cleanly(code, err, tmp_path, project.registry, "carries vLLM 0.20.1", project.dest)


def test_base_without_vllm_is_refused(project, capsys, tmp_path):
    digest = project.registry.digest_of("test/no-vllm:1")
    pins = project.pins(digest=digest, image="docker.io/test/no-vllm:1")
    code, _, err = project.build(capsys, *_outputs(project, tmp_path), pins=pins)
    _assert_failed_cleanly(code, err, tmp_path, project.registry, "no vLLM in the image", project.dest)


def test_unreachable_registry(project, capsys, tmp_path):
    from tests.support.registry import free_port

    code, _, err = project.build(capsys, *_outputs(project, tmp_path), mirror=f"docker.io=http://127.0.0.1:{free_port()}")
    _assert_failed_cleanly(code, err, tmp_path, project.registry, "unreachable", project.dest)


def test_push_unauthorised_leaves_no_tag(project, capsys, tmp_path, registry_basic):
    code, _, err = project.build(capsys, "--oci", str(tmp_path / "out"), "--push", "--repository",
                                 f"{registry_basic.host}/{project.dest}", "--insecure-registry", registry_basic.host)
    assert code == 2
    assert "401" in err or "unauthori" in err.lower() or "credentials" in err.lower(), err
    # neither the local output nor a tag is left behind
    assert not (tmp_path / "out").exists()
    resp = requests.head(f"{registry_basic.url}/v2/{project.dest}/manifests/{TAG}", auth=("testuser", "testpass"),
                         headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=10)
    assert resp.status_code == 404


def test_push_with_credentials_to_token_registry(project, capsys, tmp_path, registry_token, monkeypatch):
    monkeypatch.setenv("KILN_REGISTRY_USER", "testuser")
    monkeypatch.setenv("KILN_REGISTRY_PASSWORD", "testpass")
    code, result, err = project.build(capsys, "--push", "--repository", f"{registry_token.host}/test/kiln-out",
                                      "--insecure-registry", registry_token.host)
    assert code == 0, err
    assert registry_token.digest_of(f"test/kiln-out:{TAG}") == result["manifest_digest"]


def test_corrupted_base_blob_is_refused(capsys, tmp_path, start_registry, registry_plain, base_layout):
    broken = start_registry("plain", copy_from=registry_plain)
    blob = broken.blob_file(base_layout.layers["vllm"])
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    project = Project(tmp_path, broken, broken.digest_of(f"vllm/vllm-openai:v{VLLM_VERSION}"))
    code, _, err = project.build(capsys, *_outputs(project, tmp_path))
    _assert_failed_cleanly(code, err, tmp_path, broken, base_layout.layers["vllm"], project.dest)


@pytest.mark.parametrize("suffix", ["-docker", "-index"])
def test_docker_v2_and_index_bases(project, capsys, tmp_path, suffix):
    """A Docker v2 base gives an OCI image over the same blobs; an index base is built from
    its linux/amd64 entry and locked by the index digest."""
    name = f"vllm/vllm-openai:v{VLLM_VERSION}{suffix}"
    digest = project.registry.digest_of(name)
    pins = project.pins(digest=digest, image=f"docker.io/{name}")
    code, result, err = project.build(capsys, "--oci", str(tmp_path / "out"), pins=pins)
    assert code == 0, err
    assert result["media_type"] == "application/vnd.oci.image.manifest.v1+json"
    assert result["base_digest"] == digest
    found = _check_layout(tmp_path / "out", TAG)
    assert found["config"]["config"]["Labels"]["org.opencontainers.image.base.digest"] == digest
    assert found["manifest"]["annotations"]["io.kiln.pin"] == "v0.20.1"
    if suffix == "-docker":
        assert {layer["mediaType"] for layer in found["manifest"]["layers"]} == {OCI_LAYER_GZIP}
    else:
        assert result["base_manifest_digest"] != digest  # the amd64 child, not the index
    assert _skopeo_inspect(f"oci:{tmp_path / 'out'}:{TAG}")["Digest"] == result["manifest_digest"]
