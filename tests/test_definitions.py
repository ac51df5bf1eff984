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


@pytest.mark.network  # reads releases' wheels (verify)
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


@pytest.mark.network  # reads releases' wheels (verify)
def test_verify_image_reports_a_gated_patch_and_passes(capsys, workspace):
    """GATED (like UPSTREAM) leaves the patch out of that pin's build; it does not block it."""
    image(workspace, pins='["v0.20.1", "v0.33.0"]', patches='["P65", "P902"]')
    code, out, err = verify_image(capsys, workspace, "test", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert ("v0.33.0", "P902", "GATED") in {(r["pin"], r["patch"], r["verdict"]) for r in data["patches"]}
    assert data["failures"] == []


@pytest.mark.network  # reads releases' wheels (verify)
def test_verify_image_lists_the_patches_that_block_a_build(capsys, workspace):
    write_patch(workspace / "patchsets", "attention_turboquant", "p904_test.py",
                good_patch(pid="P904").replace('cls("TurboQuantMetadataBuilder")', 'cls("NoSuchBuilder")'))
    image(workspace, pins='["v0.20.1"]', patches='["P65", "P904"]')
    code, out, err = verify_image(capsys, workspace, "test", "--json")
    assert code == 1, err
    failures = json.loads(out)["failures"]
    assert len(failures) == 1 and failures[0].startswith("P904 on v0.20.1: DRIFTED"), failures


@pytest.mark.network  # reads releases' wheels (verify)
def test_repository_image_definitions_load(capsys, monkeypatch):
    said = {}
    for path in sorted(paths.IMAGES.glob("*.toml")):
        code, said[path.stem], err = run(capsys, "verify", "--image", path.stem, "--json")
        assert code == 0, err
    # again: every selection group is read back from the memo (a build's SelectionMemo), none is run
    import kiln.patch.memo

    def run_groups(catalogue, tree, target, groups, *args):
        assert not groups, f"verify --image patched {groups} again, which its memo holds"
        return []

    monkeypatch.setattr(kiln.patch.memo, "_run_groups", run_groups)
    for name, first in said.items():
        assert run(capsys, "verify", "--image", name, "--json")[:2] == (0, first)
    # --no-memo runs the selection whole, with the same verdicts
    monkeypatch.undo()
    name = next(iter(said))
    assert run(capsys, "verify", "--image", name, "--json", "--no-memo")[:2] == (0, said[name])


# --- [[files]]: repository files baked into the image ---------------------------------------

def _baked(workspace, files: str, args: str = "", template: bytes = b"{{ messages }}\n"):
    (workspace / "images" / "files").mkdir(exist_ok=True)
    (workspace / "images" / "files" / "chat.jinja").write_bytes(template)
    path = image(workspace)
    path.write_text(path.read_text() + files + (f"\n[serve]\nargs = {args}\n" if args else ""))
    return path


def _load(workspace):
    from kiln.definitions import load_definition
    from kiln.patch.catalog import load_catalogue
    from kiln.pins import load_pins
    return load_definition(workspace / "images", "test", load_catalogue(workspace / "patchsets"),
                           load_pins(workspace / "pins.toml"))


FILE = '\n[[files]]\nsource = "files/chat.jinja"\npath = "{path}"\n'


def test_baked_file_loads_with_its_bytes_and_sha256(workspace):
    import hashlib
    _baked(workspace, FILE.format(path="/opt/kiln/chat-templates/x.jinja"),
           args='["--chat-template", "/opt/kiln/chat-templates/x.jinja"]', template=b"tmpl\n")
    [baked] = _load(workspace).files
    assert (baked.source, baked.path, baked.data) == ("files/chat.jinja", "/opt/kiln/chat-templates/x.jinja", b"tmpl\n")
    assert baked.sha256 == hashlib.sha256(b"tmpl\n").hexdigest()


@pytest.mark.parametrize("path,why", [
    ("opt/kiln/x.jinja", "must be a normalised absolute path under /opt/kiln/"),
    ("/usr/lib/python3/dist-packages/x.py", "must be a normalised absolute path under /opt/kiln/"),
    ("/opt/kiln/../../etc/passwd", "must be a normalised absolute path under /opt/kiln/"),
    ("/opt/kiln//x.jinja", "must be a normalised absolute path under /opt/kiln/"),
    ("/opt/kiln/my template.jinja", "must be a normalised absolute path under /opt/kiln/"),
    ("/opt/kiln/manifest.json", "is kiln's own record in the image"),
    ("/opt/kiln/triton-cache/x", "is kiln's own record in the image"),
])
def test_baked_file_path_is_refused_in_one_line(capsys, workspace, path, why):
    _baked(workspace, FILE.format(path=path))
    code, _, err = verify_image(capsys, workspace)
    assert code == 2
    line = one_line_error(err)
    assert "test.toml: files[0].path:" in line and why in line, line


@pytest.mark.parametrize("source,why", [
    ("files/missing.jinja", "no such file"),
    ("../pins.toml", "must be a path inside"),
    ("/etc/hostname", "must be a path inside"),
])
def test_baked_file_source_is_refused_in_one_line(capsys, workspace, source, why):
    _baked(workspace, f'\n[[files]]\nsource = "{source}"\npath = "/opt/kiln/x"\n')
    code, _, err = verify_image(capsys, workspace)
    assert code == 2
    line = one_line_error(err)
    assert "files[0].source:" in line and why in line, line


def test_baked_file_source_symlink_out_of_images_is_refused(workspace):
    from kiln.errors import KilnError
    _baked(workspace, FILE.format(path="/opt/kiln/x"))
    target = workspace / "images" / "files" / "chat.jinja"
    target.unlink()
    target.symlink_to(workspace / "pins.toml")
    with pytest.raises(KilnError, match=r"files\[0\]\.source: 'files/chat.jinja' must be a path inside"):
        _load(workspace)


def test_two_files_baked_at_one_path_are_refused(workspace):
    from kiln.errors import KilnError
    _baked(workspace, FILE.format(path="/opt/kiln/x") * 2)
    with pytest.raises(KilnError, match="files: two entries bake /opt/kiln/x"):
        _load(workspace)


def test_unknown_key_in_files_is_refused(capsys, workspace):
    _baked(workspace, FILE.format(path="/opt/kiln/x") + 'mode = "0755"\n')
    code, _, err = verify_image(capsys, workspace)
    assert code == 2 and "mode" in one_line_error(err)


@pytest.mark.parametrize("args", ['["--chat-template", "/opt/kiln/other.jinja"]',
                                  '["--chat-template=/opt/kiln/other.jinja"]'])
def test_chat_template_must_name_a_baked_file(capsys, workspace, args):
    _baked(workspace, FILE.format(path="/opt/kiln/x.jinja"), args=args)
    code, _, err = verify_image(capsys, workspace)
    assert code == 2
    line = one_line_error(err)
    assert "serve.args: --chat-template /opt/kiln/other.jinja is not a file the image bakes" in line, line
    assert "/opt/kiln/x.jinja" in line


def test_chat_template_outside_kiln_dir_is_left_to_the_base(workspace):
    # a base image's own template (vLLM images ship examples/*.jinja) is not kiln's to check
    _baked(workspace, "", args='["--chat-template", "/vllm-workspace/examples/tool_chat_template.jinja"]')
    assert _load(workspace).files == ()


def test_shipped_qwen_images_bake_the_chat_template_they_serve_with(capsys):
    from kiln.definitions import load_definition
    from kiln.patch.catalog import load_catalogue
    from kiln.pins import load_pins
    catalogue, pins = load_catalogue(paths.REPO / "patchsets"), load_pins(paths.PINS)
    for name in ("qwen3.6-27b-tq", "qwen3.6-35b-a3b-fp8"):
        definition = load_definition(paths.IMAGES, name, catalogue, pins)
        args = list(definition.serve_args)
        template = args[args.index("--chat-template") + 1]
        [baked] = [f for f in definition.files if f.path == template]
        assert baked.data == (paths.IMAGES / "files" / "chat-templates" / "qwen3.6.jinja").read_bytes()


@pytest.mark.network  # reads releases' wheels (verify)
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
    text = " ".join(out.split())
    assert "OUT_OF_RANGE on v0.20.1 (P905)" in text and "a build leaves them out" in text, text
    # what a maintainer does about it (widen written_for, gate the patch) is not the user's business
    assert "written_for" not in out + err and "widen" not in out + err, text
    code, out, err = verify_image(capsys, workspace, "test", "--maintainer")
    assert code == 0, err
    text = " ".join(out.split())
    assert "OUT_OF_RANGE on v0.20.1 (P905)" in text
    assert "(maintainers: " in text and "widen `written_for` or gate the patch" in text, text


@pytest.mark.network  # reads releases' wheels (verify)
def test_an_image_naming_a_renamed_patch_by_its_old_id_selects_it(capsys, workspace):
    """kiln's P98 is Genesis's PN353A: an image definition written before the rename still builds."""
    write_patch(workspace / "patchsets", "attention_turboquant", "pn353a_test.py", good_patch(pid="PN353A"))
    image(workspace, pins='["v0.20.1"]', patches='["P65", "P98"]')
    code, out, err = verify_image(capsys, workspace, "test", "--json")
    assert code == 0, err
    assert ("v0.20.1", "PN353A", "APPLIES") in {(r["pin"], r["patch"], r["verdict"]) for r in json.loads(out)["patches"]}


# -- platforms: per SM, narrowing kiln's table (kiln/data/targets.toml) -------------------------


def _with_platforms(workspace, sms: str, table: str):
    path = image(workspace, sms=sms)
    text = path.read_text().replace("\n[model]", f"\n{table}\n\n[model]", 1)
    path.write_text(text)
    return path


def test_sm_platforms_default_from_the_table_and_an_image_narrows_them(workspace):
    from kiln.targets import SMS, sm_platforms

    assert sorted(SMS) == [75, 80, 86, 87, 89, 90, 100, 103, 110, 120, 121]
    assert {sm: sm_platforms(sm) for sm in (80, 86, 89, 90, 100, 103, 120, 121)} == {
        80: ("linux/amd64",), 86: ("linux/amd64",), 89: ("linux/amd64",),
        90: ("linux/amd64", "linux/arm64"), 100: ("linux/amd64", "linux/arm64"),
        103: ("linux/amd64", "linux/arm64"), 120: ("linux/amd64",), 121: ("linux/arm64",)}
    _with_platforms(workspace, "[86, 90, 121]", 'platforms = { 90 = ["linux/arm64"] }')
    definition = _load(workspace)
    assert [definition.platforms_of(sm) for sm in (86, 90, 121)] == [
        ("linux/amd64",), ("linux/arm64",), ("linux/arm64",)]


@pytest.mark.parametrize("sms,table,why", [
    ("[90, 121]", 'platforms = { 121 = ["linux/amd64"] }',
     "platforms.121: sm_121 does not ship on linux/amd64: DGX Spark (GB10) ships on linux/arm64 only"),
    ("[90]", 'platforms = { 90 = ["linux/riscv64"] }', "platforms.90: 'linux/riscv64' is not a platform kiln knows"),
    ("[90]", 'platforms = { 120 = ["linux/amd64"] }', "platforms.120: sm_120 is not one of the image's sms [90]"),
    ("[90]", 'platforms = { 90 = ["arm64"] }', "platforms.90[0]: 'arm64' is not a platform like 'linux/arm64'"),
    ("[90]", 'platforms = { sm90 = ["linux/amd64"] }', "platforms"),
    ("[90]", 'platforms = { 90 = [] }', "platforms.90: must not be empty"),
    ("[90]", 'platforms = { 90 = ["linux/amd64", "linux/amd64"] }', "platforms.90: lists a platform twice"),
])
def test_a_platform_pair_that_does_not_exist_is_refused_in_one_line(capsys, workspace, sms, table, why):
    _with_platforms(workspace, sms, table)
    code, _, err = verify_image(capsys, workspace)
    assert code == 2
    line = one_line_error(err)
    assert "test.toml: " in line and why in line, line
