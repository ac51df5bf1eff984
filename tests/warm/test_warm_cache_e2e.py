"""The warm layer travels in the registry build cache: ``build --warm DIR --cache-to`` writes a
``warm`` entry keyed by the warm key; ``build --warm-from-cache --cache-from`` on the same inputs
bakes the same image from it; a tampered entry is a miss with a warning, and with no entry that
verifies the build fails in one line and writes nothing (a cold image is not what was asked for);
the flag without a cache to read is refused first."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from tests.attest.test_trust_e2e import Registry, _pem_pair
from tests.warm.test_warm_build_e2e import _bundle, _layout

pytestmark = pytest.mark.registry


def test_a_warm_bundle_written_to_the_cache_is_baked_from_it_and_a_tampered_entry_is_a_miss(project, capsys,
                                                                                               tmp_path):
    code, cold, err = project.build(capsys, "--oci", str(tmp_path / "cold"))
    assert code == 0, err
    manifest, _, _, blob = _layout(tmp_path / "cold")
    with tarfile.open(fileobj=io.BytesIO(blob(manifest["layers"][-1]["digest"])), mode="r:gz") as tar:
        audit = json.loads(tar.extractfile("opt/kiln/manifest.json").read())
    bundle = _bundle(project, tmp_path, audit, "bundle")
    raw, cache_repo = Registry(project.registry), f"{project.dest}-cache"
    cache = f"{raw.host}/{cache_repo}"

    code, warm, err = project.build(capsys, "--warm", str(bundle), "--cache-to", cache)
    assert code == 0, err
    [entry] = [e for e in warm["cache"]["entries"] if e["kind"] == "warm"]
    assert entry["key"] == warm["warm"]["key"].removeprefix("sha256:") and entry["hit"] is None
    assert any(written.startswith(f"{cache}@") for written in warm["cache"]["written"])

    # another machine, no bundle: the same image from the cache, its warm entry the hit
    code, again, err = project.build(capsys, "--warm-from-cache", "--cache-from", cache)
    assert code == 0, err
    assert again["manifest_digest"] == warm["manifest_digest"] and again["warm"] == warm["warm"]
    [hit] = [e for e in again["cache"]["entries"] if e["kind"] == "warm"]
    assert hit["hit"] == f"{cache}:{entry['tag']}"
    warm_lines = [w for w in again["warnings"] if "warm entry" in w or "--warm" in w]
    assert warm_lines == [f"build cache: using unsigned warm entry from {hit['hit']}: whoever can push there can "
                          "change its compiled code undetected; --cache-key PUB takes signed entries only"]

    # the entry's record rewritten (a file's sha256 in its bundle): a miss with a warning, built cold
    body = json.loads(raw.manifest(cache_repo, entry["tag"])[0])
    record = json.loads(raw.blob(cache_repo, body["config"]["digest"]))
    planted = json.loads(record["bundle"])
    first = sorted(planted["files"])[0]
    planted["files"][first] = "0" * 64
    record["bundle"] = json.dumps(planted, indent=1, sort_keys=True) + "\n"
    data = json.dumps(record).encode()
    body["config"] = {**body["config"], "digest": raw.put_blob(cache_repo, data), "size": len(data)}
    raw.put_manifest(cache_repo, entry["tag"], json.dumps(body).encode())
    code, missed, err = project.build(capsys, "--warm-from-cache", "--cache-from", cache, "--oci",
                                      str(tmp_path / "missed"))
    assert code != 0 and missed is None and not (tmp_path / "missed").exists(), err
    refused = [line for line in err.splitlines() if entry["tag"] in line]
    assert len(refused) == 1 and "its layer's files are not the ones its bundle lists" in refused[0], err
    assert err.strip().splitlines()[-1].endswith(f"--warm-from-cache: no warm entry of this build's warm key "
                                                 f"{warm['warm']['key']} verifies in {cache}: nothing built "
                                                 "(warm it once: build.py warm, then build --warm DIR --cache-to; "
                                                 "docs/WARM.md)"), err

    # nothing to read it from: one line, exit 2, before any work
    code, _, err = project.build(capsys, "--warm-from-cache", "--oci", str(tmp_path / "never"))
    [line] = err.strip().splitlines()
    assert code == 2 and "--warm-from-cache: no --cache-from" in line and not (tmp_path / "never").exists()


def test_a_signed_warm_entry_is_taken_with_its_key_and_missed_with_another(project, capsys, tmp_path):
    key, pub = _pem_pair(ed25519.Ed25519PrivateKey.generate(), tmp_path, "signer")
    _, other = _pem_pair(ed25519.Ed25519PrivateKey.generate(), tmp_path, "other")
    code, cold, err = project.build(capsys, "--oci", str(tmp_path / "cold"))
    assert code == 0, err
    manifest, _, _, blob = _layout(tmp_path / "cold")
    with tarfile.open(fileobj=io.BytesIO(blob(manifest["layers"][-1]["digest"])), mode="r:gz") as tar:
        audit = json.loads(tar.extractfile("opt/kiln/manifest.json").read())
    cache = f"{project.registry.host}/{project.dest}-signed"
    code, warm, err = project.build(capsys, "--warm", str(_bundle(project, tmp_path, audit, "bundle")),
                                    "--cache-to", cache, "--sign-key", str(key))
    assert code == 0, err
    code, again, err = project.build(capsys, "--warm-from-cache", "--cache-from", cache, "--cache-key", str(pub))
    assert code == 0 and again["manifest_digest"] == warm["manifest_digest"], err
    assert not [w for w in again["warnings"] if "warm entry" in w or "--warm" in w], again["warnings"]
    code, missed, err = project.build(capsys, "--warm-from-cache", "--cache-from", cache, "--cache-key", str(other))
    assert code != 0 and missed is None and "--warm-from-cache: no warm entry" in err.strip().splitlines()[-1], err
