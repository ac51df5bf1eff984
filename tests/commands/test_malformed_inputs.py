"""Every malformed input file, one table: ``build`` exits 2 with one line naming the file and the
field, and writes nothing (no output, no cache, no staging directory).

The three kinds of input a user edits -- ``pins.toml``, ``images/<name>.toml`` and a patch
module's metadata -- each start from a valid file of a private workspace; a case replaces one
file and names what the error line must contain.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.cli import P65_FILE, PINS, good_patch, one_line_error, run, write_patch

pytestmark = pytest.mark.reliability

IMAGE = """\
name = "test"
repository = "docker.io/kiln/test"
pins = ["v0.20.1"]
sms = [86, 89]
tag = "{cuda}-sm{sm}-{pin}"
patches = ["P65"]

[model]
id = "org/model"
architectures = ["Qwen3_5ForConditionalGeneration"]
dtype = "float16"
kv_cache_dtype = "turboquant_k8v4"

[serve]
args = ["--max-model-len", "8192"]
"""

PIN_1 = '[pins."v1"]\nrole="current"\nimage="a/b:c"\nvllm="0.20.1"\ncuda="cu130"\n'

# (file kind, the file's text, what the error line names besides the file's path)
CASES: dict[str, tuple[str, str, str]] = {
    # pins.toml
    "pins: not toml": ("pins", "[pins.x\n", "not valid TOML"),
    "pins: no pins": ("pins", "title = 'x'\n", "missing table [pins.<name>]"),
    "pins: unknown top-level key": ("pins", "colour = 1\n" + PIN_1, "unknown top-level key 'colour'"),
    "pins: pin not a table": ("pins", "[pins]\nv1 = 3\n", "pins.v1: must be a table"),
    "pins: missing image": ("pins", PIN_1.replace('image="a/b:c"\n', ""), "pins.v1.image"),
    "pins: bad role": ("pins", PIN_1.replace('"current"', '"stable"'), "pins.v1.role"),
    "pins: bad version": ("pins", PIN_1.replace('"0.20.1"', '"latest"'), "pins.v1.vllm"),
    "pins: bad cuda": ("pins", PIN_1.replace('"cu130"', '"13"'), "pins.v1.cuda"),
    "pins: bad digest": ("pins", PIN_1 + 'digest="sha256:xyz"\n', "pins.v1.digest"),
    "pins: digest not a string": ("pins", PIN_1 + "digest=5\n", "pins.v1.digest"),
    "pins: unknown field": ("pins", PIN_1 + 'colour="red"\n', "pins.v1.colour"),
    "pins: two current": ("pins", PIN_1 + PIN_1.replace("v1", "v2"), "more than one pin has role 'current'"),
    # images/test.toml
    "image: not toml": ("image", IMAGE + "[model\n", "not valid TOML"),
    "image: name differs from file": ("image", IMAGE.replace('name = "test"', 'name = "other"'), "name:"),
    "image: repository missing": ("image", IMAGE.replace('repository = "docker.io/kiln/test"\n', ""), "repository:"),
    "image: tag without sm": ("image", IMAGE.replace("-sm{sm}", ""), "tag:"),
    "image: tag unknown field": ("image", IMAGE.replace("{cuda}", "{arch}"), "tag:"),
    "image: patches empty": ("image", IMAGE.replace('["P65"]', "[]"), "patches:"),
    "image: patch listed twice": ("image", IMAGE.replace('["P65"]', '["P65", "P65"]'), "patches: lists a patch twice"),
    "image: unknown patch": ("image", IMAGE.replace('["P65"]', '["P65", "P404"]'), "patches: unknown patch 'P404'"),
    "image: conflicting patches": ("image", IMAGE.replace('["P65"]', '["P65", "P67b"]'), "conflicts with P67b"),
    "image: gated off for an SM": ("image", IMAGE.replace('["P65"]', '["P901"]'), "P901 is gated off for sm_86"),
    "image: requires not selected": ("image", IMAGE.replace('["P65"]', '["P903"]'), "P903 requires P65"),
    "image: sms not integers": ("image", IMAGE.replace("[86, 89]", '["86"]'), "sms:"),
    "image: unknown SM": ("image", IMAGE.replace("[86, 89]", "[42]"), "sm_42"),
    "image: unknown pin": ("image", IMAGE.replace('pins = ["v0.20.1"]', 'pins = ["v9"]'), "pins: unknown pin 'v9'"),
    "image: no model table": ("image", IMAGE.split("[model]")[0], "model: missing [model] table"),
    "image: architectures empty": ("image", IMAGE.replace('["Qwen3_5ForConditionalGeneration"]', "[]"),
                                   "model.architectures"),
    "image: model dtype missing": ("image", IMAGE.replace('dtype = "float16"\n', ""), "model.dtype"),
    "image: negative speculative tokens": ("image", IMAGE.replace("[serve]", "").replace(
        'kv_cache_dtype = "turboquant_k8v4"', 'kv_cache_dtype = "turboquant_k8v4"\nnum_speculative_tokens = -1\n[serve]'),
        "model.num_speculative_tokens"),
    "image: serve.args not strings": ("image", IMAGE.replace('args = ["--max-model-len", "8192"]', "args = [8192]"),
                                      "serve.args"),
    # patchsets/<family>/p900_test.py
    "patch: missing why": ("patch", good_patch().replace('why = "exercise the error paths"', ""), "P900.why"),
    "patch: bad id": ("patch", good_patch().replace('id = "P900"', 'id = "patch-900"'), ".id"),
    "patch: family mismatch": ("patch", good_patch(family="serving"), ".family"),
    "patch: requires unknown": ("patch", good_patch(extra='requires = ("P404",)'), "requires names unknown patch 'P404'"),
    "patch: anchor not matchers": ("patch", good_patch().replace(
        'anchor = (cls("TurboQuantMetadataBuilder"), assign_to("_cudagraph_support"))',
        'anchor = ("TurboQuantMetadataBuilder",)'), "edits[Edit].anchor"),
    "patch: bad gate": ("patch", good_patch(extra='gates = Gates(vllm="latest")'), ".gates"),
    "patch: import fails": ("patch", "import does_not_exist_anywhere\n", "failed to import: ModuleNotFoundError"),
    "patch: two patches": ("patch", good_patch() + "\nclass Again(P900):\n    pass\n", "exactly one Patch subclass"),
    "patch: id differs from file name": ("patch", good_patch(pid="P65"), "P65.id: 'P65' does not match the file name"),
}


@pytest.fixture
def workspace(tmp_path, monkeypatch) -> Path:
    """A valid private catalogue (P65 + test patches), pins file and image definition."""
    patchsets = tmp_path / "patchsets"
    (patchsets / "attention_turboquant").mkdir(parents=True)
    shutil.copy(P65_FILE, patchsets / "attention_turboquant" / P65_FILE.name)
    write_patch(patchsets, "attention_turboquant", "p67b_test.py", good_patch(pid="P67b"))
    write_patch(patchsets, "attention_turboquant", "p901_test.py", good_patch(pid="P901", extra="gates = Gates(sm_min=89)"))
    write_patch(patchsets, "attention_turboquant", "p903_test.py", good_patch(pid="P903", extra='requires = ("P65",)'))
    (tmp_path / "pins.toml").write_text(PINS)
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "test.toml").write_text(IMAGE)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def test_the_workspace_itself_is_valid(capsys, workspace):
    code, _, err = run(capsys, "--patchsets", workspace / "patchsets", "--pins", workspace / "pins.toml",
                       "--images", workspace / "images", "verify", "--image", "test", "--json")
    assert code == 0, err


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_input_is_one_line_naming_file_and_field(capsys, workspace, case):
    kind, text, expected = CASES[case]
    if kind == "pins":
        bad = workspace / "pins.toml"
        bad.write_text(text)
    elif kind == "image":
        bad = workspace / "images" / "test.toml"
        bad.write_text(text)
    else:
        bad = write_patch(workspace / "patchsets", "attention_turboquant", "p900_test.py", text)
    before = sorted(p for p in workspace.rglob("*") if "__pycache__" not in p.parts)
    code, out, err = run(
        capsys, "--patchsets", workspace / "patchsets", "--pins", workspace / "pins.toml",
        "--images", workspace / "images", "build", "--image", "test", "--pin", "v0.20.1", "--sm", "86",
        "--oci", workspace / "out", "--docker-archive", workspace / "image.tar", "--push", "--json",
    )
    assert code == 2
    line = one_line_error(err)
    assert str(bad) in line and expected in line, line
    assert out == ""
    after = sorted(p for p in workspace.rglob("*") if "__pycache__" not in p.parts)
    assert after == before  # no output, no staging, no cache directory
