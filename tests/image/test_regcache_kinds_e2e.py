"""The registry build cache's two kinds of entry (``kiln.image.regcache``) with real registries.

The base is the fixture image with Triton 3.6.0 (``v0.20.1-triton36``), the image definition
one with a kernel preset. A second image on the same base and selection, with other SMs,
reuses the first image's patched entry and the kernel entry of the SM they share, and compiles
only the SM it does not share; a poisoned kernel entry alone costs that SM's compile, not the
patching. Every build gives the digest the same build gives without any registry cache.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import requests

import kiln.image.prepare as prepare_module
from kiln import commands
from kiln.image.cachekeys import CATALOGUE, KERNELS, PATCHED, entry_tag, patched_key, vllm_layers
from kiln.image.inputs import load_build_inputs
from kiln.oci.manifest import Descriptor
from kiln.paths import RepoFiles
from kiln.source.image import ImageSource
from tests.support import TEST_IMAGES
from tests.support.registry import VLLM_VERSION

pytestmark = [pytest.mark.registry, pytest.mark.reliability]

MANIFEST = "application/vnd.oci.image.manifest.v1+json"


@pytest.fixture
def images(tmp_path) -> Path:
    """The test definitions, and ``e2e-triton-b``: another image on e2e-triton's base and selection."""
    images = tmp_path / "images"
    shutil.copytree(TEST_IMAGES, images)
    text = (images / "e2e-triton.toml").read_text()
    (images / "e2e-triton-b.toml").write_text(
        text.replace('name = "e2e-triton"', 'name = "e2e-triton-b"').replace("kiln/e2e-triton", "kiln/e2e-triton-b"))
    return images


@pytest.fixture
def pins(tmp_path, registry_plain) -> Path:
    name = f"vllm/vllm-openai:v{VLLM_VERSION}-triton36"
    path = tmp_path / "pins.toml"
    path.write_text('[pins."v0.20.1"]\nrole = "current"\n'
                    f'image = "docker.io/{name}"\nvllm = "{VLLM_VERSION}"\ncuda = "cu130"\n'
                    f'digest = "{registry_plain.digest_of(name)}"\n')
    return path


@pytest.fixture
def work(monkeypatch) -> dict[str, list]:
    """What each build did: the SMs it compiled, the patch selections it ran, the base pulls."""
    done: dict[str, list] = {"compiled": [], "patched": [], "pulled": []}
    compile_layer, patch, pull = prepare_module.triton_cache_layer, prepare_module.patched_selection, ImageSource.pull

    def compiled(preset, sm, *args, **kwargs):
        done["compiled"].append(sm)
        return compile_layer(preset, sm, *args, **kwargs)

    def patched(*args, **kwargs):
        done["patched"].append(1)
        return patch(*args, **kwargs)

    def pulled(self, *args, **kwargs):
        done["pulled"].append(1)
        return pull(self, *args, **kwargs)

    monkeypatch.setattr(prepare_module, "triton_cache_layer", compiled)
    monkeypatch.setattr(prepare_module, "patched_selection", patched)
    monkeypatch.setattr(ImageSource, "pull", pulled)
    return done


def _build(capsys, monkeypatch, tmp_path, runner: str, registry, pins: Path, images: Path, image: str, sm: int,
           *extra: str) -> dict:
    """One build on an empty kiln cache (a fresh runner); its ``--json``."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / runner))
    capsys.readouterr()
    code = commands.main(["--pins", str(pins), "--images", str(images), "build", "--image", image,
                          "--pin", "v0.20.1", "--sm", str(sm), "--mirror", registry.mirror, "--json", *extra])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def _entries(result: dict) -> dict[str, dict]:
    return {e["kind"]: e for e in result["cache"]["entries"]}


def test_a_second_image_reuses_what_it_shares_and_compiles_only_its_other_sm(
        capsys, monkeypatch, tmp_path, registry_plain, start_registry, pins, images, work):
    cache = start_registry("plain")
    where = (f"{cache.host}/kiln-cache", "--insecure-registry", cache.host)

    def build(runner: str, image: str, sm: int, *extra: str) -> dict:
        return _build(capsys, monkeypatch, tmp_path, runner, registry_plain, pins, images, image, sm, *extra)

    # image A, sm 86, writes its two entries
    a86 = build("a86", "e2e-triton", 86, "--cache-to", *where)
    assert work == {"compiled": [86], "patched": [1], "pulled": [1]}
    assert [(e["kind"], e.get("sm"), e["hit"]) for e in a86["cache"]["entries"]] == [
        (PATCHED, None, None), (KERNELS, 86, None), (CATALOGUE, None, None)]
    assert len(a86["cache"]["written"]) == 4  # patched (under its layers' key and its source's), kernels, catalogue

    # image B, sm 86: both entries are A's: nothing pulled, patched or compiled
    log_mark = len(cache.log())
    b86 = build("b86", "e2e-triton-b", 86, "--cache-from", *where)
    assert work == {"compiled": [86], "patched": [1], "pulled": [1]}, "the hit pulled, patched or compiled"
    assert _entries(b86)[PATCHED]["key"] == _entries(a86)[PATCHED]["key"]
    assert _entries(b86)[KERNELS]["key"] == _entries(a86)[KERNELS]["key"]
    # (the catalogue's entry, unsigned, is read and checked against the loaded catalogue: not a hit)
    assert [e["kind"] for e in b86["cache"]["entries"] if e["hit"]] == [PATCHED, KERNELS]
    [unsigned] = [w for w in b86["warnings"] if "using unsigned" in w]
    assert unsigned.startswith(f"build cache: using unsigned patched and kernels entries from {where[0]}:"), unsigned
    log = cache.log()[log_mark:]
    for kind, entry in _entries(a86).items():  # kiln's report agrees with what the cache served
        assert f"GET /v2/kiln-cache/manifests/{entry_tag(kind, entry['key'])}" in log, kind
    assert b86["triton"]["kernel_names"] == a86["triton"]["kernel_names"]

    # image B, sm 120: the patched entry is A's, the kernels of sm 120 are compiled, nothing patched
    b120 = build("b120", "e2e-triton-b", 120, "--cache-from", *where, "--cache-to", *where)
    assert work == {"compiled": [86, 120], "patched": [1], "pulled": [1, 1]}
    assert _entries(b120)[PATCHED]["hit"] and _entries(b120)[KERNELS]["hit"] is None
    assert _entries(b120)[PATCHED]["key"] == _entries(a86)[PATCHED]["key"]
    assert b120["patches"] == a86["patches"]

    # each is the image B builds without any registry cache
    assert build("ref86", "e2e-triton-b", 86)["manifest_digest"] == b86["manifest_digest"]
    assert build("ref120", "e2e-triton-b", 120)["manifest_digest"] == b120["manifest_digest"]
    assert work["compiled"] == [86, 120, 86, 120] and len(work["patched"]) == 3
    assert b86["manifest_digest"] != a86["manifest_digest"]  # another image (its name is in the layers)


def test_a_poisoned_kernel_entry_costs_only_that_sms_compile(
        capsys, monkeypatch, tmp_path, registry_plain, start_registry, pins, images, work):
    cache = start_registry("plain")  # a registry of its own: corrupting its blobs touches no image
    where = (f"{cache.host}/kiln-cache", "--insecure-registry", cache.host)

    def build(runner: str, *extra: str) -> dict:
        return _build(capsys, monkeypatch, tmp_path, runner, registry_plain, pins, images, "e2e-triton", 86, *extra)

    first = build("writer", "--cache-to", *where)
    kernels = _entries(first)[KERNELS]
    entry = requests.get(f"{cache.url}/v2/kiln-cache/manifests/{kernels['tag']}", headers={"Accept": MANIFEST},
                         timeout=10).json()
    stored = cache.blob_file(entry["layers"][0]["digest"])
    good = stored.read_bytes()
    stored.write_bytes(good[:-64] + bytes(64))  # same length: only the digest can tell
    again = build("reader", "--cache-from", *where)
    assert work["compiled"] == [86, 86] and work["patched"] == [1], "not only the kernels were built again"
    assert _entries(again)[PATCHED]["hit"] and _entries(again)[KERNELS]["hit"] is None
    assert any("build cache entry" in w and kernels["tag"] in w and "digest mismatch" in w
               for w in again["warnings"]), again["warnings"]
    assert again["manifest_digest"] == first["manifest_digest"]


def test_a_patched_entry_keyed_for_fewer_layers_than_the_walk_reads_is_refused(
        capsys, monkeypatch, tmp_path, registry_plain, start_registry, pins, images, work):
    """A coherent entry (its record's key and inputs those of its tag) that says the walk stops
    one layer higher than it does: the probe finds it first (the shallowest), and when the build
    walks anyway (its SM's kernels missed), the layers read are not the ones it was keyed by: a
    miss with a warning, the patching runs, and the image is the one built without cache."""
    cache = start_registry("plain")
    where = (f"{cache.host}/kiln-cache", "--insecure-registry", cache.host)

    def build(runner: str, sm: int, *extra: str) -> dict:
        return _build(capsys, monkeypatch, tmp_path, runner, registry_plain, pins, images, "e2e-triton", sm, *extra)

    first = build("writer", 86, "--cache-to", *where)
    key = _entries(first)[PATCHED]["key"]
    entry = requests.get(f"{cache.url}/v2/kiln-cache/manifests/{entry_tag(PATCHED, key)}",
                         headers={"Accept": MANIFEST}, timeout=10).json()
    record = json.loads(requests.get(f"{cache.url}/v2/kiln-cache/blobs/{entry['config']['digest']}", timeout=10).content)
    read = len(record["inputs"]["vllm_layers"]["layers"])
    assert read == 3 and not record["inputs"]["vllm_layers"]["to_bottom"]  # triton36, app, vllm
    # the same entry under the key of the top two layers only
    name = f"vllm/vllm-openai:v{VLLM_VERSION}-triton36"
    manifest = requests.get(f"{registry_plain.url}/v2/{name.replace(':', '/manifests/')}",
                            headers={"Accept": MANIFEST}, timeout=10).json()
    layers = [Descriptor.from_json(d, "layer") for d in manifest["layers"]]
    inputs = load_build_inputs(RepoFiles(pins=pins, images=images), "e2e-triton", "v0.20.1", 120)
    short_key, short_inputs = patched_key(inputs, vllm_layers(layers, read - 1), True)
    lying = json.dumps({**record, "key": short_key, "inputs": short_inputs}).encode()
    digest = "sha256:" + hashlib.sha256(lying).hexdigest()
    start = requests.post(f"{cache.url}/v2/kiln-cache/blobs/uploads/", timeout=10)
    location = start.headers["Location"]
    location = location if location.startswith("http") else cache.url + location
    assert requests.put(f"{location}{'&' if '?' in location else '?'}digest={digest}", data=lying,
                        headers={"Content-Type": "application/octet-stream"}, timeout=10).status_code == 201
    resp = requests.put(f"{cache.url}/v2/kiln-cache/manifests/{entry_tag(PATCHED, short_key)}",
                        data=json.dumps({**entry, "config": {**entry["config"], "digest": digest,
                                                             "size": len(lying)}}).encode(),
                        headers={"Content-Type": MANIFEST}, timeout=10)
    assert resp.status_code == 201, resp.text

    again = build("reader", 120, "--cache-from", *where)
    assert any(f"{entry_tag(PATCHED, short_key)} refused" in w and "the walk stops after the top 2 layers; it read 3"
               in w for w in again["warnings"]), again["warnings"]
    # refused, then found by its source once the walk read it: the writer's entry, as written
    source_tag = entry_tag(PATCHED, _entries(first)[PATCHED]["source_key"])
    assert _entries(again)[PATCHED]["hit"] == f"{cache.host}/kiln-cache:{source_tag}"
    assert _entries(again)[PATCHED]["key"] == key
    assert work["patched"] == [1] and work["compiled"] == [86, 120]
    assert build("reference", 120)["manifest_digest"] == again["manifest_digest"]
