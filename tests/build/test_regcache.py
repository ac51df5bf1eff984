"""The registry build cache's key and options, without a registry (``kiln.build.regcache``)."""

from __future__ import annotations

import copy
import shutil
from dataclasses import replace

import pytest

from kiln import commands
from kiln.build.inputs import load_build_inputs
from kiln.build.regcache import (
    KERNELS,
    PATCHED,
    entry_tag,
    kernels_key,
    parse_cache_location,
    patched_key,
)
from kiln.errors import KilnError
from kiln.oci.endpoints import RegistryConfig
from kiln.paths import RepoFiles
from tests.support import TEST_IMAGES

BASE = "sha256:" + "ab" * 32
PINS = '[pins."v0.20.1"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:v0.20.1"\nvllm = "0.20.1"\n' \
       'cuda = "cu130"\ndigest = "' + BASE + '"\n'


@pytest.fixture
def files(tmp_path) -> RepoFiles:
    pins = tmp_path / "pins.toml"
    pins.write_text(PINS)
    images = tmp_path / "images"
    shutil.copytree(TEST_IMAGES, images)
    return RepoFiles(pins=pins, images=images)


def test_the_patched_key_is_stable_and_names_what_the_patching_depends_on(files):
    inputs = load_build_inputs(files, "e2e-p65", "v0.20.1", 120)
    key, hashed = patched_key(inputs, BASE)
    assert (key, hashed) == patched_key(load_build_inputs(files, "e2e-p65", "v0.20.1", 120), BASE)
    assert len(key) == 64 and len(entry_tag(PATCHED, key)) <= 128
    assert [p["id"] for p in hashed["patches"]] == ["P65"] and hashed["base"] == BASE
    others = {"another base": patched_key(inputs, "sha256:" + "cd" * 32)[0]}
    # a patch module's bytes: the catalogue's digest of it
    catalogue = replace(inputs.catalogue, digests={**inputs.catalogue.digests, "P65": "0" * 64})
    others["another P65"] = patched_key(replace(inputs, catalogue=catalogue), BASE)[0]
    # a gate that decides otherwise for this target (the only use the engine makes of the SM)
    p65 = inputs.catalogue.get("P65")
    gated = copy.copy(p65)
    gated.gates = replace(p65.gates, sm_max=90)
    catalogue = replace(inputs.catalogue, patches={**inputs.catalogue.patches, "P65": gated})
    others["P65 gated on sm120"] = patched_key(replace(inputs, catalogue=catalogue), BASE)[0]
    assert key not in others.values() and len(set(others.values())) == len(others)
    # no image name, definition file, tag or SM: images on one base and selection share the entry
    definition = files.images / "e2e-p65.toml"
    definition.write_text(definition.read_text().replace('name = "e2e-p65"', 'name = "e2e-p65-b"')
                          + "\n# another definition file\n")
    definition.rename(files.images / "e2e-p65-b.toml")
    assert patched_key(load_build_inputs(files, "e2e-p65-b", "v0.20.1", 86), BASE)[0] == key


def test_the_kernel_key_is_per_sm_and_keeps_out_what_the_kernels_do_not_read(files):
    inputs = load_build_inputs(files, "e2e-triton", "v0.20.1", 120)
    patched = patched_key(inputs, BASE)[0]
    key, hashed = kernels_key(inputs, BASE, patched)
    assert key == kernels_key(load_build_inputs(files, "e2e-triton", "v0.20.1", 120), BASE, patched)[0]
    assert len(entry_tag(KERNELS, key)) <= 128 and hashed["sm"] == 120
    others = {
        "another SM": kernels_key(load_build_inputs(files, "e2e-triton", "v0.20.1", 86), BASE, patched)[0],
        "another base": kernels_key(inputs, "sha256:" + "cd" * 32, patched)[0],
        "kernels left out": kernels_key(inputs, BASE, patched, leave_out_unusable_kernels=True)[0],
    }
    assert key not in others.values() and len(set(others.values())) == len(others)
    # the patched key counts exactly when a selected patch touches a file the kernels read
    touches = hashed["sources"] != "pristine"
    assert (kernels_key(inputs, BASE, "0" * 64)[0] != key) is touches
    assert hashed["sources"] in (patched, "pristine")


@pytest.mark.parametrize("text", ["ghcr.io/you/cache:tag", "ghcr.io/you/cache@sha256:" + "0" * 64,
                                  "cache", "ghcr.io/You/cache", "ghcr.io/you/cache:latest"])
def test_a_cache_location_is_a_repository(text):
    with pytest.raises(KilnError, match="--cache-to"):
        parse_cache_location(text, "--cache-to")


def test_the_registries_file_names_caches_and_a_bad_one_fails_before_any_work(files, tmp_path, capsys):
    conf = tmp_path / "registries.toml"
    conf.write_text('[cache]\nfrom = ["127.0.0.1:9/kiln/cache", "ghcr.io/you/cache"]\nto = ["ghcr.io/you/cache"]\n')
    config = RegistryConfig.load(path=conf)
    assert config.cache_from == ["127.0.0.1:9/kiln/cache", "ghcr.io/you/cache"]
    assert config.cache_to == ["ghcr.io/you/cache"]
    conf.write_text('[cache]\nto = ["ghcr.io/you/cache:v1"]\n')
    argv = ["--pins", str(files.pins), "--images", str(files.images), "build", "--image", "e2e-p65",
            "--pin", "v0.20.1", "--sm", "120", "--registries", str(conf), "--mirror", "docker.io=127.0.0.1:9"]
    assert commands.main(argv) == 2
    err = capsys.readouterr().err
    assert f"{conf}: cache.to" in err and "without a tag" in err and err.count("\n") == 1
    conf.write_text('[cache]\nfrom = "ghcr.io/you/cache"\n')  # not a list: the schema says where
    assert commands.main(argv) == 2
    assert "cache" in capsys.readouterr().err
