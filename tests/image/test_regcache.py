"""The registry build cache's keys and options, without a registry (``kiln.image.cachekeys``, ``regcache``)."""

from __future__ import annotations

import copy
import hashlib
import re
import shutil
from dataclasses import replace

import pytest

from kiln import commands
from kiln.errors import KilnError
from kiln.image.cachekeys import (
    KERNELS,
    PATCHED,
    entry_tag,
    kernels_key,
    patched_key,
    probe_walks,
    source_key,
    vllm_layers,
    walk_read,
)
from kiln.image.inputs import load_build_inputs
from kiln.image.regcache import CachedEntry, parse_cache_location, patched_agrees
from kiln.oci.digest import sha256_text
from kiln.oci.endpoints import RegistryConfig
from kiln.oci.layer import LayerContents
from kiln.oci.manifest import Descriptor
from kiln.paths import RepoFiles
from tests.support import TEST_IMAGES

PIN_DIGEST = "sha256:" + "ab" * 32
PINS = '[pins."v0.20.1"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:v0.20.1"\nvllm = "0.20.1"\n' \
       'cuda = "cu130"\ndigest = "' + PIN_DIGEST + '"\n'


@pytest.fixture
def files(tmp_path) -> RepoFiles:
    pins = tmp_path / "pins.toml"
    pins.write_text(PINS)
    images = tmp_path / "images"
    shutil.copytree(TEST_IMAGES, images)
    return RepoFiles(pins=pins, images=images)


GZIP, TAR = "application/vnd.oci.image.layer.v1.tar+gzip", "application/vnd.oci.image.layer.v1.tar"
DOCKER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"


def _layers(*names: str, media_type: str = GZIP) -> list[Descriptor]:
    """A base's layers, bottom first, each a digest of its name."""
    return [Descriptor(media_type, "sha256:" + hashlib.sha256(n.encode()).hexdigest(), 1) for n in names]


BASE = _layers("rootfs", "cuda", "torch", "vllm", "app")
WALK = vllm_layers(BASE, 2)  # the walk stops after app and vllm


def test_the_patched_key_is_stable_and_names_what_the_patching_depends_on(files):
    inputs = load_build_inputs(files, "e2e-p65", "v0.20.1", 120)
    key, hashed = patched_key(inputs, WALK, False)
    assert (key, hashed) == patched_key(load_build_inputs(files, "e2e-p65", "v0.20.1", 120), WALK, False)
    assert len(key) == 64 and len(entry_tag(PATCHED, key)) <= 128
    assert entry_tag(PATCHED, key) == f"kiln-cache-patched-v3-{key}"
    assert [p["id"] for p in hashed["patches"]] == ["P65"]
    assert [layer["digest"] for layer in hashed["vllm_layers"]["layers"]] == [BASE[4].digest, BASE[3].digest]
    others = {
        "another top layer": patched_key(inputs, vllm_layers(_layers("vllm", "app2"), 2), False)[0],
        "another vLLM layer": patched_key(inputs, vllm_layers(_layers("vllm2", "app"), 2), False)[0],
        "one layer deeper": patched_key(inputs, vllm_layers(BASE, 3), False)[0],
        "read to the bottom": patched_key(inputs, vllm_layers(BASE[3:], 2, to_bottom=True), False)[0],
        "a plain tar layer": patched_key(inputs, vllm_layers(_layers("vllm", "app", media_type=TAR), 2), False)[0],
        "a zstd layer": patched_key(inputs, vllm_layers(_layers("vllm", "app", media_type=ZSTD), 2), False)[0],
        "read on for Triton": patched_key(inputs, WALK, True)[0],
    }
    # a patch module's bytes: the catalogue's digest of it
    catalogue = replace(inputs.catalogue, digests={**inputs.catalogue.digests, "P65": "0" * 64})
    others["another P65"] = patched_key(replace(inputs, catalogue=catalogue), WALK, False)[0]
    # a gate that decides otherwise for this target (the only use the engine makes of the SM)
    p65 = inputs.catalogue.get("P65")
    gated = copy.copy(p65)
    gated.gates = replace(p65.gates, sm_max=90)
    catalogue = replace(inputs.catalogue, patches={**inputs.catalogue.patches, "P65": gated})
    others["P65 gated on sm120"] = patched_key(replace(inputs, catalogue=catalogue), WALK, False)[0]
    assert key not in others.values() and len(set(others.values())) == len(others)
    # what lies below the layers read is not in it (a rebuilt CUDA layer, one layer more), nor
    # how the manifest names a gzip layer (Docker's and OCI's types are read alike)
    for lower in (_layers("rootfs", "cuda2", "torch", "vllm", "app"),
                  _layers("filler", "rootfs", "cuda", "torch", "vllm", "app"),
                  _layers("rootfs", "cuda", "torch", "vllm", "app", media_type=DOCKER_GZIP)):
        assert patched_key(inputs, vllm_layers(lower, 2), False)[0] == key
    # no image name, definition file, tag or SM: images on one base and selection share the entry
    definition = files.images / "e2e-p65.toml"
    definition.write_text(definition.read_text().replace('name = "e2e-p65"', 'name = "e2e-p65-b"')
                          + "\n# another definition file\n")
    definition.rename(files.images / "e2e-p65-b.toml")
    assert patched_key(load_build_inputs(files, "e2e-p65-b", "v0.20.1", 86), WALK, False)[0] == key


def test_the_probe_covers_each_depth_the_walk_may_stop_at_and_a_walk_is_keyed_by_what_it_read():
    walks = probe_walks(BASE, 32)
    assert [(len(w["layers"]), w["to_bottom"]) for w in walks] == [(1, False), (2, False), (3, False), (4, False),
                                                                   (5, False), (5, True)]
    assert walks[1] == WALK == walk_read(BASE, [BASE[4].digest, BASE[3].digest])
    assert walk_read(BASE, [d.digest for d in reversed(BASE)]) == walks[-1]  # read down to its bottom
    assert [len(w["layers"]) for w in probe_walks(BASE, 3)] == [1, 2, 3]  # bounded; the bottom is beyond it
    # a layer no walk reads (not a tar): nothing at or below it is probed
    odd = [*BASE[:3], Descriptor("application/vnd.in-toto+json", BASE[3].digest, 1), BASE[4]]
    assert [len(w["layers"]) for w in probe_walks(odd, 32)] == [1]
    with pytest.raises(KilnError, match="not the base's top-most"):
        walk_read(BASE, [BASE[4].digest, BASE[2].digest])


def test_the_kernel_key_is_per_sm_and_keeps_out_what_the_kernels_do_not_read(files):
    inputs = load_build_inputs(files, "e2e-triton", "v0.20.1", 120)
    env = {"PATH": "/usr/bin", "CUDA_HOME": "/usr/local/cuda"}
    key, hashed = kernels_key(inputs, WALK["layers"], env)
    assert key == kernels_key(load_build_inputs(files, "e2e-triton", "v0.20.1", 120), WALK["layers"], env)[0]
    assert len(entry_tag(KERNELS, key)) <= 128 and hashed["sm"] == 120 and hashed["base_env"] == env
    others = {
        "another SM": kernels_key(load_build_inputs(files, "e2e-triton", "v0.20.1", 86), WALK["layers"], env)[0],
        "another vLLM layer": kernels_key(inputs, vllm_layers(_layers("vllm2", "app"), 2)["layers"], env)[0],
        "another base Env": kernels_key(inputs, WALK["layers"], {**env, "CUDA_HOME": "/opt/cuda"})[0],
        "kernels left out": kernels_key(inputs, WALK["layers"], env, leave_out_unusable_kernels=True)[0],
    }
    assert key not in others.values() and len(set(others.values())) == len(others)
    # the selection counts exactly when a selected patch touches a file the kernels read
    touches = hashed["sources"] != "pristine"
    catalogue = replace(inputs.catalogue, digests={pid: "0" * 64 for pid in inputs.catalogue.digests})
    assert (kernels_key(replace(inputs, catalogue=catalogue), WALK["layers"], env)[0] != key) is touches
    # a lower layer is not in it
    lower = vllm_layers(_layers("filler", "rootfs", "cuda", "torch", "vllm", "app"), 2)["layers"]
    assert kernels_key(inputs, lower, env)[0] == key


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


def test_require_signed_is_a_checked_boolean_of_the_cache_table(tmp_path):
    conf = tmp_path / "registries.toml"
    conf.write_text('[cache]\nfrom = ["ghcr.io/you/cache"]\nrequire_signed = true\n')
    assert RegistryConfig.load(path=conf).cache_require_signed is True
    assert RegistryConfig.load(path=tmp_path / "absent.toml").cache_require_signed is False
    for text in ('[cache]\nrequire_sigend = true\n', '[cache]\nrequire_signed = "yes"\n',
                 'require_signed = true\n'):  # a typo, a string, outside [cache]: refused, naming the file
        conf.write_text(text)
        with pytest.raises(KilnError, match=str(conf)):
            RegistryConfig.load(path=conf)


def _patched_entry(**fields) -> CachedEntry:
    """A verified-shape patched entry of P65 applied to one file, with ``fields`` replaced."""
    text = "x = 1\n"
    site = "usr/local/lib/python3.12/dist-packages"
    record = {"kind": "patched", "site_dir": site, "vllm_version": "0.20.1", "before": {"a.py": "0" * 64},
              "outcomes": [{"patch": "P65", "verdict": "APPLIES", "detail": "",
                            "files": {"a.py": {"before": "0" * 64, "after": sha256_text(text)}}},
                           {"patch": "P5", "verdict": "GATED", "detail": "sm"}],
              "applied": ["P65"], "modules": {"P65": "1" * 64, "P5": "2" * 64},
              "platform": {"os": "linux", "architecture": "amd64", "variant": None},
              "source": {"site_dir": site, "python": "3" * 64, "bytecode": "4" * 64, "files": {"a.py": "0" * 64}}}
    record.update(fields)
    return CachedEntry(record, [LayerContents({f"{record['site_dir']}/vllm/a.py": text.encode()}, ())], "here")


_KEY_INPUTS = {"vllm": "0.20.1", "patches": [{"id": "P65", "sha256": "1" * 64, "out_of_range": None, "gated": None},
                                            {"id": "P5", "sha256": "2" * 64, "out_of_range": None, "gated": "sm"}]}
_PLATFORM = {"os": "linux", "architecture": "amd64", "variant": None}


@pytest.mark.parametrize(("fields", "named"), [
    ({"site_dir": "etc"}, "site_dir 'etc'"),
    ({"site_dir": "usr/lib/python3.12/../../etc/site-packages"}, "site_dir"),
    ({"vllm_version": "0.19.0"}, "vllm_version '0.19.0' is not the pin's '0.20.1'"),
    ({"platform": {"os": "linux", "architecture": "arm64", "variant": None}}, "platform"),
    ({"outcomes": [{"patch": "P65", "verdict": "APPLIES", "detail": ""}]}, "outcomes are of P65; the selection"),
    ({"outcomes": [{"patch": "P5", "verdict": "GATED"}, {"patch": "P65", "verdict": "APPLIES"}]}, "outcomes are of P5, P65"),
    ({"modules": {"P65": "9" * 64, "P5": "2" * 64}}, "modules: P65's sha256"),
    ({"modules": {"P65": "1" * 64, "P5": "2" * 64, "P9\nok": "3" * 64}}, "modules: 'P9\\nok'"),
    ({"applied": []}, "applied patches (none) are not those its outcomes apply (P65)"),
    ({"outcomes": [{"patch": "P65", "verdict": "APPLIES", "detail": "",
                    "files": {"a.py": {"before": "0" * 64, "after": "f" * 64}}},
                   {"patch": "P5", "verdict": "GATED"}]}, "its layer's a.py is not what its outcomes say"),
    ({"outcomes": [{"patch": "P65", "verdict": "APPLIES", "detail": ""},
                   {"patch": "P5", "verdict": "APPLIES", "files": {"a.py": {"before": None, "after": "0" * 64}}}],
      "applied": ["P65", "P5"]}, "P5 is APPLIES, but this target gates it off"),
    ({"source": {"site_dir": "usr/local/lib/python3.12/dist-packages", "python": "3" * 64, "bytecode": "4" * 64,
                 "files": {"a.py": "5" * 64}}}, "pristine files are not those its source names"),
    ({"source": {"site_dir": "usr/lib/python3.12/site-packages", "python": "3" * 64, "bytecode": "4" * 64,
                 "files": {"a.py": "0" * 64}}}, "site dir or pristine files"),
])
def test_a_patched_entry_that_disagrees_with_the_build_names_the_field(fields, named):
    check = patched_agrees(_KEY_INPUTS, _PLATFORM)
    check(_patched_entry())  # the entry as written: agrees
    with pytest.raises(KilnError, match=re.escape(named)) as err:
        check(_patched_entry(**fields))
    assert "\n" not in str(err.value)


def test_a_patched_entry_keyed_by_its_source_is_any_platforms_but_only_of_that_source():
    """Keyed by the layers, the writer's platform must be the base's; keyed by the source (the
    pristine files: ``cachekeys.source_key``), any platform's entry of that very source agrees."""
    source = _patched_entry().record["source"]
    arm64 = {"os": "linux", "architecture": "arm64", "variant": None}
    with pytest.raises(KilnError, match="platform"):
        patched_agrees(_KEY_INPUTS, arm64)(_patched_entry())
    patched_agrees({**_KEY_INPUTS, "source": source}, arm64)(_patched_entry())  # an amd64 writer's: agrees
    with pytest.raises(KilnError, match="its record's source is not the one its key names"):
        patched_agrees({**_KEY_INPUTS, "source": {**source, "python": "9" * 64}}, arm64)(_patched_entry())


def test_the_source_key_names_the_pristine_files_and_selection_not_the_layers_platform_or_sm(files):
    """One key for every platform and SM of a pin whose vLLM source is the same (``source_key``)."""
    source = {"site_dir": "usr/local/lib/python3.12/dist-packages", "python": "3" * 64, "bytecode": "4" * 64,
              "files": {"a.py": "0" * 64}}
    inputs = load_build_inputs(files, "e2e-p65", "v0.20.1", 120)
    key, hashed = source_key(inputs, source)
    assert "vllm_layers" not in hashed and "platform" not in hashed and "sm" not in hashed
    assert source_key(replace(inputs, platform="linux/arm64"), source)[0] == key
    assert source_key(load_build_inputs(files, "e2e-p65", "v0.20.1", 86), source)[0] == key
    for field in source:
        assert source_key(inputs, {**source, field: "other"})[0] != key, field
