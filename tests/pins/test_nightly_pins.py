"""Nightly pins: a vLLM build with no release wheel, read from its own image.

The nightly is the fixture base plus a layer that replaces vLLM's dist-info by a dev build's
(``NIGHTLY_VERSION``, a version no PyPI wheel carries) and rewrites ``vllm/_version.py``, pushed
to a real docker-registry standing in for Docker Hub as ``vllm/vllm-openai:nightly-<sha>``
(``tests/support/registry.py``). ``pin bump --to IMAGE`` names it ``dev424``; ``verify``,
``diff``, ``apply``, ``verify --image`` and ``build`` then read the pristine source from the
image (the rewritten ``_version.py`` shows it is the image's, not a wheel's).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from packaging.version import Version

from kiln.oci.endpoints import RegistryConfig
from kiln.paths import RepoFiles
from kiln.pins import Pin
from kiln.source.image import ImageSource
from kiln.source.wheel import WheelSource
from kiln.verify import BuiltSource, choose_source, provider_for_pin
from tests.support.kiln_process import run_kiln
from tests.support.registry import (
    NIGHTLY_MARK,
    NIGHTLY_TAG,
    NIGHTLY_VERSION,
    REPO,
    VLLM_VERSION,
    free_port,
)

pytestmark = pytest.mark.registry

NIGHTLY = f"docker.io/{REPO}:{NIGHTLY_TAG}"
RELEASE = f"docker.io/{REPO}:v{VLLM_VERSION}"

IMAGE = """\
name = "nightly-p65"
pins = ["dev424"]
sms = [120]
tag = "{cuda}-sm{sm}-{pin}"
patches = ["P4", "P5", "P65"]

[model]
id = "Lorbus/Qwen3.6-27B-int4-AutoRound"
architectures = ["Qwen3_5ForConditionalGeneration"]
dtype = "float16"
kv_cache_dtype = "turboquant_k8v4"
spec_method = "mtp"
num_speculative_tokens = 3
"""


def kiln(capsys, files: Path, *argv) -> tuple[int, str, str]:
    # bumps, verifies and builds from a registry: a process of its own (tests/support/kiln_process.py)
    return run_kiln("--pins", files / "pins.toml", "--record", files / "verdicts.toml", "--images", files / "images",
                    *argv)


def pins_text(digest: str) -> str:
    return (f'[pins."dev424"]\nrole = "current"\nimage = "{NIGHTLY}"\nvllm = "{NIGHTLY_VERSION}"\n'
            f'cuda = "cu130"\ndigest = "{digest}"\n')


@pytest.fixture
def files(tmp_path) -> Path:
    (tmp_path / "images").mkdir()
    return tmp_path


@pytest.fixture
def nightly_pin(files, registry_plain) -> Path:
    """A pins file whose current pin is the nightly, locked; no verdicts recorded for it."""
    (files / "pins.toml").write_text(pins_text(registry_plain.digest_of(f"{REPO}:{NIGHTLY_TAG}")))
    (files / "verdicts.toml").write_text("# the record\n")
    (files / "images" / "nightly-p65.toml").write_text(IMAGE)
    return files


def test_the_source_of_a_pin_is_its_wheel_or_else_its_image():
    release = Pin("v0.20.1", "current", RELEASE, Version("0.20.1"), "cu130", "")
    assert isinstance(provider_for_pin(release), WheelSource)
    digest = "sha256:" + "ab" * 32
    config = RegistryConfig.load(["docker.io=http://127.0.0.1:1"])
    for version in (NIGHTLY_VERSION, "0.34.0rc1", "0.34.0.dev3"):
        nightly = Pin("n", "current", NIGHTLY, Version(version), "cu130", digest)
        provider = provider_for_pin(nightly, config)
        # locked: what a build already read of that digest first (kiln's cache), else the image
        assert isinstance(provider, BuiltSource) and provider.pin is nightly
        provider = provider.fallback
        assert isinstance(provider, ImageSource)
        assert provider.reference.digest == digest  # locked: read by digest
        assert provider.expected_version == Version(version)
        assert provider.registry_config is config  # mirrors reach the pull


def test_bump_to_a_nightly_image_names_it_by_its_dev_number(capsys, files, registry_plain):
    (files / "pins.toml").write_text(f'[pins."v0.20.1"]\nrole = "current"\nimage = "{RELEASE}"\n'
                                     f'vllm = "{VLLM_VERSION}"\ncuda = "cu130"\ndigest = ""\n')
    (files / "verdicts.toml").write_text("# the record\n")
    code, out, err = kiln(capsys, files, "pin", "bump", "--to", NIGHTLY, "--mirror", registry_plain.mirror,
                          "--write", "--json")
    assert code == 0, err
    report = json.loads(out)
    digest = registry_plain.digest_of(f"{REPO}:{NIGHTLY_TAG}")
    assert report["to"]["name"] == "dev424" and report["to"]["vllm"] == NIGHTLY_VERSION
    assert report["to"]["digest"] == digest
    assert report["to"]["source"].startswith(f"image {NIGHTLY}@{digest} (3 of 6 layers read)")
    # 0.20.1's files under a dev version below 0.21: every verdict is the release's
    old = {row["patch"]: row["old"] for row in report["patches"]}
    assert {row["patch"]: row["new"] for row in report["patches"]} == old and old["P65"] == "APPLIES"
    pins = tomllib.loads((files / "pins.toml").read_text())["pins"]
    assert pins["dev424"] == {"role": "current", "image": NIGHTLY, "vllm": NIGHTLY_VERSION, "cuda": "cu130",
                              "digest": digest}
    assert pins["v0.20.1"]["role"] == "rollback"
    assert tomllib.loads((files / "verdicts.toml").read_text())["dev424"] == old


def test_verify_diff_apply_read_a_nightly_pin_from_its_image(capsys, nightly_pin, registry_plain, tmp_path):
    mirror = ("--mirror", registry_plain.mirror)
    choice = choose_source(RepoFiles(nightly_pin / "pins.toml", Path("patchsets"), nightly_pin / "verdicts.toml",
                                     nightly_pin / "images"), pin="dev424",
                           registry_config=RegistryConfig.load([registry_plain.mirror]))
    tree = choice.provider.fetch()
    assert tree.vllm_version == Version(NIGHTLY_VERSION)
    assert tree.read("_version.py").startswith(NIGHTLY_MARK)  # the image's own file, in no wheel

    code, out, err = kiln(capsys, nightly_pin, "verify", "--pin", "dev424", *mirror, "--json")
    assert code == 1  # nothing recorded yet: every verdict is a difference
    assert {d["expected"] for d in json.loads(out)["differences"]} == {""}
    code, out, err = kiln(capsys, nightly_pin, "verify", "--pin", "dev424", *mirror, "--accept", "--json")
    assert code == 0, err
    code, out, err = kiln(capsys, nightly_pin, "verify", "--pin", "dev424", *mirror, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["origin"].startswith(f"image {NIGHTLY}@sha256:")
    assert report["vllm_version"] == NIGHTLY_VERSION and report["differences"] == []

    code, out, err = kiln(capsys, nightly_pin, "diff", "--pin", "dev424", "--patch", "P65", *mirror)
    assert code == 0, err
    assert "+++ b/vllm/v1/attention/backends/turboquant_attn.py" in out and "# kiln P65:" in out

    code, out, err = kiln(capsys, nightly_pin, "apply", "--pin", "dev424", "--patch", "P65", *mirror,
                          "--out", tmp_path / "applied", "--json")
    assert code == 0, err
    assert json.loads(out)["source"] == "dev424"
    assert (tmp_path / "applied" / "vllm" / "_version.py").read_text().startswith(NIGHTLY_MARK)

    code, out, err = kiln(capsys, nightly_pin, "verify", "--image", "nightly-p65", *mirror, "--json")
    assert code == 0, err
    rows = {row["patch"]: row["verdict"] for row in json.loads(out)["patches"]}
    assert rows == {"P4": "APPLIES", "P5": "APPLIES", "P65": "APPLIES"}

    # the layers are cached by digest: the locked pin is answered with the registry gone
    dead = f"docker.io=http://127.0.0.1:{free_port()}"
    code, out, err = kiln(capsys, nightly_pin, "verify", "--pin", "dev424", "--mirror", dead, "--json")
    assert code == 0, err


def test_build_on_a_pin_with_no_recorded_verdicts_says_so(capsys, nightly_pin, registry_plain, tmp_path):
    code, out, err = kiln(capsys, nightly_pin, "build", "--image", "nightly-p65", "--pin", "dev424", "--sm", "120",
                          "--mirror", registry_plain.mirror, "--oci", tmp_path / "oci", "--json")
    assert code == 0, err
    result = json.loads(out)
    [warning] = [w for w in result["warnings"] if "recorded verdicts" in w]
    assert warning.startswith("pin dev424 has no recorded verdicts in ") and "opt/kiln/manifest.json" in warning
    assert warning in err and err.count("no recorded verdicts") == 1  # one line
    assert {p["patch"]: p["verdict"] for p in result["patches"]} == {"P4": "APPLIES", "P5": "APPLIES",
                                                                     "P65": "APPLIES"}
    assert result["tag"] == "cu130-sm120-dev424" and result["base"] == NIGHTLY
