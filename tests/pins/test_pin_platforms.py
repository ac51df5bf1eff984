"""Pins record each platform of their base; a build reads its platform's manifest from the lock.

Against a real docker-registry holding a real two-platform index (``v0.20.1-multi``: linux/amd64
and linux/arm64, both made by umoci, pushed by ``skopeo copy --all``) and a single-manifest
amd64 base (``v0.20.1``). What each platform's manifest digest is comes from skopeo's view of the
index (``skopeo inspect --raw``), not from kiln.
"""

from __future__ import annotations

import json
import subprocess
import tomllib

import pytest

from kiln import commands
from tests.support import TEST_IMAGES
from tests.support.registry import VLLM_VERSION

pytestmark = pytest.mark.registry

BASE = f"vllm/vllm-openai:v{VLLM_VERSION}"
PIN = """\
[pins."v0.20.1"]
role = "current"
image = "docker.io/{image}"
vllm = "{vllm}"
cuda = "cu130"
digest = "{digest}"
"""
# e2e-p65 with the SMs of both platforms: 90 (amd64 + arm64), 121 (arm64 only)
IMAGE = (TEST_IMAGES / "e2e-p65.toml").read_text().replace("sms = [86, 120]", "sms = [86, 90, 121]")


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = commands.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def skopeo_platforms(registry, name: str) -> dict[str, str]:
    raw = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{registry.host}/{name}"],
                         capture_output=True, check=True).stdout
    return {f"{m['platform']['os']}/{m['platform']['architecture']}": m["digest"]
            for m in json.loads(raw)["manifests"]}


@pytest.fixture
def work(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    (images / "e2e-p65.toml").write_text(IMAGE)
    return tmp_path


def lock(capsys, pins, registry) -> dict:
    code, out, err = run_cli(capsys, "--pins", pins, "pin", "lock", "--mirror", registry.mirror, "--json")
    assert code == 0, err
    return json.loads(out)["pins"][0]


def build(capsys, work, registry, *extra) -> tuple[int, str, str]:
    return run_cli(capsys, "--pins", work / "pins.toml", "--images", work / "images", "build", "--image", "e2e-p65",
                   "--pin", "v0.20.1", "--mirror", registry.mirror, *extra)


def one_line(code: int, err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_lock_records_the_index_and_each_platform_and_a_build_takes_its_platforms_manifest(
        capsys, work, registry_plain):
    pins = work / "pins.toml"
    pins.write_text(PIN.format(image=f"{BASE}-multi", vllm=VLLM_VERSION, digest=""))
    entries = skopeo_platforms(registry_plain, f"{BASE}-multi")
    assert set(entries) == {"linux/amd64", "linux/arm64"} and len(set(entries.values())) == 2
    result = lock(capsys, pins, registry_plain)
    index = registry_plain.digest_of(f"{BASE}-multi")
    assert (result["status"], result["digest"], result["platforms"]) == ("locked", index, entries)
    assert tomllib.loads(pins.read_text())["pins"]["v0.20.1"]["platforms"] == entries
    # listed, and schema-checked when loaded: a platform key that is not os/arch is refused
    code, out, err = run_cli(capsys, "--pins", pins, "pin", "list", "--json")
    assert code == 0 and json.loads(out)["pins"][0]["platforms"] == entries, err

    # sm_90 ships on both: by default on linux/amd64, on linux/arm64 when asked; each build is on
    # its own platform's manifest of the locked index
    for extra, platform in (((), "linux/amd64"), (("--platform", "linux/arm64"), "linux/arm64")):
        code, out, err = build(capsys, work, registry_plain, "--sm", "90", *extra, "--json")
        assert code == 0, err
        summary = json.loads(out)
        assert (summary["base_digest"], summary["base_manifest_digest"]) == (index, entries[platform])


def test_a_platform_the_base_lacks_fails_in_one_line_before_any_layer(capsys, work, registry_plain, base_layout):
    pins = work / "pins.toml"
    pins.write_text(PIN.format(image=BASE, vllm=VLLM_VERSION, digest=""))
    lock(capsys, pins, registry_plain)
    cache = work / "kiln-cache"  # the isolating fixture's KILN_CACHE_DIR
    code, _, err = build(capsys, work, registry_plain, "--sm", "90", "--platform", "linux/arm64", "--json")
    line = one_line(code, err)
    assert "has no linux/arm64 image; it has linux/amd64" in line, line
    read = {f"sha256:{p.name}" for p in (cache / "blobs" / "sha256").glob("*")}
    assert not read & set(base_layout.layers.values()), "a layer was read"
    # sm_121 ships on linux/arm64 only: its default platform, which this amd64 base lacks
    code, _, err = build(capsys, work, registry_plain, "--sm", "121", "--json")
    assert "has no linux/arm64 image; it has linux/amd64" in one_line(code, err)
    # and asked for amd64, it is refused before any request: the pair does not exist
    code, _, err = build(capsys, work, registry_plain, "--sm", "121", "--platform", "linux/amd64", "--json")
    assert "--platform: linux/amd64: the image ships sm_121 on linux/arm64 only" in one_line(code, err)


def test_an_sm_the_bases_triton_cannot_compile_for_fails_in_one_line(capsys, work, registry_plain):
    """The fixture's Triton is 3.5.0, whose ptxas (CUDA 12.8) has no sm_121a: sm_121 on the
    index's arm64 half fails naming both versions, before any patching or compiling."""
    pins = work / "pins.toml"
    pins.write_text(PIN.format(image=f"{BASE}-multi", vllm=VLLM_VERSION, digest=""))
    lock(capsys, pins, registry_plain)
    code, _, err = build(capsys, work, registry_plain, "--sm", "121", "--json")
    line = one_line(code, err)
    assert "sm_121 needs Triton 3.6.0 or newer" in line and "carries Triton 3.5.0" in line, line


def test_a_pin_locked_before_platforms_builds_and_lock_completes_it(capsys, work, registry_plain):
    """A pin with a digest alone (written before pins recorded platforms) loads and builds (its
    platform's manifest taken from the index its digest names); `pin lock` adds its platforms,
    status "completed", the digest as it was."""
    pins = work / "pins.toml"
    index = registry_plain.digest_of(f"{BASE}-multi")
    pins.write_text(PIN.format(image=f"{BASE}-multi", vllm=VLLM_VERSION, digest=index))
    entries = skopeo_platforms(registry_plain, f"{BASE}-multi")
    code, out, err = build(capsys, work, registry_plain, "--sm", "90", "--platform", "linux/arm64", "--json")
    assert code == 0, err
    assert json.loads(out)["base_manifest_digest"] == entries["linux/arm64"]
    result = lock(capsys, pins, registry_plain)
    assert (result["status"], result["digest"], result["previous"], result["platforms"]) == (
        "completed", index, index, entries)
    assert lock(capsys, pins, registry_plain)["status"] == "unchanged"


def test_recorded_platforms_are_checked_against_the_index(capsys, work, registry_plain):
    """A lock whose platforms disagree with the index its digest names (edited by hand) is refused
    in one line naming both digests; platforms without a digest are refused when loaded."""
    pins = work / "pins.toml"
    pins.write_text(PIN.format(image=f"{BASE}-multi", vllm=VLLM_VERSION, digest=""))
    lock(capsys, pins, registry_plain)
    entries = skopeo_platforms(registry_plain, f"{BASE}-multi")
    pins.write_text(pins.read_text().replace(entries["linux/arm64"], "sha256:" + "0" * 64))
    code, _, err = build(capsys, work, registry_plain, "--sm", "90", "--platform", "linux/arm64", "--json")
    line = one_line(code, err)
    assert entries["linux/arm64"] in line and "sha256:" + "0" * 64 in line and "re-lock" in line, line
    pins.write_text(PIN.format(image=f"{BASE}-multi", vllm=VLLM_VERSION, digest="")
                    + 'platforms = {"linux/amd64" = "sha256:' + "1" * 64 + '"}\n')
    code, _, err = run_cli(capsys, "--pins", pins, "pin", "list")
    assert 'pins.v0.20.1.platforms: recorded without a digest' in one_line(code, err)
    pins.write_text(PIN.format(image=f"{BASE}-multi", vllm=VLLM_VERSION, digest="")
                    + 'platforms = {"arm64" = "sha256:' + "1" * 64 + '"}\n')
    code, _, err = run_cli(capsys, "--pins", pins, "pin", "list")
    assert "platforms" in one_line(code, err) and "'arm64' is not a platform like 'linux/arm64'" in err
