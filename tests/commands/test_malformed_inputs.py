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

KERNELS = """\
[model.kernels]
launchers = ["turboquant_store"]
head_dim = 128
num_heads = 8
num_kv_heads = 2
block_sizes = [16]
max_model_len = 8192
max_num_seqs = 4

"""

PIN_1 = '[pins."v1"]\nrole="current"\nimage="a/b:c"\nvllm="0.20.1"\ncuda="cu130"\n'

# (file kind, the file's text, what the error line names besides the file's path)
CASES: dict[str, tuple[str, str, str]] = {
    # pins.toml
    "pins: not toml": ("pins", "[pins.x\n", "not valid TOML"),
    "pins: no pins": ("pins", "# nothing\n", "pins: missing [pins] table"),
    "pins: empty pins table": ("pins", "[pins]\n", "pins: must not be empty"),
    "pins: unknown top-level key": ("pins", "colour = 1\n" + PIN_1, "colour: unknown key; valid: [pins]"),
    "pins: misspelt pins table": ("pins", PIN_1.replace("[pins.", "[pin."), "[pin]: unknown table; did you mean [pins]?"),
    "pins: pin not a table": ("pins", "[pins]\nv1 = 3\n", "pins.v1: expected a table, not the integer 3"),
    "pins: missing image": ("pins", PIN_1.replace('image="a/b:c"\n', ""), "pins.v1.image"),
    "pins: bad role": ("pins", PIN_1.replace('"current"', '"stable"'), "pins.v1.role"),
    "pins: bad version": ("pins", PIN_1.replace('"0.20.1"', '"latest"'), "pins.v1.vllm"),
    "pins: bad cuda": ("pins", PIN_1.replace('"cu130"', '"13"'), "pins.v1.cuda"),
    "pins: bad digest": ("pins", PIN_1 + 'digest="sha256:xyz"\n', "pins.v1.digest"),
    "pins: digest not a string": ("pins", PIN_1 + "digest=5\n", "pins.v1.digest"),
    "pins: unknown field": ("pins", PIN_1 + 'colour="red"\n', "pins.v1.colour: unknown key; valid: pins.v1.role"),
    "pins: misspelt field": ("pins", PIN_1 + 'digets=""\n', "pins.v1.digets: unknown key; did you mean pins.v1.digest?"),
    "pins: two current": ("pins", PIN_1 + PIN_1.replace("v1", "v2"), "more than one pin has role 'current'"),
    "pins: cpu flavour on a GPU pin": ("pins", PIN_1.replace('"cu130"', '"cpu"'), "pins.v1.cuda: 'cpu' is for a pin with role 'cpu'"),
    "pins: cpu pin with a CUDA flavour": ("pins", PIN_1.replace('"current"', '"cpu"'), "pins.v1.cuda: 'cu130'; a pin with role 'cpu' has cuda = 'cpu'"),
    "pins: two cpu pins": ("pins", (PIN_1 + PIN_1.replace("v1", "v2")).replace('"current"', '"cpu"').replace('"cu130"', '"cpu"'),
                           "more than one pin has role 'cpu'"),
    "pins: bad wheel project": ("pins", PIN_1 + 'wheel="vllm cpu"\n', "pins.v1.wheel"),
    "pins: third GPU pin": ("pins", PIN_1 + PIN_1.replace("v1", "v2").replace("current", "rollback")
                            + PIN_1.replace("v1", "v3").replace("current", "rollback"), "pins.v3: a third GPU pin"),
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
    "image: sms not integers": ("image", IMAGE.replace("[86, 89]", '["86"]'), "sms[0]: expected an integer, not the string '86'"),
    "image: sms a string": ("image", IMAGE.replace("[86, 89]", '"90"'), "sms: expected a list of integers, not the string '90'"),
    "image: sms floats": ("image", IMAGE.replace("[86, 89]", '[86.0]'), "sms[0]: expected an integer, not the float 86.0"),
    "image: unknown top-level key": ("image", IMAGE.replace("tag = ", 'colour = "red"\ntag = '), "colour: unknown key; valid: "),
    "image: misspelt top-level key": ("image", IMAGE.replace("patches = ", "patchs = "), "patchs: unknown key; did you mean patches?"),
    "image: unknown table": ("image", IMAGE + "[evil]\nx = 1\n", "[evil]: unknown table; valid: [platforms], [model], [serve]"),
    "image: [serv] for [serve]": ("image", IMAGE.replace("[serve]", "[serv]"), "[serv]: unknown table; did you mean [serve]?"),
    "image: misspelt model table": ("image", IMAGE.replace("[model]", "[modle]"), "[modle]: unknown table; did you mean [model]?"),
    "image: unknown key in [model]": ("image", IMAGE.replace("kv_cache_dtype =", "kv_cache_dtyp ="),
                                      "model.kv_cache_dtyp: unknown key; did you mean model.kv_cache_dtype?"),
    "image: unknown key in [model.kernels]": ("image", IMAGE.replace("[serve]", KERNELS.replace("head_dim", "head_dims") + "[serve]"),
                                              "model.kernels.head_dims: unknown key; did you mean model.kernels.head_dim?"),
    "image: unknown key in [serve]": ("image", IMAGE.replace("args = ", "arg = "), "serve.arg: unknown key; did you mean serve.args?"),
    "image: serve.env value not a string": ("image", IMAGE + "[serve.env]\nOMP_NUM_THREADS = 1\n",
                                            "serve.env.OMP_NUM_THREADS: expected a string, not the integer 1"),
    "image: serve.env bad name": ("image", IMAGE + '[serve.env]\n"OMP-THREADS" = "1"\n',
                                  "serve.env: 'OMP-THREADS' is not an environment variable name"),
    "image: kernels not a table": ("image", IMAGE.replace("[serve]", "kernels = 3\n[serve]"),
                                   "model.kernels: expected a table, not the integer 3"),
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
    "image: baked file shadowing the base": ("image", IMAGE + '[[files]]\nsource = "test.toml"\npath = "/usr/bin/python3"\n',
                                             "files[0].path: '/usr/bin/python3' must be a normalised absolute path under /opt/kiln/"),
    "image: baked file outside images/": ("image", IMAGE + '[[files]]\nsource = "../pins.toml"\npath = "/opt/kiln/x"\n',
                                          "files[0].source: '../pins.toml' must be a path inside"),
    "image: unknown key in [[files]]": ("image", IMAGE + '[[files]]\nsource = "test.toml"\npath = "/opt/kiln/x"\nmod = "0755"\n',
                                        "files[0].mod: unknown key"),
    "image: --chat-template not baked": ("image", IMAGE.replace('"8192"]', '"8192", "--chat-template", "/opt/kiln/t.jinja"]'),
                                         "serve.args: --chat-template /opt/kiln/t.jinja is not a file the image bakes"),
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


@pytest.mark.network  # reads releases' wheels (verify)
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


# The registries config ($KILN_REGISTRIES): refused before any registry is contacted.
REGISTRIES: dict[str, tuple[str, str]] = {
    "misspelt mirrors table": ('[mirror]\n"docker.io" = "127.0.0.1:5000"\n', "[mirror]: unknown table; did you mean [mirrors]?"),
    "misspelt insecure key": ('insecur = ["127.0.0.1:5000"]\n', "insecur: unknown key; did you mean insecure?"),
    "insecure not a list": ('insecure = "127.0.0.1:5000"\n', "insecure: expected a list of strings, not the string"),
    "mirror not a string": ('[mirrors]\n"docker.io" = 5000\n', 'mirrors."docker.io": expected a string, not the integer 5000'),
    "insecure host not a string": ("insecure = [5000]\n", "insecure[0]: expected a string, not the integer 5000"),
}


@pytest.mark.parametrize("case", sorted(REGISTRIES))
def test_malformed_registries_config_is_one_line_naming_file_and_key(capsys, workspace, monkeypatch, case):
    text, expected = REGISTRIES[case]
    config = workspace / "registries.toml"
    config.write_text(text)
    monkeypatch.setenv("KILN_REGISTRIES", str(config))
    before = (workspace / "pins.toml").read_bytes()
    code, out, err = run(capsys, "--pins", workspace / "pins.toml", "pin", "lock", "--json")
    assert code == 2
    line = one_line_error(err)
    assert f"{config}: {expected}" in line, line
    assert out == "" and (workspace / "pins.toml").read_bytes() == before
