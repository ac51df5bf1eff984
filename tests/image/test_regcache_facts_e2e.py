"""The catalogue's facts in the registry build cache (``kiln.patch.facts``): a hit imports no patch module.

A build with ``--cache-to`` also writes the catalogue's facts, keyed by the bytes of
``patchsets/`` and kiln's code. A second runner's build, as the command line runs it (its own
process), reads them, signed, and then its other entries: the same image, and neither libcst
nor any patch module imported. An unsigned entry is not used in the catalogue's place: the
catalogue is loaded and the entry compared with it. Facts that are another catalogue's, that
do not parse, or that lie (their key right, a digest or a title wrong) are a miss with one
warning: the catalogue is loaded and the image and its SBOM are the cache-less build's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kiln import paths
from kiln.image.cachekeys import CATALOGUE, PATCHED, entry_tag
from tests.image.test_build_e2e import IMAGE, IMAGES, SM
from tests.image.test_regcache_e2e import (
    _blob,
    _entry,
    _fresh_runner,
    _key,
    _key_pair,
    _put_blob,
    _put_entry,
)

pytestmark = [pytest.mark.registry, pytest.mark.reliability]


def _run_cli(project, cache_dir, *extra: str) -> tuple[dict, list[str]]:
    """``build.py build`` in a process of its own, with ``-X importtime``: its JSON, and every
    module it imported."""
    argv = [sys.executable, "-X", "importtime", str(paths.REPO / "build.py"), "--pins", str(project.pins()),
            "--images", str(IMAGES), "build", "--image", IMAGE, "--pin", "v0.20.1", "--sm", str(SM),
            "--mirror", project.registry.mirror, "--json", *extra]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KILN_CACHE_DIR": str(cache_dir)})
    assert done.returncode == 0, done.stderr[-3000:]
    imported = [line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    return json.loads(done.stdout), imported


def test_a_signed_hit_reads_the_catalogues_facts_and_imports_no_patch_module(project, capsys, tmp_path,
                                                                             monkeypatch, base_layout):
    registry = project.registry
    signer, signer_pub = _key_pair(tmp_path, "signer")
    cache_repo = f"{registry.host}/{project.dest}-cache"
    _fresh_runner(monkeypatch, tmp_path, "runner-a")
    code, first, err = project.build(capsys, "--push", "--repository", f"{registry.host}/{project.dest}-a",
                                     "--cache-to", cache_repo, "--sign-key", signer)
    assert code == 0, err
    facts_tag = entry_tag(CATALOGUE, _key(first, CATALOGUE))

    second, imported = _run_cli(project, tmp_path / "reader", "--push", "--repository",
                                f"{registry.host}/{project.dest}-b", "--cache-from", cache_repo,
                                "--cache-key", signer_pub)
    assert not [w for w in second["warnings"] if "unsigned" in w], second["warnings"]
    assert second["manifest_digest"] == first["manifest_digest"]
    sbom = "application/vnd.cyclonedx+json"  # (the writer's --sign-key signed its provenance too)
    assert second["attestations"][sbom] == first["attestations"][sbom]  # the SBOM from the facts: the same
    assert second["cache"]["hit"] == [f"{cache_repo}:{entry_tag(PATCHED, _key(first))}", f"{cache_repo}:{facts_tag}"]
    # (-X importtime logs what ``import`` statements load: not the modules that importlib loads
    # by hand, the command modules and the patch modules, but everything those import)
    assert "kiln.image.cachelookup" in imported and "kiln.pipeline" in imported
    assert not [m for m in imported if m.split(".")[0] == "libcst" or m in ("kiln.patch.model", "kiln.patch.engine")]

    # without the cache the same command line imports them all (the probe can tell)
    third, imported = _run_cli(project, tmp_path / "no-cache", "--push", "--repository",
                               f"{registry.host}/{project.dest}-c")
    assert third["manifest_digest"] == first["manifest_digest"]
    assert "libcst" in imported and "kiln.patch.model" in imported and "kiln.patch.engine" in imported

    # read without the key, the signed entries are not verified: the catalogue is loaded (its
    # facts compared with the entry's), and the build says it used an unsigned entry
    fourth, imported = _run_cli(project, tmp_path / "unverified", "--push", "--repository",
                                f"{registry.host}/{project.dest}-d", "--cache-from", cache_repo)
    assert fourth["manifest_digest"] == first["manifest_digest"]
    assert fourth["attestations"][sbom] == first["attestations"][sbom]
    assert fourth["cache"]["hit"] == [f"{cache_repo}:{entry_tag(PATCHED, _key(first))}"]
    assert "kiln.patch.model" in imported
    assert len([w for w in fourth["warnings"] if "using unsigned patched entry" in w]) == 1, fourth["warnings"]


def test_facts_that_are_wrong_are_a_miss_and_the_catalogue_is_loaded(project, capsys, tmp_path, monkeypatch,
                                                                      patch_runs, start_registry):
    cache = start_registry("plain")  # a registry of its own: its entries are rewritten below
    repo = f"{project.dest}-cache"
    where = ("--cache-from", f"{cache.host}/{repo}", "--insecure-registry", cache.host)
    _fresh_runner(monkeypatch, tmp_path, "writer")
    code, first, err = project.build(capsys, "--cache-to", f"{cache.host}/{repo}", "--insecure-registry", cache.host)
    assert code == 0, err
    facts_key = _key(first, CATALOGUE)
    tag = entry_tag(CATALOGUE, facts_key)
    entry = _entry(cache, repo, facts_key, CATALOGUE)
    record = json.loads(_blob(cache, repo, entry["config"]["digest"]))
    assert record["kind"] == CATALOGUE and set(record["facts"]["patches"]) == set(record["facts"]["digests"])

    def build_with(name: str, poisoned: dict, refused: str, patched: bool) -> dict:
        config = _put_blob(cache, repo, json.dumps(poisoned).encode())
        _put_entry(cache, repo, tag, {**entry, "config": {**entry["config"], **config}})
        runs = len(patch_runs)
        _fresh_runner(monkeypatch, tmp_path, name)
        code, again, err = project.build(capsys, *where)
        assert code == 0, err
        assert again["manifest_digest"] == first["manifest_digest"], name
        assert again["attestations"] == first["attestations"], name
        assert len([w for w in again["warnings"] if refused in w]) == 1, (name, again["warnings"])
        assert len([w for w in again["warnings"] if "unsigned" not in w]) == 1, (name, again["warnings"])
        assert len(patch_runs) == runs + patched, name
        return again

    # 1. another catalogue's facts under this key (its inputs name other patchsets bytes)
    other = {**record, "inputs": {**record["inputs"], "patchsets": {"a.py": "0" * 64}}}
    again = build_with("other-catalogue", other, "another build's", patched=False)
    assert again["cache"]["hit"] == [f"{cache.host}/{repo}:{entry_tag(PATCHED, _key(first))}"]  # not the facts

    # 2. facts that do not parse (a patch's requires is not a list)
    pid = next(iter(record["facts"]["patches"]))
    broken = json.loads(json.dumps(record))
    broken["facts"]["patches"][pid]["requires"] = "P65"
    build_with("broken", broken, f"patch {pid!r}: a field of the wrong type", patched=False)

    # 3. facts whose key is right and one digest wrong: unsigned, they are compared with the
    # loaded catalogue first; the patched entry is then found under the right key
    pid = first["patches"][0]["patch"]  # a patch of the selection
    lying = json.loads(json.dumps(record))
    lying["facts"]["digests"][pid] = "0" * 64
    again = build_with("lying", lying, f"its facts differ from {paths.PATCHSETS}: patch {pid} sha256",
                       patched=False)
    assert again["cache"]["hit"] == [f"{cache.host}/{repo}:{entry_tag(PATCHED, _key(first))}"]

    # 4. facts whose key is right and a title false: not in the SBOM (the attestations are the
    # cache-less build's, build_with checks), a miss with one warning naming the patch and field
    false = json.loads(json.dumps(record))
    false["facts"]["patches"][pid]["title"] = "Harmless typo fix (reviewed)"
    again = build_with("false-title", false, f"patch {pid} title is 'Harmless typo fix (reviewed)'", patched=False)
    assert again["cache"]["hit"] == [f"{cache.host}/{repo}:{entry_tag(PATCHED, _key(first))}"]

    # the writer's facts again: a hit of both
    _put_entry(cache, repo, tag, entry)
    _fresh_runner(monkeypatch, tmp_path, "reader")
    runs = len(patch_runs)
    code, hit, err = project.build(capsys, *where)
    assert code == 0, err
    assert len(hit["cache"]["hit"]) == 1 and len(patch_runs) == runs and hit["manifest_digest"] == first["manifest_digest"]
    assert not [w for w in hit["warnings"] if "refused" in w], hit["warnings"]
