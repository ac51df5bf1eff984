"""The registry build cache across a pin's matrix (issue #35 item 8): SMs and platforms share one
patched entry, each platform's kernels are keyed for its own Triton.

Against real docker-registry processes holding the two-platform base ``v0.20.1-multi36``
(linux/amd64 with Triton 3.6.0's x86_64 dist-info, linux/arm64 with the real aarch64 one: the
walk reads other layers on each). Each build runs on an empty kiln cache (a fresh runner); what
it pulled, patched and compiled is counted where kiln does it, and what the ``--json`` line says
is checked against the cache registry's own tags.
"""

from __future__ import annotations

import json
import shutil

import pytest
import requests

import kiln.image.prepare as prepare_module
from kiln import commands
from kiln.image.cachekeys import CATALOGUE, KERNELS, PATCHED, entry_tag
from kiln.source.image import ImageSource
from tests.support import TEST_IMAGES
from tests.support.registry import VLLM_VERSION

pytestmark = [pytest.mark.registry, pytest.mark.reliability]

BASE = f"vllm/vllm-openai:v{VLLM_VERSION}-multi36"


@pytest.fixture
def files(tmp_path, registry_plain):
    images = tmp_path / "images"
    shutil.copytree(TEST_IMAGES, images)
    definition = images / "e2e-triton.toml"
    definition.write_text(definition.read_text().replace("sms = [86, 120]", "sms = [86, 90, 121]"))
    pins = tmp_path / "pins.toml"
    pins.write_text(f'[pins."v0.20.1"]\nrole = "current"\nimage = "docker.io/{BASE}"\nvllm = "{VLLM_VERSION}"\n'
                    f'cuda = "cu130"\ndigest = "{registry_plain.digest_of(BASE)}"\n')
    return pins, images


@pytest.fixture
def work(monkeypatch) -> dict[str, list]:
    """What each build did: the (platform, SM) it compiled, the patch runs, the platforms it pulled."""
    done: dict[str, list] = {"compiled": [], "patched": [], "pulled": []}
    compile_layer, patch, pull = prepare_module.triton_cache_layer, prepare_module.patched_selection, ImageSource.pull

    def compiled(preset, sm, *args, **kwargs):
        done["compiled"].append((args[-1], sm))  # its last argument: the platform whose Triton compiles
        return compile_layer(preset, sm, *args, **kwargs)

    def patched(*args, **kwargs):
        done["patched"].append(1)
        return patch(*args, **kwargs)

    def pulled(self, *args, **kwargs):
        done["pulled"].append(self.platform)
        return pull(self, *args, **kwargs)

    monkeypatch.setattr(prepare_module, "triton_cache_layer", compiled)
    monkeypatch.setattr(prepare_module, "patched_selection", patched)
    monkeypatch.setattr(ImageSource, "pull", pulled)
    return done


def test_a_pins_matrix_patches_once_and_keys_each_platforms_kernels_apart(
        capsys, monkeypatch, tmp_path, registry_plain, start_registry, files, work):
    pins, images = files
    cache = start_registry("plain")
    where = (f"{cache.host}/kiln-cache", "--insecure-registry", cache.host)

    def build(runner: str, sm: int, *extra: str) -> dict:
        monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / runner))
        for key in work:
            work[key].clear()
        capsys.readouterr()
        code = commands.main(["--pins", str(pins), "--images", str(images), "build", "--image", "e2e-triton",
                              "--pin", "v0.20.1", "--sm", str(sm), "--mirror", registry_plain.mirror, "--json",
                              *extra])
        out = capsys.readouterr()
        assert code == 0, out.err
        return json.loads(out.out)

    def tags() -> set[str]:
        return set(requests.get(f"{cache.url}/v2/kiln-cache/tags/list", timeout=10).json()["tags"])

    # 1. sm_86 ships on linux/amd64 alone: it patches and compiles, and writes its patched entry
    # under both its keys (the layers it was probed by; the pristine source), one layer blob
    first = build("one", 86, "--cache-to", *where)
    assert list(first["platforms"]) == ["linux/amd64"]
    assert work == {"compiled": [("linux/amd64", 86)], "patched": [1], "pulled": ["linux/amd64"]}
    [patched] = [e for e in first["cache"]["entries"] if e["kind"] == PATCHED]
    assert patched["source_key"] != patched["key"] and patched["hit"] is None
    assert {entry_tag(PATCHED, patched["key"]), entry_tag(PATCHED, patched["source_key"])} <= tags()

    # 2. sm_90, both platforms, another runner: amd64's patched entry is sm_86's (a hit on the
    # layers' key: nothing patched); arm64's layers are others, so its probe misses, it pulls, and
    # its patched entry is the same one by source: no patch run at all. Each platform compiles
    # its own kernels, keyed apart.
    second = build("two", 90, "--cache-from", *where, "--cache-to", *where)
    assert list(second["platforms"]) == ["linux/amd64", "linux/arm64"]
    assert work["patched"] == [], "a platform of the second SM patched"
    assert sorted(work["compiled"]) == [("linux/amd64", 90), ("linux/arm64", 90)]
    entries = second["cache"]["entries"]
    amd_patched, arm_patched = [e for e in entries if e["kind"] == PATCHED]
    assert amd_patched["key"] == patched["key"] and amd_patched["hit"].endswith(entry_tag(PATCHED, patched["key"]))
    assert arm_patched["key"] != patched["key"]  # its walk read the aarch64 Triton layer
    assert arm_patched["source_key"] == patched["source_key"]
    assert arm_patched["hit"] == f"{cache.host}/kiln-cache:{entry_tag(PATCHED, patched['source_key'])}"
    amd_kernels, arm_kernels = [e for e in entries if e["kind"] == KERNELS]
    assert (amd_kernels["sm"], arm_kernels["sm"]) == (90, 90) and amd_kernels["key"] != arm_kernels["key"]
    assert {entry_tag(KERNELS, amd_kernels["key"]), entry_tag(KERNELS, arm_kernels["key"])} <= tags()
    layers = {p: part["layer_digest"] for p, part in second["platforms"].items()}
    assert layers["linux/amd64"] == layers["linux/arm64"]  # one patched-source layer on both
    assert len({e["key"] for e in entries if e["kind"] == CATALOGUE}) == 1

    # 3. sm_121 ships on linux/arm64 alone: the patched entry sm_90's arm64 half wrote under its
    # layers' key is found by the probe (nothing pulled before it); only its kernels compile
    spark = build("four", 121, "--cache-from", *where)
    assert list(spark["platforms"]) == ["linux/arm64"]
    [spark_patched] = [e for e in spark["cache"]["entries"] if e["kind"] == PATCHED]
    assert spark_patched["key"] == arm_patched["key"], spark["warnings"]
    assert spark_patched["hit"] == f"{cache.host}/kiln-cache:{entry_tag(PATCHED, arm_patched['key'])}"
    assert work["patched"] == [] and work["compiled"] == [("linux/arm64", 121)]

    # 4. the sm_90 tag on another runner: every entry hits, nothing is pulled, patched or compiled,
    # and the index is the one built from nothing
    third = build("three", 90, "--cache-from", *where)
    assert work == {"compiled": [], "patched": [], "pulled": []}
    assert third["manifest_digest"] == second["manifest_digest"]
    assert [e["hit"] is not None for e in third["cache"]["entries"] if e["kind"] != CATALOGUE] == [True] * 4


def test_a_tags_platforms_share_one_patch_run_without_any_registry_cache(
        capsys, monkeypatch, tmp_path, registry_plain, files, work):
    """No ``--cache-from``: the arm64 half reads its own layers, finds the source the amd64 half
    patched, and reuses that run (the ``--json`` line says whose)."""
    pins, images = files
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cold"))
    capsys.readouterr()
    code = commands.main(["--pins", str(pins), "--images", str(images), "build", "--image", "e2e-triton",
                          "--pin", "v0.20.1", "--sm", "90", "--mirror", registry_plain.mirror, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    result = json.loads(out.out)
    assert work["patched"] == [1] and work["pulled"] == ["linux/amd64", "linux/arm64"]
    amd, arm = [e for e in result["cache"]["entries"] if e["kind"] == PATCHED]
    assert "shared" not in amd and arm["shared"] == "linux/amd64" and arm["source_key"] == amd["source_key"]
