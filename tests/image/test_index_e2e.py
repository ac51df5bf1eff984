"""One OCI image index per tag, one manifest per platform the SM ships on (issue #35 item 5).

Against a real docker-registry holding a real two-platform base with Triton 3.6.0 on both halves
(``v0.20.1-multi36``: linux/amd64 with the x86_64 cp312 dist-info, linux/arm64 with the real
aarch64 cp312 dist-info, made by umoci, pushed by ``skopeo copy --all``). What was pushed is read
back by independent tools: ``skopeo inspect --raw``, ``skopeo --override-arch arm64 copy`` and
``umoci unpack``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess

import pytest
import requests

from kiln import commands
from kiln.triton.imagekey import LIBTRITON, record_hashes
from tests.support import TEST_IMAGES
from tests.support.kiln_process import run_kiln
from tests.support.registry import (
    SITE,
    TRITON_CP312_AARCH64_RECORD,
    TRITON_CP312_RECORD,
    VLLM_VERSION,
)

pytestmark = pytest.mark.registry

BASE = f"vllm/vllm-openai:v{VLLM_VERSION}-multi36"
PIN = """\
[pins."v0.20.1"]
role = "current"
image = "docker.io/{image}"
vllm = "{vllm}"
cuda = "cu130"
"""
IMAGE = (TEST_IMAGES / "e2e-triton.toml").read_text().replace("sms = [86, 120]", "sms = [86, 90, 120, 121]")
LIBTRITONS = {"linux/amd64": record_hashes(TRITON_CP312_RECORD.read_text())[LIBTRITON],
              "linux/arm64": record_hashes(TRITON_CP312_AARCH64_RECORD.read_bytes().decode())[LIBTRITON]}


def build_cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = commands.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line(code: int, err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def skopeo(registry, *argv) -> bytes:
    return subprocess.run(["skopeo", *argv], capture_output=True, check=True).stdout


def raw(registry, name: str, *extra) -> dict:
    return json.loads(skopeo(registry, *extra, "inspect", "--raw", "--tls-verify=false",
                             f"docker://{registry.host}/{name}"))


@pytest.fixture
def work(tmp_path, capsys, registry_plain):
    images = tmp_path / "images"
    images.mkdir()
    (images / "e2e-triton.toml").write_text(IMAGE)
    pins = tmp_path / "pins.toml"
    pins.write_text(PIN.format(image=BASE, vllm=VLLM_VERSION))
    code, _, err = build_cli(capsys, "--pins", pins, "pin", "lock", "--mirror", registry_plain.mirror)
    assert code == 0, err
    return tmp_path


def build(capsys, work, registry, sm: int, repo: str, *extra, in_process: bool = False):
    """A build in a process of its own (tests/support/kiln_process.py), or in this one for a test
    that replaces a function of kiln's."""
    argv = ("--pins", work / "pins.toml", "--images", work / "images", "build", "--image", "e2e-triton",
            "--pin", "v0.20.1", "--sm", sm, "--mirror", registry.mirror, "--push",
            "--repository", f"{registry.host}/{repo}", "--json", *extra)
    return build_cli(capsys, *argv) if in_process else run_kiln(*argv)


def kernels_audit(registry, tmp_path, ref: str, arch: str) -> tuple[dict, dict]:
    """The image's kernel audit file and its config, through skopeo --override-arch and umoci unpack."""
    layout = tmp_path / f"oci-{arch}"
    skopeo(registry, "--override-arch", arch, "copy", "--src-tls-verify=false", f"docker://{registry.host}/{ref}",
           f"oci:{layout}:img")
    bundle = tmp_path / f"bundle-{arch}"
    subprocess.run(["umoci", "unpack", "--rootless", "--image", f"{layout}:img", str(bundle)], check=True,
                   capture_output=True)
    config = json.loads((bundle / "config.json").read_text())
    return json.loads((bundle / "rootfs/opt/kiln/triton-kernels.json").read_text()), config


def test_a_tag_is_an_index_of_its_platforms_each_on_its_own_base(capsys, work, registry_plain, tmp_path,
                                                                 monkeypatch):
    code, out, err = build(capsys, work, registry_plain, 90, "kiln/index")
    assert code == 0, err
    summary = json.loads(out)
    tag = f"kiln/index:{summary['tag']}"
    index = raw(registry_plain, tag)
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    entries = {f"{m['platform']['os']}/{m['platform']['architecture']}": m["digest"] for m in index["manifests"]}
    assert list(entries) == ["linux/amd64", "linux/arm64"]
    assert registry_plain.digest_of(tag) == summary["manifest_digest"]
    base = {f"{m['platform']['os']}/{m['platform']['architecture']}": m["digest"]
            for m in raw(registry_plain, BASE)["manifests"]}
    patched = set()
    for platform, digest in entries.items():
        manifest = raw(registry_plain, f"kiln/index@{digest}")
        base_layers = raw(registry_plain, f"{BASE.split(':')[0]}@{base[platform]}")["layers"]
        assert [layer["digest"] for layer in manifest["layers"][:len(base_layers)]] == [
            layer["digest"] for layer in base_layers], platform  # on its own platform's base layers
        assert len(manifest["layers"]) == len(base_layers) + 2  # the patched source and the kernels
        patched.add(manifest["layers"][len(base_layers)]["digest"])
        assert summary["platforms"][platform]["manifest_digest"] == digest
        # its SBOM and provenance are attached to it
        assert len(raw(registry_plain, f"kiln/index:{digest.replace(':', '-')}")["manifests"]) == 2
    assert len(patched) == 1  # the patched-source layer: the same blob on both platforms
    amd, amd_config = kernels_audit(registry_plain, tmp_path, tag, "amd64")
    arm, arm_config = kernels_audit(registry_plain, tmp_path, tag, "arm64")
    assert arm_config["process"]["env"] == amd_config["process"]["env"] and arm["triton"]["keyed_for_libtriton_sha256"] == LIBTRITONS[
        "linux/arm64"]
    assert amd["triton"]["keyed_for_libtriton_sha256"] == LIBTRITONS["linux/amd64"]
    assert arm["triton"]["keyed_for_ptxas_version"] and "keyed_for_ptxas_version" not in amd["triton"]
    assert {k["hash"] for launch in arm["launches"] for k in launch["kernels"]}.isdisjoint(
        {k["hash"] for launch in amd["launches"] for k in launch["kernels"]})  # keyed apart
    # the patched files, read from each platform's unpacked rootfs (umoci): the same bytes, the
    # ones each platform's audit file says the patching made
    audits = {arch: json.loads((tmp_path / f"bundle-{arch}/rootfs/opt/kiln/manifest.json").read_text())
              for arch in ("amd64", "arm64")}
    assert audits["amd64"]["files"] and audits["amd64"]["files"] == audits["arm64"]["files"]
    # each half's vLLM is its own platform's real wheel (the dist-info's WHEEL tag says which):
    # the equal patched files below were read from two wheels, not one copied twice
    tags = {arch: (tmp_path / f"bundle-{arch}/rootfs/{SITE}/vllm-{VLLM_VERSION}.dist-info/WHEEL").read_text()
            for arch in ("amd64", "arm64")}
    assert "_x86_64\n" in tags["amd64"] and "_aarch64\n" in tags["arm64"], tags
    for path, sums in audits["amd64"]["files"].items():
        amd_bytes, arm_bytes = ((tmp_path / f"bundle-{arch}/rootfs{path}").read_bytes() for arch in ("amd64", "arm64"))
        assert amd_bytes == arm_bytes and hashlib.sha256(amd_bytes).hexdigest() == sums["after"] != sums["before"], path

    # the same index digest from empty caches, pushed under another name
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "second-cache"))
    code, out, err = build(capsys, work, registry_plain, 90, "kiln/index-again")
    assert code == 0, err
    assert json.loads(out)["manifest_digest"] == summary["manifest_digest"]


def test_an_arm64_only_sm_pushes_only_arm64(capsys, work, registry_plain):
    code, out, err = build(capsys, work, registry_plain, 121, "kiln/spark")
    assert code == 0, err
    summary = json.loads(out)
    assert list(summary["platforms"]) == ["linux/arm64"]
    manifest = raw(registry_plain, f"kiln/spark:{summary['tag']}")
    assert manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    config = json.loads(skopeo(registry_plain, "inspect", "--config", "--raw", "--tls-verify=false",
                               f"docker://{registry_plain.host}/kiln/spark:{summary['tag']}"))
    assert config["architecture"] == "arm64"


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_an_index_missing_a_platforms_manifest_fails_in_one_line_with_nothing_pushed(
        capsys, work, start_registry, registry_plain, damage):
    broken = start_registry("plain", copy_from=registry_plain)
    arm = {m["platform"]["architecture"]: m["digest"] for m in raw(broken, BASE)["manifests"]}["arm64"]
    if damage == "missing":
        subprocess.run(["skopeo", "delete", "--tls-verify=false",
                        f"docker://{broken.host}/{BASE.split(':')[0]}@{arm}"], check=True, capture_output=True)
    else:  # its bytes in the registry's storage changed under its digest: still JSON, another manifest
        blob = broken.blob_file(arm)
        blob.write_bytes(blob.read_bytes().replace(b'"schemaVersion"', b'"schemaVersion" ', 1))
    code, _, err = build(capsys, work, broken, 90, "kiln/broken")
    line = one_line(code, err)
    assert arm in line or "linux/arm64" in line, line
    if damage == "corrupt":
        assert f"{arm}: manifest digest mismatch" in line, line
    tags = subprocess.run(["skopeo", "list-tags", "--tls-verify=false", f"docker://{broken.host}/kiln/broken"],
                          capture_output=True, text=True)
    assert tags.returncode != 0 or json.loads(tags.stdout)["Tags"] == []


# -- check: every platform of the index re-derived, the one that differs named -------------------

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _get(registry, repo: str, ref: str, accept: str = f"{OCI_MANIFEST}, {OCI_INDEX}") -> bytes:
    resp = requests.get(f"{registry.url}/v2/{repo}/manifests/{ref}", headers={"Accept": accept}, timeout=10)
    resp.raise_for_status()
    return resp.content


def _put(registry, repo: str, ref: str, data: bytes, media_type: str = OCI_MANIFEST) -> str:
    requests.put(f"{registry.url}/v2/{repo}/manifests/{ref}", data=data, timeout=10,
                 headers={"Content-Type": media_type}).raise_for_status()
    return _sha(data)


def _put_blob(registry, repo: str, data: bytes) -> str:
    resp = requests.post(f"{registry.url}/v2/{repo}/blobs/uploads/", timeout=10)
    location = resp.headers["Location"]
    location = location if location.startswith("http") else registry.url + location
    requests.put(f"{location}{'&' if '?' in location else '?'}digest={_sha(data)}", data=data, timeout=30,
                 headers={"Content-Type": "application/octet-stream"}).raise_for_status()
    return _sha(data)


def _reattach(registry, repo: str, old: str, new: bytes) -> None:
    """The attestations of ``old`` made again for the manifest ``new``, unsigned (no key)."""
    entries = []
    for entry in json.loads(_get(registry, repo, f"sha256-{old.split(':')[1]}", OCI_INDEX))["manifests"]:
        artifact = json.loads(_get(registry, repo, entry["digest"]))
        [layer] = artifact["layers"]
        document = requests.get(f"{registry.url}/v2/{repo}/blobs/{layer['digest']}", timeout=10).content
        if entry["artifactType"] == "application/vnd.dsse.envelope.v1+json":
            envelope = json.loads(document)
            statement = json.loads(base64.b64decode(envelope["payload"]))
            statement["subject"][0]["digest"]["sha256"] = _sha(new).split(":")[1]
            document = json.dumps({"payload": base64.b64encode(json.dumps(statement).encode()).decode(),
                                   "payloadType": envelope["payloadType"], "signatures": []}).encode()
        layer = {**layer, "digest": _put_blob(registry, repo, document), "size": len(document)}
        body = json.dumps({**artifact, "layers": [layer],
                           "subject": {"mediaType": OCI_MANIFEST, "digest": _sha(new), "size": len(new)}}).encode()
        entries.append({**entry, "digest": _put(registry, repo, _sha(body), body), "size": len(body)})
    index = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}).encode()
    _put(registry, repo, f"sha256-{_sha(new).split(':')[1]}", index, OCI_INDEX)


def check_cli(capsys, work, registry, ref: str):
    return run_kiln("--pins", work / "pins.toml", "--images", work / "images", "check", ref,
                    "--mirror", registry.mirror)


def test_check_re_derives_every_platform_and_names_the_one_that_differs(capsys, work, start_registry,
                                                                        registry_plain):
    code, out, err = build(capsys, work, registry_plain, 90, "kiln/checked")
    assert code == 0, err
    tag = json.loads(out)["tag"]
    code, out, err = check_cli(capsys, work, registry_plain, f"{registry_plain.host}/kiln/checked:{tag}")
    assert code == 0, err
    assert out.startswith("identical: ") and "linux/amd64, linux/arm64 sm_90" in out, out

    # in a copy of the registry, the arm64 manifest gets another annotation; its attestations are
    # made again for it (unsigned: the attacker has no key) and the tag names an index of it
    copied = start_registry("plain", copy_from=registry_plain)
    index = json.loads(_get(copied, "kiln/checked", tag))
    arm = next(m for m in index["manifests"] if m["platform"]["architecture"] == "arm64")
    body = json.loads(_get(copied, "kiln/checked", arm["digest"]))
    body["annotations"]["org.opencontainers.image.version"] += "-evil"
    tampered = json.dumps(body).encode()
    _put(copied, "kiln/checked", _sha(tampered), tampered)
    _reattach(copied, "kiln/checked", arm["digest"], tampered)
    arm.update(digest=_sha(tampered), size=len(tampered))
    _put(copied, "kiln/checked", tag, json.dumps(index).encode(), OCI_INDEX)
    code, out, err = check_cli(capsys, work, copied, f"{copied.host}/kiln/checked:{tag}")
    assert code == 1, (out, err)
    lines = err.strip().splitlines()
    assert all(line.startswith("warning: ") for line in lines[:-1]), err  # no --key: not verified
    assert lines[-1].startswith("refused: ") and f"linux/arm64 ({_sha(tampered)})" in lines[-1], err
    assert "linux/amd64" not in lines[-1] and "org.opencontainers.image.version" in lines[-1], err


def test_values_pin_the_index_digest_of_a_multi_platform_tag(capsys, work, registry_plain):
    tags = {}
    for sm, repo in ((90, "kiln/values"), (121, "kiln/values")):
        code, out, err = build(capsys, work, registry_plain, sm, repo)
        assert code == 0, err
        tags[sm] = json.loads(out)["tag"]
    for sm, tag in tags.items():
        code, out, err = build_cli(capsys, "--pins", work / "pins.toml", "--images", work / "images", "values",
                                   "--image", "e2e-triton", "--pin", "v0.20.1", "--sm", sm, "--mirror",
                                   registry_plain.mirror, "--repository", f"{registry_plain.host}/kiln/values")
        assert code == 0, err
        values = json.loads(out)
        # the digest skopeo reads for the tag: the index's for sm_90, the arm64 image's for sm_121
        expected = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false",
                                   f"docker://{registry_plain.host}/kiln/values:{tag}"],
                                  capture_output=True, check=True).stdout
        assert values["image"]["digest"] == _sha(expected) and values["image"]["tag"] == tag
        assert json.loads(expected)["mediaType"] == (OCI_INDEX if sm == 90 else OCI_MANIFEST)

    # an index under the sm_90 tag that lacks arm64: refused in one line naming it
    index = json.loads(_get(registry_plain, "kiln/values", tags[90]))
    index["manifests"] = [m for m in index["manifests"] if m["platform"]["architecture"] == "amd64"]
    _put(registry_plain, "kiln/values", tags[90], json.dumps(index).encode(), OCI_INDEX)
    code, out, err = build_cli(capsys, "--pins", work / "pins.toml", "--images", work / "images", "values",
                               "--image", "e2e-triton", "--pin", "v0.20.1", "--sm", 90, "--mirror",
                               registry_plain.mirror, "--repository", f"{registry_plain.host}/kiln/values")
    line = one_line(code, err)
    assert "the index lacks linux/arm64" in line and out == "", line


def test_rewriting_an_index_tag_in_a_layout_removes_its_platform_manifests_referrers(
        capsys, work, registry_plain, tmp_path, monkeypatch):
    """Two builds of one multi-platform tag into one OCI layout, the second as by another kiln
    commit: the first index's platform manifests' SBOMs and provenances leave index.json."""
    import kiln.image.prepare

    layout = tmp_path / "layout"

    def platform_digests(tag: str) -> set[str]:
        index = json.loads(skopeo(registry_plain, "inspect", "--raw", f"oci:{layout}:{tag}"))
        assert index["mediaType"] == OCI_INDEX
        return {m["digest"] for m in index["manifests"]}

    def subjects() -> list[str]:
        entries = json.loads((layout / "index.json").read_text())["manifests"]
        return [m["annotations"]["io.kiln.subject"] for m in entries if "artifactType" in m]

    code, out, err = build(capsys, work, registry_plain, 90, "kiln/layout", "--oci", layout, in_process=True)
    assert code == 0, err
    tag = json.loads(out)["tag"]
    first = platform_digests(tag)
    assert len(first) == 2 and sorted(subjects()) == sorted([*first, *first])  # an SBOM and a provenance each
    monkeypatch.setattr(kiln.image.prepare, "kiln_revision", lambda: ("0" * 40, False))
    code, out, err = build(capsys, work, registry_plain, 90, "kiln/layout", "--oci", layout, in_process=True)
    assert code == 0, err
    second = platform_digests(tag)
    assert second.isdisjoint(first)
    assert sorted(subjects()) == sorted([*second, *second])
    [warning] = [w for w in json.loads(out)["warnings"] if "replaced" in w]
    assert "removed its 4 referrer(s) from index.json" in warning, warning
