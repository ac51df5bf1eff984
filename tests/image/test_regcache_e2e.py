"""The registry build cache (``--cache-to/--cache-from``) with two kiln caches and real registries.

A first build writes its entry; a second one, on an empty kiln cache (a fresh runner), reads it:
the same image digest and attestations, no vLLM layer blob read (the registry's access log) and
no patching. Poisoned entries (a blob whose bytes are not its digest, another build's record
under this key, a layer that does not re-derive) are misses with a warning: the build falls
back to building, to the same digest.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import posixpath
import re
import tarfile
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from kiln.image.cachekeys import ARTIFACT_TYPES, CATALOGUE, KERNELS, PATCHED, entry_tag
from kiln.image.regcache import read_entry, write_entry
from kiln.oci.endpoints import RegistryConfig
from kiln.oci.layer import LayerContents, write_layer
from kiln.oci.registry import RegistryClient
from kiln.report import Recorder
from tests.image.test_build_e2e import TAG
from tests.support.registry import VLLM_VERSION

pytestmark = [pytest.mark.registry, pytest.mark.reliability]

MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _fresh_runner(monkeypatch, tmp_path, name: str) -> None:
    """An empty kiln cache: nothing of an earlier build on this machine."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / name))


def _key(result: dict, kind: str = PATCHED) -> str:
    """The key of the build's ``kind`` entry, from its ``--json``."""
    [key] = [e["key"] for e in result["cache"]["entries"] if e["kind"] == kind]
    return key


def _entry(registry, repository: str, key: str, kind: str = PATCHED) -> dict:
    resp = requests.get(f"{registry.url}/v2/{repository}/manifests/{entry_tag(kind, key)}",
                        headers={"Accept": MANIFEST}, timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()


def without_source_entry(registry, repository: str, result: dict) -> None:
    """The build's patched entry left under the key a probe finds it by only: its copy under its
    source's key (``cachekeys.source_key``) deleted, so that what a test does to the first is all
    a reader finds (a reader that refuses it would otherwise find the copy, rightly)."""
    [source_key] = [e["source_key"] for e in result["cache"]["entries"] if e["kind"] == PATCHED]
    url = f"{registry.url}/v2/{repository}/manifests/"
    head = requests.head(url + entry_tag(PATCHED, source_key), headers={"Accept": MANIFEST}, timeout=10)
    assert head.status_code == 200, head.status_code
    assert requests.delete(url + head.headers["Docker-Content-Digest"], timeout=10).status_code == 202


def _blob(registry, repository: str, digest: str) -> bytes:
    resp = requests.get(f"{registry.url}/v2/{repository}/blobs/{digest}", timeout=10)
    assert resp.status_code == 200
    return resp.content


def _put_blob(registry, repository: str, data: bytes) -> dict:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    start = requests.post(f"{registry.url}/v2/{repository}/blobs/uploads/", timeout=10)
    assert start.status_code == 202, start.text
    location = start.headers["Location"]
    location = location if location.startswith("http") else registry.url + location
    sep = "&" if "?" in location else "?"
    done = requests.put(f"{location}{sep}digest={digest}", data=data,
                        headers={"Content-Type": "application/octet-stream"}, timeout=10)
    assert done.status_code == 201, done.text
    return {"digest": digest, "size": len(data)}


def _put_entry(registry, repository: str, tag: str, manifest: dict) -> None:
    resp = requests.put(f"{registry.url}/v2/{repository}/manifests/{tag}", data=json.dumps(manifest).encode(),
                        headers={"Content-Type": MANIFEST}, timeout=10)
    assert resp.status_code == 201, resp.text


def _other_layer(removals: list[str]) -> bytes:
    """A gzip tar with the record's whiteouts and a file of someone else's (GNU tar's way, not kiln's)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        entries = [(f"{posixpath.dirname(r)}/.wh.{posixpath.basename(r)}".lstrip("/"), b"") for r in removals]
        for name, data in [*entries, ("opt/kiln/evil.py", b"import os\n")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


def written_by_a_first_runner(project, capsys, tmp_path, monkeypatch) -> tuple[str, dict]:
    """A first runner's build, pushed to ``<dest>-a``, writing the cache ``<dest>-cache``: its name and ``--json``."""
    cache_repo = f"{project.registry.host}/{project.dest}-cache"
    _fresh_runner(monkeypatch, tmp_path, "runner-a")
    code, first, err = project.build(capsys, "--push", "--repository", f"{project.registry.host}/{project.dest}-a",
                                     "--cache-to", cache_repo)
    assert code == 0, err
    without_source_entry(project.registry, f"{project.dest}-cache", first)
    return cache_repo, first


def test_second_runner_reads_the_entry_and_no_vllm_layer(project, capsys, tmp_path, monkeypatch, patch_runs,
                                                          base_layout):
    registry = project.registry
    cache_repo, first = written_by_a_first_runner(project, capsys, tmp_path, monkeypatch)
    assert patch_runs == [1] and first["cache"]["hit"] is None and len(first["cache"]["written"]) == 3  # patched twice (layers, source), catalogue
    assert [e["kind"] for e in first["cache"]["entries"]] == [PATCHED, CATALOGUE]  # no kernels
    facts = _entry(registry, f"{project.dest}-cache", _key(first, CATALOGUE), CATALOGUE)
    assert facts["artifactType"] == ARTIFACT_TYPES[CATALOGUE] and facts["layers"] == []
    entry = _entry(registry, f"{project.dest}-cache", _key(first))
    assert entry["artifactType"] == ARTIFACT_TYPES[PATCHED]
    # the entry holds the patching's result; the image's layer adds the audit file to it
    with tarfile.open(fileobj=io.BytesIO(_blob(registry, f"{project.dest}-cache", entry["layers"][0]["digest"]))) as tar:
        names = {m.name for m in tar.getmembers() if m.isfile()}
    assert names and all("/vllm/" in n for n in names) and entry["layers"][0]["digest"] != first["layer_digest"]

    _fresh_runner(monkeypatch, tmp_path, "runner-b")
    log_mark = len(registry.log())
    code, second, err = project.build(capsys, "--push", "--repository", f"{registry.host}/{project.dest}-b",
                                      "--cache-from", f"{registry.host}/{project.dest}-empty",  # a miss: the next
                                      "--cache-from", cache_repo)
    assert code == 0, err
    assert patch_runs == [1], "the cache hit ran the patching"
    # unsigned: the catalogue's facts are checked against the loaded catalogue, not used in its
    # place (a signed entry is: test_regcache_facts_e2e); the build says it used an unsigned entry
    [hit] = second["cache"]["hit"]
    assert hit.endswith(entry_tag(PATCHED, _key(first)))
    [unsigned] = [w for w in second["warnings"] if "unsigned" in w]
    assert unsigned.startswith(f"build cache: using unsigned patched entry from {cache_repo}:"), unsigned
    assert "--cache-key" in unsigned and "\n" not in unsigned
    assert second["manifest_digest"] == first["manifest_digest"]
    assert second["config_digest"] == first["config_digest"]
    assert second["attestations"] == first["attestations"]  # the SBOM and provenance too
    assert second["patches"] == first["patches"] and second["triton"] == first["triton"]
    log = registry.log()[log_mark:]
    for role in ("vllm", "app"):  # the layers that hold vLLM: neither was read
        assert f"GET /v2/vllm/vllm-openai/blobs/{base_layout.layers[role]}" not in log, role
    assert "GET /v2/vllm/vllm-openai/blobs/" in log  # the base's config, read through the same log
    assert second["bytes_pulled"] < base_layout.layer_sizes["vllm"] / 4
    assert registry.digest_of(f"{project.dest}-b:{TAG}") == first["manifest_digest"]
    # the base's blobs are mounted from the base's repository; the patched-source layer is the
    # image's own (its audit file names the image), assembled from the entry and uploaded
    assert second["blobs_mounted"] == first["blobs_mounted"]
    assert second["blobs_uploaded"] == first["blobs_uploaded"]


def test_poisoned_entries_fall_back_to_building(project, capsys, tmp_path, monkeypatch, patch_runs,
                                                start_registry):
    cache = start_registry("plain")  # a registry of its own: corrupting its blobs touches no image
    repo = f"{project.dest}-cache"
    where = ("--cache-from", f"{cache.host}/{repo}", "--insecure-registry", cache.host)
    _fresh_runner(monkeypatch, tmp_path, "writer")
    code, first, err = project.build(capsys, "--cache-to", f"{cache.host}/{repo}", "--insecure-registry", cache.host)
    assert code == 0, err
    without_source_entry(cache, repo, first)
    key = _key(first)
    entry = _entry(cache, repo, key)
    record_bytes = _blob(cache, repo, entry["config"]["digest"])
    record = json.loads(record_bytes)

    def rebuild(name: str, refused: str) -> None:
        runs = len(patch_runs)
        _fresh_runner(monkeypatch, tmp_path, name)
        code, again, err = project.build(capsys, *where)
        assert code == 0, err
        assert again["cache"]["hit"] is None and len(patch_runs) == runs + 1, f"{name}: not built"
        assert again["manifest_digest"] == first["manifest_digest"], (name, again["warnings"], again["cache"])
        assert any("build cache entry" in w and refused in w for w in again["warnings"]), (name, again["warnings"])

    # 1. the layer's bytes are not its digest (same length: only the hash can tell)
    layer = entry["layers"][0]["digest"]
    stored = cache.blob_file(layer)
    good = stored.read_bytes()
    stored.write_bytes(good[:-64] + bytes(64))
    rebuild("bad-digest", "digest mismatch")
    stored.write_bytes(good)

    # 2. another build's record under this key (its inputs differ)
    other = {**record, "inputs": {**record["inputs"], "selection": ["P65", "P66"]}}
    config = _put_blob(cache, repo, json.dumps(other).encode())
    _put_entry(cache, repo, entry_tag(PATCHED, key), {**entry, "config": {**entry["config"], **config}})
    rebuild("other-key", "another build's")

    # 3. a coherent entry whose layer is other content (the record names it, the diff_id does not match)
    blob = _put_blob(cache, repo, _other_layer(record["layers"][0]["removals"]))
    lying = {**record, "layers": [{**record["layers"][0], "digest": blob["digest"], "size": blob["size"]}]}
    config = _put_blob(cache, repo, json.dumps(lying).encode())
    _put_entry(cache, repo, entry_tag(PATCHED, key), {**entry, "config": {**entry["config"], **config},
                                               "layers": [{**entry["layers"][0], **blob}]})
    rebuild("wrong-content", "does not re-derive")

    # a good entry again (the writer's bytes): a hit, the same digest
    _put_entry(cache, repo, entry_tag(PATCHED, key), entry)
    _fresh_runner(monkeypatch, tmp_path, "reader")
    runs = len(patch_runs)
    code, hit, err = project.build(capsys, *where)
    assert code == 0, err
    assert hit["cache"]["hit"] and len(patch_runs) == runs and hit["manifest_digest"] == first["manifest_digest"]


def _key_pair(directory, name: str) -> tuple[str, str]:
    key = ed25519.Ed25519PrivateKey.generate()
    private, public = directory / f"{name}.pem", directory / f"{name}.pub.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return str(private), str(public)


def test_cache_key_takes_only_entries_its_key_signed(project, capsys, tmp_path, monkeypatch, patch_runs):
    registry = project.registry
    repo = f"{project.dest}-cache"
    cache_repo = f"{registry.host}/{repo}"
    signer, signer_pub = _key_pair(tmp_path, "signer")
    _, stranger_pub = _key_pair(tmp_path, "stranger")
    _fresh_runner(monkeypatch, tmp_path, "writer")
    code, first, err = project.build(capsys, "--cache-to", cache_repo, "--sign-key", signer)
    assert code == 0, err
    entry = _entry(registry, repo, _key(first))
    assert entry["config"]["mediaType"] == "application/vnd.dsse.envelope.v1+json"

    def read(name: str, public_key: str) -> dict:
        _fresh_runner(monkeypatch, tmp_path, name)
        code, result, err = project.build(capsys, "--cache-from", cache_repo, "--cache-key", public_key)
        assert code == 0, err
        assert result["manifest_digest"] == first["manifest_digest"], name
        return result

    runs = len(patch_runs)
    stranger = read("stranger", stranger_pub)
    assert stranger["cache"]["hit"] is None and len(patch_runs) == runs + 1
    assert any("no signature verifies" in w for w in stranger["warnings"]), stranger["warnings"]
    signed = read("signed", signer_pub)
    assert signed["cache"]["hit"] and len(patch_runs) == runs + 1  # a hit: nothing patched
    # the same record, unsigned, under the key: refused by a reader that wants signatures (and
    # the signed copy under its source's key gone: else that one is rightly found)
    without_source_entry(registry, repo, first)
    envelope = json.loads(_blob(registry, repo, entry["config"]["digest"]))
    plain = _put_blob(registry, repo, base64.b64decode(envelope["payload"]))
    _put_entry(registry, repo, entry_tag(PATCHED, _key(first)),
               {**entry, "config": {"mediaType": "application/vnd.kiln.cache.record.v1+json", **plain}})
    unsigned = read("unsigned", signer_pub)
    assert unsigned["cache"]["hit"] is None and len(patch_runs) == runs + 2
    assert any("is not signed" in w for w in unsigned["warnings"]), unsigned["warnings"]


def test_concurrent_writers_and_readers_of_one_key(registry_plain, tmp_path):
    """Writers of one key race (their records differ as two runners' would: the compile seconds);
    readers racing them see no entry or a whole one, never a refused one; the last PUT wins."""
    key, key_inputs = "ab" * 32, {"format": ARTIFACT_TYPES[KERNELS], "test": tmp_path.name}
    repo = f"test/{tmp_path.name.lower().replace('_', '-')}-race"
    contents = LayerContents({"opt/kiln/a.py": b"a = 1\n", "opt/kiln/b.py": bytes(range(256)) * 512},
                             ("usr/lib/gone.pyc",), "kiln bake test")
    layer = write_layer(contents, tmp_path / "layers")
    endpoint = RegistryConfig(insecure={registry_plain.host}).endpoint(registry_plain.host, push=True)

    def record(seconds: int) -> dict:
        return {"kind": KERNELS, "key": key, "inputs": key_inputs, "env": {}, "triton": {"seconds": seconds},
                "layers": [{"digest": layer.digest, "diff_id": layer.diff_id, "size": layer.size,
                            "created_by": contents.created_by, "removals": list(contents.removals)}]}

    def write(seconds: int) -> str:
        return write_entry(RegistryClient(endpoint), repo, KERNELS, key, record(seconds), [layer])

    def read(i: int):
        reporter = Recorder()
        workdir = tmp_path / f"read-{i}"
        workdir.mkdir()
        found = read_entry(RegistryClient(endpoint), repo, KERNELS, key, key_inputs, workdir, reporter)
        assert not reporter.warnings, reporter.warnings
        return found

    with ThreadPoolExecutor(max_workers=12) as pool:
        writes = [pool.submit(write, i) for i in range(8)]
        reads = [pool.submit(read, i) for i in range(8)]
        written = {f.result() for f in writes}
        seen = [f.result() for f in reads]
    assert len(written) == 8  # eight different entries were PUT under one tag
    for found in seen:
        assert found is None or (found.layers == [contents] and found.record["triton"]["seconds"] in range(8))
    final = read(99)
    assert final is not None and final.layers == [contents]
    assert _entry(registry_plain, repo, key, KERNELS)["config"]["digest"] in {
        "sha256:" + hashlib.sha256(json.dumps(record(i), sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        for i in range(8)}


SITE = "usr/lib/python3/site-packages"


@pytest.mark.parametrize(("kind", "field", "value"), [
    (KERNELS, "env", ["TRITON_CACHE_DIR"]), (PATCHED, "outcomes", [{"patch": "P65"}]),
    (PATCHED, "before", {"other.py": "0" * 64}), (PATCHED, "applied", [65]),
    (PATCHED, "modules", ["P65"]), (PATCHED, "platform", "linux/amd64"), (PATCHED, "source", "pristine"),
    (PATCHED, "site_dir", "usr/lib/python3.12/site-packages")])  # its layer's files are not under it
def test_a_record_of_the_wrong_shape_is_a_miss(registry_plain, tmp_path, kind, field, value):
    key, key_inputs = "cd" * 32, {"format": ARTIFACT_TYPES[kind], "test": tmp_path.name}
    repo = f"test/{tmp_path.name.lower().replace('_', '-')}-shape"
    contents = LayerContents({f"{SITE}/vllm/envs.py": b"a = 1\n"}, (), "")
    layer = write_layer(contents, tmp_path / "layers")
    endpoint = RegistryConfig(insecure={registry_plain.host}).endpoint(registry_plain.host, push=True)
    fields = {PATCHED: {"vllm_version": "0.20.1", "site_dir": SITE,
                        "outcomes": [{"patch": "P65", "verdict": "APPLIES"}], "applied": ["P65"],
                        "before": {"envs.py": "1" * 64}, "modules": {"P65": "2" * 64},
                        "platform": {"os": "linux", "architecture": "amd64", "variant": None},
                        "source": {"site_dir": SITE, "python": "3" * 64, "bytecode": "4" * 64,
                                   "files": {"envs.py": "1" * 64}}},
              KERNELS: {"env": {"TRITON_CACHE_DIR": "/opt/kiln/triton-cache"}, "triton": {"sm": 120}}}[kind]
    record = {"kind": kind, "key": key, "inputs": key_inputs, **fields,
              "layers": [{"digest": layer.digest, "diff_id": layer.diff_id, "size": layer.size,
                          "created_by": contents.created_by, "removals": []}]}
    client = RegistryClient(endpoint)
    write_entry(client, repo, kind, key, record, [layer])
    good = read_entry(client, repo, kind, key, key_inputs, tmp_path, Recorder())  # the good one: a hit
    assert good is not None and (kind == KERNELS or good.changed() == {"envs.py": "a = 1\n"})
    write_entry(client, repo, kind, key, {**record, field: value}, [layer])
    reporter = Recorder()
    assert read_entry(client, repo, kind, key, key_inputs, tmp_path, reporter) is None
    assert len(reporter.warnings) == 1 and "refused" in reporter.warnings[0], reporter.warnings


def _file_layer(name: str, data: bytes) -> tuple[bytes, str]:
    """A gzip layer holding one file; and its diff_id."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0), "sha256:" + hashlib.sha256(raw.getvalue()).hexdigest()


def _base_variant(registry, repository: str, tag: str, bottom: bytes | None = None, top: bytes | None = None) -> str:
    """The fixture base as ``repository:tag``, its layers the same blobs (mounted), with a layer
    holding ``bottom`` added under them all, or its top layer replaced by one holding ``top``; its digest."""
    source = f"vllm/vllm-openai:v{VLLM_VERSION}"
    manifest = requests.get(f"{registry.url}/v2/{source.replace(':', '/manifests/')}", headers={"Accept": MANIFEST},
                            timeout=10).json()
    config = json.loads(_blob(registry, "vllm/vllm-openai", manifest["config"]["digest"]))
    for layer in manifest["layers"]:
        resp = requests.post(f"{registry.url}/v2/{repository}/blobs/uploads/?mount={layer['digest']}"
                             "&from=vllm/vllm-openai", timeout=10)
        assert resp.status_code == 201, resp.text
    layers, diff_ids = list(manifest["layers"]), list(config["rootfs"]["diff_ids"])
    history = [h for h in config["history"] if not h.get("empty_layer")]
    if bottom is not None:
        blob, diff_id = _file_layer("etc/kiln-fixture-filler", bottom)
        layers.insert(0, {"mediaType": layers[0]["mediaType"], **_put_blob(registry, repository, blob)})
        diff_ids.insert(0, diff_id)
        history.insert(0, {"created_by": "fixture filler"})
    if top is not None:
        blob, diff_id = _file_layer("usr/local/bin/serve.sh", top)
        layers[-1] = {"mediaType": layers[-1]["mediaType"], **_put_blob(registry, repository, blob)}
        diff_ids[-1], history[-1] = diff_id, {"created_by": "fixture other app"}
    config = {**config, "rootfs": {"type": "layers", "diff_ids": diff_ids}, "history": history}
    _put_entry(registry, repository, tag, {**manifest, "layers": layers,
                                           "config": {**manifest["config"], **_put_blob(registry, repository,
                                                                                        json.dumps(config).encode())}})
    return registry.digest_of(f"{repository}:{tag}")


def test_a_base_rebuilt_below_the_vllm_layers_hits_and_one_with_another_top_layer_hits_by_source(
        project, capsys, tmp_path, monkeypatch, patch_runs, base_layout):
    """The patched entry is keyed by the layers the walk reads (the top two here: app and vllm),
    not the base: a base with a filler layer added at the bottom reads the entry (no vLLM layer,
    no patching) and gives the digest its build without cache gives; one whose top layer is
    another misses the probe, reads its layers, and finds the entry by its source (the same vLLM
    files): no patching."""
    registry = project.registry
    cache_repo, bases = f"{registry.host}/{project.dest}-cache", f"{project.dest}-bases"
    _fresh_runner(monkeypatch, tmp_path, "writer")
    code, first, err = project.build(capsys, "--cache-to", cache_repo)
    assert code == 0, err
    lowered = project.pins(_base_variant(registry, bases, "lowered", bottom=b"a rebuilt CUDA layer\n"),
                           image=f"docker.io/{bases}:lowered")
    other_top = project.pins(_base_variant(registry, bases, "other-top", top=b"#!/bin/sh\nexec vllm serve\n"),
                             image=f"docker.io/{bases}:other-top")

    _fresh_runner(monkeypatch, tmp_path, "lowered")
    log_mark = len(registry.log())
    code, hit, err = project.build(capsys, "--cache-from", cache_repo, pins=lowered)
    assert code == 0, err
    assert hit["cache"]["hit"] == [f"{cache_repo}:{entry_tag(PATCHED, _key(first))}"]  # unsigned facts: loaded
    assert _key(hit) == _key(first)
    assert patch_runs == [1], "the hit ran the patching"
    log = registry.log()[log_mark:]
    for role in ("vllm", "app"):  # the layers that hold vLLM: neither was read
        assert f"GET /v2/{bases}/blobs/{base_layout.layers[role]}" not in log, role
    _fresh_runner(monkeypatch, tmp_path, "lowered-no-cache")
    code, built, err = project.build(capsys, pins=lowered)
    assert code == 0, err
    assert patch_runs == [1, 1] and built["manifest_digest"] == hit["manifest_digest"]
    assert built["patches"] == hit["patches"] == first["patches"]
    assert hit["manifest_digest"] != first["manifest_digest"]  # another base (its digest is in the labels)

    _fresh_runner(monkeypatch, tmp_path, "other-top")
    log_mark = len(registry.log())
    code, miss, err = project.build(capsys, "--cache-from", cache_repo, pins=other_top)
    assert code == 0, err
    source_tag = entry_tag(PATCHED, next(e["source_key"] for e in first["cache"]["entries"] if e["kind"] == PATCHED))
    assert _key(miss) != _key(first) and patch_runs == [1, 1]
    assert miss["cache"]["hit"] == [f"{cache_repo}:{source_tag}"]
    # the probe's cost on a miss: the catalogue's facts (its manifest and record: the same
    # catalogue), then one HEAD per depth of the base's 5 layers, and one for all 5 read to the
    # bottom, nothing else of the cache
    requests_sent = re.findall(rf'"([A-Z]+) /v2/{project.dest}-cache/(\S+) HTTP', registry.log()[log_mark:])
    facts_tag = entry_tag(CATALOGUE, _key(first, CATALOGUE))
    assert [method for method, path in requests_sent[:2]] == ["HEAD", "GET"], requests_sent
    assert all(path == f"manifests/{facts_tag}" for _, path in requests_sent[:2]), requests_sent
    assert requests_sent[2][0] == "GET" and requests_sent[2][1].startswith("blobs/sha256:"), requests_sent
    probes = requests_sent[3:9]
    assert all(method == "HEAD" and path.startswith("manifests/kiln-cache-patched-v3-")
               for method, path in probes), requests_sent
    assert f"manifests/{source_tag}" not in [path for _, path in probes]  # unknown before the layers are read
    # then, the layers read, the entry by its source: its manifest, record and layer, nothing else
    assert [path for _, path in requests_sent[9:]][:1] == [f"manifests/{source_tag}"], requests_sent
    assert all(path == f"manifests/{source_tag}" or path.startswith("blobs/sha256:")
               for _, path in requests_sent[9:]), requests_sent
