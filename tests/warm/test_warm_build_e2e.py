"""``build --warm DIR`` end to end on the build tests' fixture base: the bundle becomes the top layer
with the env pointing vLLM and its compilers there, the audit file, the SBOM and the provenance
record it, the same bundle gives the same image, and a bundle planted for other inputs is refused
in one line before anything is written."""

from __future__ import annotations

import base64
import io
import json
import tarfile

import pytest
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator

from kiln.image.inputs import load_build_inputs
from kiln.image.warmlayer import WARM_ROOT, key_factors, warm_key
from kiln.paths import RepoFiles
from kiln.warm.capture import write_bundle
from tests.image.test_build_e2e import IMAGE, IMAGES, SM

pytestmark = pytest.mark.registry

CACHE = {f"{WARM_ROOT}/vllm/torch_compile_cache/torch_aot_compile/abc/rank_0_0/model": b"aot artifact",
         f"{WARM_ROOT}/inductor/fxgraph/xy/entry": b"fx graph"}


def _layout(path):
    index = json.loads((path / "index.json").read_text())["manifests"]
    blob = lambda digest: (path / "blobs/sha256" / digest.split(":")[1]).read_bytes()  # noqa: E731
    [image] = [m for m in index if "artifactType" not in m]
    manifest = json.loads(blob(image["digest"]))
    artifacts = {m["artifactType"]: blob(json.loads(blob(m["digest"]))["layers"][0]["digest"])
                 for m in index if "artifactType" in m}
    return manifest, json.loads(blob(manifest["config"]["digest"])), artifacts, blob


def _bundle(project, tmp_path, audit, name, serve_args=None):
    definition = load_build_inputs(RepoFiles(pins=project.pins(), images=IMAGES), IMAGE, "v0.20.1", SM).definition
    if serve_args is not None:
        definition = type(definition)(**{**definition.__dict__, "serve_args": tuple(serve_args)})
    factors = key_factors(audit, definition, "linux/amd64")
    write_bundle(tmp_path / name, CACHE, {"key": warm_key(factors), "factors": factors,
                                          "booted": {"serve": ["vllm", "serve", "m"]}, "hardware": {"machine": "x86_64"},
                                          "versions": {"torch": "2.13.0"}, "vllm_cache_dirs": []})
    return tmp_path / name


def test_a_warm_bundle_is_baked_recorded_and_a_planted_one_refused(project, capsys, tmp_path):
    code, cold, err = project.build(capsys, "--oci", str(tmp_path / "cold"))
    assert code == 0, err
    manifest, _, _, blob = _layout(tmp_path / "cold")
    with tarfile.open(fileobj=io.BytesIO(blob(manifest["layers"][-1]["digest"])), mode="r:gz") as tar:
        audit = json.loads(tar.extractfile("opt/kiln/manifest.json").read())
    bundle = _bundle(project, tmp_path, audit, "bundle")

    code, warm, err = project.build(capsys, "--oci", str(tmp_path / "warm"), "--warm", str(bundle))
    assert code == 0, err
    manifest, config, artifacts, blob = _layout(tmp_path / "warm")
    with tarfile.open(fileobj=io.BytesIO(blob(manifest["layers"][-1]["digest"])), mode="r:gz") as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
        assert len({m.mtime for m in tar.getmembers()}) == 1 and {m.uid for m in tar.getmembers()} == {0}
    assert files == CACHE
    assert "VLLM_CACHE_ROOT=/opt/kiln/warm/vllm" in config["config"]["Env"]
    assert "TORCHINDUCTOR_CACHE_DIR=/opt/kiln/warm/inductor" in config["config"]["Env"]
    with tarfile.open(fileobj=io.BytesIO(blob(manifest["layers"][-2]["digest"])), mode="r:gz") as tar:
        warm_audit = json.loads(tar.extractfile("opt/kiln/manifest.json").read())["warm"]
    assert warm_audit["key"] == warm["warm"]["key"] and sorted(warm_audit["files"]) == sorted(CACHE)
    sbom = artifacts["application/vnd.cyclonedx+json"]
    assert JsonStrictValidator(SchemaVersion.V1_6).validate_str(sbom.decode()) is None
    [component] = [c for c in json.loads(sbom)["components"] if c["bom-ref"] == "warm"]
    assert component["version"] == warm["warm"]["key"]
    assert {f"/{path}" for path in CACHE} <= {c["name"] for c in json.loads(sbom)["components"]}
    statement = json.loads(base64.b64decode(json.loads(artifacts["application/vnd.dsse.envelope.v1+json"])["payload"]))
    deps = {d["name"]: d for d in statement["predicate"]["buildDefinition"]["resolvedDependencies"]}
    assert deps["warm cache"]["digest"] == {"sha256": warm["warm"]["record_sha256"]}
    assert statement["predicate"]["buildDefinition"]["internalParameters"]["env"]["VLLM_CACHE_ROOT"] == "/opt/kiln/warm/vllm"

    # the same bundle, the same image
    code, again, err = project.build(capsys, "--oci", str(tmp_path / "again"), "--warm", str(bundle))
    assert code == 0 and again["manifest_digest"] == warm["manifest_digest"], err

    # a bundle made for other serve args: one line, exit 2, nothing written
    planted = _bundle(project, tmp_path, audit, "planted", serve_args=["--max-num-seqs", "8"])
    code, _, err = project.build(capsys, "--oci", str(tmp_path / "refused"), "--warm", str(planted))
    assert code == 2 and not (tmp_path / "refused").exists()
    [line] = err.strip().splitlines()
    assert "a warm cache made for other inputs" in line and "serve_args" in line
