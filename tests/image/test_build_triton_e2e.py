"""``build.py build`` with an ahead-of-time Triton kernel cache, against a real docker-registry.

The base is the fixture image with Triton 3.6.0's dist-info (``v0.20.1-triton36``): the build
reads the version from it, compiles the image's kernels for the SM with the project's Triton,
and adds the cache as one more layer at ``/opt/kiln/triton-cache`` with ``TRITON_CACHE_DIR``.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import sys
import tarfile
from pathlib import Path

import pytest
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator

from kiln.triton.imagekey import LIBTRITON, record_hashes
from kiln.triton.toolchain import _choose_wheel
from tests.support import TEST_IMAGES
from tests.support.kiln_process import run_kiln
from tests.support.registry import TRITON_CP312_RECORD, TRITON_CP312_RECORDS, VLLM_VERSION

pytestmark = pytest.mark.registry

IMAGES = TEST_IMAGES
IMAGE = "e2e-triton"


def _pins(root: Path, registry, variant: str) -> Path:
    name = f"vllm/vllm-openai:v{VLLM_VERSION}-{variant}"
    path = root / f"pins-{variant}.toml"
    path.write_text('[pins."v0.20.1"]\nrole = "current"\n'
                    f'image = "docker.io/{name}"\nvllm = "{VLLM_VERSION}"\ncuda = "cu130"\n'
                    f'digest = "{registry.digest_of(name)}"\n')
    return path


def _build(capsys, pins: Path, registry, sm: int, *extra: str):
    code, out, err = run_kiln("--pins", pins, "--images", IMAGES, "build", "--image", IMAGE, "--pin", "v0.20.1",
                          "--sm", sm, "--mirror", registry.mirror, "--json", *extra)
    return code, (json.loads(out) if code == 0 else None), err


def _blob(layout: Path, digest: str) -> bytes:
    data = (layout / "blobs/sha256" / digest.split(":")[1]).read_bytes()
    assert "sha256:" + hashlib.sha256(data).hexdigest() == digest
    return data


def _image(layout: Path) -> tuple[dict, dict]:
    [entry] = [m for m in json.loads((layout / "index.json").read_text())["manifests"] if "artifactType" not in m]
    manifest = json.loads(_blob(layout, entry["digest"]))
    return manifest, json.loads(_blob(layout, manifest["config"]["digest"]))


def test_build_adds_a_checked_kernel_cache_layer(tmp_path, capsys, registry_plain):
    pins = _pins(tmp_path, registry_plain, "triton36")
    code, first, err = _build(capsys, pins, registry_plain, 120, "--oci", str(tmp_path / "one"))
    assert code == 0, err
    manifest, config = _image(tmp_path / "one")
    assert "TRITON_CACHE_DIR=/opt/kiln/triton-cache" in config["config"]["Env"]
    assert config["history"][-1]["created_by"].startswith("kiln triton cache e2e-triton sm120:")
    top = manifest["layers"][-1]
    raw = gzip.decompress(_blob(tmp_path / "one", top["digest"]))
    assert config["rootfs"]["diff_ids"][-1] == "sha256:" + hashlib.sha256(raw).hexdigest()
    with tarfile.open(tmp_path / "one/blobs/sha256" / top["digest"].split(":")[1], "r:gz") as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    cubins = [n for n in files if n.endswith(".cubin")]
    assert cubins and all(n.startswith("opt/kiln/triton-cache/") for n in cubins)
    for name, data in files.items():
        if "/__grp__" in name:
            for path in json.loads(data)["child_paths"].values():
                assert path.lstrip("/") in files  # the runtime path of a file the layer holds
    audit = json.loads(files["opt/kiln/triton-kernels.json"])
    assert audit["sm"] == 120 and audit["triton"]["version"] == "3.6.0" and audit["not_built"] == []
    assert first["triton"]["sm"] == 120 and first["triton"]["kernels"] == len(cubins)
    assert {"_tq_fused_store_fp8", "_tq_decode_stage1", "_fwd_kernel_stage2"} <= set(first["triton"]["kernel_names"])
    # the fixture base runs Python 3.12 (its site dir says so) with the real cp312 wheel's
    # RECORD; kiln compiles with the wheel for its own Python and keys every entry as the
    # image's Triton does: with the cp312 libtriton.so's sha256, whatever Python kiln runs
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    image_libtriton = record_hashes(TRITON_CP312_RECORD.read_text())[LIBTRITON]
    assert first["triton"]["image_python"] == "3.12"
    assert first["triton"]["triton_wheel"].startswith(f"triton-3.6.0-cp{here.replace('.', '')}-")
    assert first["triton"]["keyed_for_image"] is True
    assert first["triton"]["libtriton_sha256"] == image_libtriton
    assert audit["triton"]["keyed_for_libtriton_sha256"] == image_libtriton
    assert "would never read these kernels" not in err and "warning:" not in err, err
    # the SBOM beside the image lists each kernel with its SM and toolchain (docs/TRUST.md)
    index = json.loads((tmp_path / "one/index.json").read_text())["manifests"]
    [sbom_entry] = [m for m in index if m.get("artifactType") == "application/vnd.cyclonedx+json"]
    sbom_manifest = json.loads(_blob(tmp_path / "one", sbom_entry["digest"]))
    sbom = _blob(tmp_path / "one", sbom_manifest["layers"][0]["digest"])
    assert JsonStrictValidator(SchemaVersion.V1_6).validate_str(sbom.decode()) is None
    bom = json.loads(sbom)
    kernels = {c["name"]: {p["name"]: p["value"] for p in c["properties"]} for c in bom["components"]
               if c["name"].startswith("triton kernel ")}
    assert set(kernels) == {f"triton kernel {name}" for name in first["triton"]["kernel_names"]}
    # the wheel's sha256 is the one PyPI states for the file it serves (asked here, not kiln's record)
    _, served_sha256 = _choose_wheel("3.6.0", "test")
    assert len(served_sha256) == 64 and first["triton"]["triton_wheel_sha256"] == served_sha256
    assert audit["triton"]["wheel_sha256"] == served_sha256
    for props in kernels.values():
        assert props["kiln:sm"] == "120" and props["kiln:triton"] == "3.6.0"
        assert props["kiln:triton_wheel"] == first["triton"]["triton_wheel"]
        assert props["kiln:triton_wheel_sha256"] == served_sha256
        assert len(props["kiln:triton_record_sha256"]) == 64
    [toolchain] = [c for c in bom["components"] if c["bom-ref"] == "triton-toolchain"]
    assert toolchain["hashes"] == [{"alg": "SHA-256", "content": served_sha256}]
    assert toolchain["purl"] == f"pkg:pypi/triton@3.6.0?file_name={first['triton']['triton_wheel']}"
    # and the provenance (an unsigned DSSE envelope here) lists the wheel by that digest
    [dsse_entry] = [m for m in index if m.get("artifactType") == "application/vnd.dsse.envelope.v1+json"]
    dsse_manifest = json.loads(_blob(tmp_path / "one", dsse_entry["digest"]))
    envelope = json.loads(_blob(tmp_path / "one", dsse_manifest["layers"][0]["digest"]))
    statement = json.loads(base64.b64decode(envelope["payload"]))
    deps = {d["name"]: d for d in statement["predicate"]["buildDefinition"]["resolvedDependencies"]}
    assert deps["triton toolchain"]["digest"] == {"sha256": served_sha256}
    assert deps["triton toolchain"]["uri"] == toolchain["purl"]

    # same inputs, same digests: a second build (kernel entries now from the kiln cache)
    code, second, err = _build(capsys, pins, registry_plain, 120, "--oci", str(tmp_path / "two"))
    assert code == 0, err
    assert second["triton"]["from_cache"] and second["triton"]["compiled"] == 0
    assert second["manifest_digest"] == first["manifest_digest"]


def test_sm86_bf16_build_warns_and_records_the_missing_store_kernel(tmp_path, capsys, registry_plain):
    pins = _pins(tmp_path, registry_plain, "triton36")
    code, result, err = _build(capsys, pins, registry_plain, 86, "--oci", str(tmp_path / "out"))
    assert code == 0, err
    assert "warning:" in err and "turboquant_store" in err and "sm_86" in err
    [failure] = result["triton"]["not_built"]
    assert failure["kernel"] == "turboquant_store" and "float8e4b15" in failure["error"]
    assert "_tq_decode_stage1" in result["triton"]["kernel_names"]


@pytest.mark.reliability
def test_a_base_with_triton_3_8_0_gets_kernels_keyed_for_it(tmp_path, capsys, registry_plain):
    """vLLM 0.33.0's Triton (the current pin): its cp311 and cp312 wheels differ in plugins/
    files triton_key() never reads; the build keys the layer for the image's cp312 Triton."""
    pins = _pins(tmp_path, registry_plain, "triton38")
    code, result, err = _build(capsys, pins, registry_plain, 120, "--oci", str(tmp_path / "out"))
    assert code == 0, err
    assert "warning:" not in err, err
    here = f"{sys.version_info.major}{sys.version_info.minor}"
    assert result["triton"]["triton"] == "3.8.0" and result["triton"]["triton_wheel"].startswith(f"triton-3.8.0-cp{here}-")
    assert result["triton"]["keyed_for_image"] is True and result["triton"]["kernels"] > 0
    assert result["triton"]["libtriton_sha256"] == record_hashes(TRITON_CP312_RECORDS["3.8.0"].read_text())[LIBTRITON]
    _, config = _image(tmp_path / "out")
    assert "TRITON_CACHE_DIR=/opt/kiln/triton-cache" in config["config"]["Env"]


@pytest.mark.reliability
def test_a_kernel_layer_the_image_cannot_use_fails_the_build_or_is_left_out(tmp_path, capsys, registry_plain):
    """Never "built", exit 0 and a layer the image never reads: one line, exit 2, nothing
    written; with --without-unusable-kernels the image is built without the layer, said so."""
    pins = _pins(tmp_path, registry_plain, "tritonvendor")
    code, _, err = _build(capsys, pins, registry_plain, 120, "--oci", str(tmp_path / "out"))
    assert code == 2 and not (tmp_path / "out").exists()
    [line] = err.strip().splitlines()[-1:]
    assert line.startswith(f"error: {IMAGES / IMAGE}.toml: model.kernels: sm_120: the image's Triton is not the PyPI "
                           "wheel kiln compiles with: 1 file(s) differ (triton/language/core.py)"), err
    assert line.endswith("pass --without-unusable-kernels to build without them") and "built" not in err

    code, result, err = _build(capsys, pins, registry_plain, 120, "--oci", str(tmp_path / "out"),
                               "--without-unusable-kernels")
    assert code == 0, err
    assert result["triton"] == {"sm": 120, "left_out": True, "keyed_for_image": False}
    assert "the kernel layer is left out (--without-unusable-kernels)" in err
    manifest, config = _image(tmp_path / "out")
    assert not any(e.startswith("TRITON_CACHE_DIR=") for e in config["config"].get("Env") or [])
    assert not any(h.get("created_by", "").startswith("kiln triton cache") for h in config["history"])


def test_base_without_triton_fails_naming_the_image(tmp_path, capsys, registry_plain):
    pins = _pins(tmp_path, registry_plain, "notriton")
    code, _, err = _build(capsys, pins, registry_plain, 120, "--oci", str(tmp_path / "out"), "--push",
                          "--repository", f"{registry_plain.host}/test/e2e-notriton")  # a push check passes
    assert code == 2
    assert f"error: docker.io/vllm/vllm-openai:v{VLLM_VERSION}-notriton@sha256:" in err
    assert ": base image has no Triton" in err
    assert not (tmp_path / "out").exists()
    import requests

    tags = requests.get(f"{registry_plain.url}/v2/test/e2e-notriton/tags/list", timeout=10)
    assert tags.status_code == 404 or not tags.json().get("tags")


SHIFT_PATCH = '''
import libcst.matchers as m

from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import func, insert_after, marked, statements, with_marker


class ShiftDecodeKernels(Codemod):
    target = "v1/attention/ops/triton_turboquant_decode.py"
    anchor = (func("_use_fp8_e4b15"),)
    patched = (m.SimpleStatementLine(leading_lines=marked("P999")),)

    def rewrite(self, node):
        (line,) = statements("KILN_TEST_SHIFT = 1\\n")
        return insert_after(node, with_marker(line, "P999", "moves the decode kernels down"))


class P999(Patch):
    id, family, title, why = "P999", "kernelshift", "t", "a patch on a file the kernels compile from"
    edits = (ShiftDecodeKernels,)
'''


def test_kernels_compile_beside_the_patching_from_the_patched_text_of_their_sources(tmp_path, capsys,
                                                                                    registry_plain):
    """Beside the patching either way: once the patches of the files they read are done, from
    their text (P999 shifts the decode kernels: other kernels, another key)."""
    import shutil

    from kiln import paths

    pins = _pins(tmp_path, registry_plain, "triton36")
    code, plain, err = _build(capsys, pins, registry_plain, 120, "--oci", str(tmp_path / "plain"))
    assert code == 0, err
    assert plain["triton"]["beside_patching"] is True  # P65 is not in a file the kernels read

    patchsets = tmp_path / "patchsets"
    shutil.copytree(paths.PATCHSETS, patchsets, ignore=shutil.ignore_patterns("__pycache__"))
    (patchsets / "kernelshift").mkdir()
    (patchsets / "kernelshift" / "p999_shift.py").write_text(SHIFT_PATCH)
    images = tmp_path / "images"
    images.mkdir()
    (images / f"{IMAGE}.toml").write_text((IMAGES / f"{IMAGE}.toml").read_text().replace(
        'patches = ["P65"]', 'patches = ["P65", "P999"]'))
    code, out, err = run_kiln("--pins", pins, "--images", images, "--patchsets", patchsets,
                          "build", "--image", IMAGE, "--pin", "v0.20.1", "--sm", "120", "--mirror",
                          registry_plain.mirror, "--json", "--oci", tmp_path / "shifted")
    assert code == 0, err
    shifted = json.loads(out)
    assert shifted["triton"]["beside_patching"] is True  # begun once P999's group was done
    assert shifted["triton"]["key"] != plain["triton"]["key"]  # from the patched file
    assert shifted["triton"]["compiled"] > 0  # the shifted decode kernels are new kernels


def test_an_image_with_a_kernel_layer_is_re_derived_identical_by_check(tmp_path, capsys, registry_plain):
    """``check`` rebuilds the kernel cache layer too (docs/TRUST.md): same bytes, same digest."""
    pins = _pins(tmp_path, registry_plain, "triton36")
    repo = f"{registry_plain.host}/test/trust-triton"
    code, built, err = _build(capsys, pins, registry_plain, 120, "--push", "--repository", repo)
    assert code == 0, err
    code, out, err = run_kiln("--pins", pins, "--images", IMAGES, "check", f"{repo}:{built['tag']}",
                          "--mirror", registry_plain.mirror)
    assert code == 0, err
    assert out.startswith("identical:") and built["manifest_digest"] in out
