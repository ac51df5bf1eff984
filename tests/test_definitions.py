"""Image definitions: validation errors name the image file and the patch; verify --image."""

from __future__ import annotations

import json
import shutil

import pytest

from kiln import paths
from tests.support.cli import P65_FILE, PINS, good_patch, one_line_error, run, write_patch

IMAGE = """\
name = "{name}"
repository = "docker.io/kiln/test"
pins = {pins}
sms = {sms}
tag = "{{cuda}}-sm{{sm}}-{{pin}}"
patches = {patches}

[model]
id = "org/model"
architectures = ["Qwen3_5ForConditionalGeneration"]
dtype = "float16"
kv_cache_dtype = "turboquant_k8v4"
"""



@pytest.fixture
def workspace(tmp_path):
    """A private catalogue (P65 + test patches), pins file and images directory."""
    patchsets = tmp_path / "patchsets"
    (patchsets / "attention_turboquant").mkdir(parents=True)
    shutil.copy(P65_FILE, patchsets / "attention_turboquant" / P65_FILE.name)
    write_patch(patchsets, "attention_turboquant", "p67b_test.py", good_patch(pid="P67b"))
    write_patch(patchsets, "attention_turboquant", "p901_test.py", good_patch(pid="P901", extra="gates = Gates(sm_min=89)"))
    write_patch(patchsets, "attention_turboquant", "p902_test.py", good_patch(pid="P902", extra='gates = Gates(vllm="<0.30")'))
    write_patch(patchsets, "attention_turboquant", "p903_test.py", good_patch(pid="P903", extra='requires = ("P65",)'))
    pins = tmp_path / "pins.toml"
    pins.write_text(PINS)
    images = tmp_path / "images"
    images.mkdir()
    return tmp_path


def image(workspace, name="test", pins='["v0.20.1"]', sms="[86, 89]", patches='["P65"]'):
    path = workspace / "images" / f"{name}.toml"
    path.write_text(IMAGE.format(name=name, pins=pins, sms=sms, patches=patches))
    return path


def verify_image(capsys, workspace, name="test", *extra):
    return run(
        capsys,
        "--patchsets", workspace / "patchsets",
        "--pins", workspace / "pins.toml",
        "--images", workspace / "images",
        "verify", "--image", name, *extra,
    )


# Malformed image definitions: tests/test_malformed_inputs.py.


def test_unknown_image(capsys, workspace):
    code, _, err = verify_image(capsys, workspace, "nope")
    assert code == 2
    assert "unknown image 'nope'" in one_line_error(err)


def test_verify_image_passes_when_every_patch_applies(capsys, workspace):
    image(workspace, patches='["P65", "P903"]')
    code, out, err = verify_image(capsys, workspace, "test", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert {(r["pin"], r["patch"], r["verdict"]) for r in data["patches"]} == {
        ("v0.20.1", "P65", "APPLIES"),
        ("v0.20.1", "P903", "APPLIES"),
    }
    assert data["failures"] == []


def test_verify_image_reports_a_gated_patch_and_passes(capsys, workspace):
    """GATED (like UPSTREAM) leaves the patch out of that pin's build; it does not block it."""
    image(workspace, pins='["v0.20.1", "v0.33.0"]', patches='["P65", "P902"]')
    code, out, err = verify_image(capsys, workspace, "test", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert ("v0.33.0", "P902", "GATED") in {(r["pin"], r["patch"], r["verdict"]) for r in data["patches"]}
    assert data["failures"] == []


def test_verify_image_lists_the_patches_that_block_a_build(capsys, workspace):
    write_patch(workspace / "patchsets", "attention_turboquant", "p904_test.py",
                good_patch(pid="P904").replace('cls("TurboQuantMetadataBuilder")', 'cls("NoSuchBuilder")'))
    image(workspace, pins='["v0.20.1"]', patches='["P65", "P904"]')
    code, out, err = verify_image(capsys, workspace, "test", "--json")
    assert code == 1, err
    failures = json.loads(out)["failures"]
    assert len(failures) == 1 and failures[0].startswith("P904 on v0.20.1: DRIFTED"), failures


def test_repository_image_definitions_load(capsys):
    for path in sorted(paths.IMAGES.glob("*.toml")):
        code, _, err = run(capsys, "verify", "--image", path.stem)
        assert code == 0, err


def test_verify_image_explains_a_patch_out_of_its_range_and_passes(capsys, workspace):
    """OUT_OF_RANGE (the pin's release is outside what the patch was written for) leaves the
    patch out without blocking the build, and verify says what that means, naming the patch."""
    write_patch(workspace / "patchsets", "attention_turboquant", "p905_test.py",
                good_patch(pid="P905", extra='written_for = ">=0.30"'))
    image(workspace, pins='["v0.20.1"]', patches='["P65", "P905"]')
    code, out, err = verify_image(capsys, workspace, "test", "--json")
    assert code == 0, err
    data = json.loads(out)
    row = next(r for r in data["patches"] if r["patch"] == "P905")
    assert row["verdict"] == "OUT_OF_RANGE" and "written for vllm>=0.30; this is 0.20.1" in row["detail"]
    assert data["failures"] == []
    code, out, err = verify_image(capsys, workspace, "test")
    assert code == 0, err
    assert "OUT_OF_RANGE on v0.20.1 (P905)" in " ".join(out.split())


def test_an_image_naming_a_renamed_patch_by_its_old_id_selects_it(capsys, workspace):
    """kiln's P98 is Genesis's PN353A: an image definition written before the rename still builds."""
    write_patch(workspace / "patchsets", "attention_turboquant", "pn353a_test.py", good_patch(pid="PN353A"))
    image(workspace, pins='["v0.20.1"]', patches='["P65", "P98"]')
    code, out, err = verify_image(capsys, workspace, "test", "--json")
    assert code == 0, err
    assert ("v0.20.1", "PN353A", "APPLIES") in {(r["pin"], r["patch"], r["verdict"]) for r in json.loads(out)["patches"]}
