"""Bad input: one line naming the culprit, exit code 2, and nothing half-written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kiln import paths
from kiln.cli import main

P65_FILE = next(paths.PATCHSETS.glob("attention_turboquant/p65_*.py"))


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.fixture
def patchsets(tmp_path):
    """A private catalogue holding a copy of P65, to which tests add broken modules."""
    root = tmp_path / "patchsets"
    (root / "attention_turboquant").mkdir(parents=True)
    shutil.copy(P65_FILE, root / "attention_turboquant" / P65_FILE.name)
    return root


def write_patch(root: Path, family: str, filename: str, body: str) -> Path:
    (root / family).mkdir(exist_ok=True)
    path = root / family / filename
    path.write_text(body)
    return path


GOOD_PATCH = """\
import libcst as cst
import libcst.matchers as m
from kiln.patch.model import Codemod, Gates, Patch
from kiln.patch.shapes import assign_to, cls, func, insert_after, marked, statements, with_marker


class Edit(Codemod):
    target = "v1/attention/backends/turboquant_attn.py"
    anchor = (cls("TurboQuantMetadataBuilder"), assign_to("_cudagraph_support"))
    patched = (cls("TurboQuantMetadataBuilder"), {patched})

    def rewrite(self, node):
        (stmt,) = statements({code!r})
        return insert_after(node, with_marker(stmt, "{pid}", "test"))


class {pid}(Patch):
    id = "{pid}"
    family = "{family}"
    title = "test patch"
    why = "exercise the error paths"
    edits = (Edit,)
    {extra}
"""


def good_patch(pid="P900", family="attention_turboquant", code="def helper(self):\n    return 1\n", extra="", patched=None):
    patched = patched or f'func("helper", leading_lines=marked("{pid}"))'
    return GOOD_PATCH.format(pid=pid, family=family, code=code, extra=extra, patched=patched)


def test_unknown_pin(capsys):
    code, _, err = run(capsys, "verify", "--pin", "v9.9.9")
    assert code == 2
    assert "unknown pin 'v9.9.9'" in one_line_error(err)


def test_unknown_patch_id(capsys, tmp_path):
    out = tmp_path / "out"
    code, _, err = run(capsys, "apply", "--pin", "v0.20.1", "--patch", "P999", "--out", out)
    assert code == 2
    assert "unknown patch 'P999'" in one_line_error(err)
    assert not out.exists()


PINS_CASES = {
    "not toml": ("[pins.x\n", "not valid TOML"),
    "no pins": ("title = 'x'\n", "missing table [pins.<name>]"),
    "missing image": ('[pins."v1"]\nrole="current"\nvllm="0.20.1"\ncuda="cu130"\n', "pins.v1.image"),
    "bad role": ('[pins."v1"]\nrole="stable"\nimage="a/b:c"\nvllm="0.20.1"\ncuda="cu130"\n', "pins.v1.role"),
    "bad version": ('[pins."v1"]\nrole="current"\nimage="a/b:c"\nvllm="latest"\ncuda="cu130"\n', "pins.v1.vllm"),
    "bad cuda": ('[pins."v1"]\nrole="current"\nimage="a/b:c"\nvllm="0.20.1"\ncuda="13"\n', "pins.v1.cuda"),
    "bad digest": (
        '[pins."v1"]\nrole="current"\nimage="a/b:c"\nvllm="0.20.1"\ncuda="cu130"\ndigest="sha256:xyz"\n',
        "pins.v1.digest",
    ),
    "unknown field": (
        '[pins."v1"]\nrole="current"\nimage="a/b:c"\nvllm="0.20.1"\ncuda="cu130"\ncolour="red"\n',
        "pins.v1.colour",
    ),
    "two current": (
        '[pins."v1"]\nrole="current"\nimage="a/b:c"\nvllm="0.20.1"\ncuda="cu130"\n'
        '[pins."v2"]\nrole="current"\nimage="a/b:d"\nvllm="0.33.0"\ncuda="cu130"\n',
        "more than one pin has role 'current'",
    ),
}


@pytest.mark.parametrize("case", sorted(PINS_CASES))
def test_malformed_pins_file_names_file_and_field(capsys, tmp_path, case):
    text, expected = PINS_CASES[case]
    pins = tmp_path / "pins.toml"
    pins.write_text(text)
    code, _, err = run(capsys, "--pins", pins, "verify", "--pin", "v1")
    assert code == 2
    line = one_line_error(err)
    assert str(pins) in line and expected in line


METADATA_CASES = {
    "missing why": (good_patch().replace('why = "exercise the error paths"', ""), "P900.why"),
    "bad id": (good_patch().replace('id = "P900"', 'id = "patch-900"'), ".id"),
    "family mismatch": (good_patch(family="serving"), ".family"),
    "requires unknown": (good_patch(extra='requires = ("P404",)'), "requires names unknown patch 'P404'"),
    "anchor not matchers": (good_patch().replace('anchor = (cls("TurboQuantMetadataBuilder"), assign_to("_cudagraph_support"))', 'anchor = ("TurboQuantMetadataBuilder",)'), "edits[Edit].anchor"),
    "bad gate": (good_patch(extra='gates = Gates(vllm="latest")'), ".gates"),
    "import fails": ("import does_not_exist_anywhere\n", "failed to import: ModuleNotFoundError"),
    "two patches": (good_patch() + "\nclass Again(P900):\n    pass\n", "exactly one Patch subclass"),
}


@pytest.mark.parametrize("case", sorted(METADATA_CASES))
def test_malformed_patch_metadata_names_file_and_field(capsys, patchsets, case):
    body, expected = METADATA_CASES[case]
    path = write_patch(patchsets, "attention_turboquant", "p900_test.py", body)
    code, _, err = run(capsys, "--patchsets", patchsets, "patches")
    assert code == 2
    line = one_line_error(err)
    assert str(path) in line and expected in line, line


def test_conflicting_patches_selected(capsys, patchsets, tmp_path):
    write_patch(patchsets, "attention_turboquant", "p67b_test.py", good_patch(pid="P67b"))
    out = tmp_path / "out"
    code, _, err = run(capsys, "--patchsets", patchsets, "apply", "--pin", "v0.20.1", "--patch", "P65", "--patch", "P67b", "--out", out)
    assert code == 2
    line = one_line_error(err)
    assert "P65" in line and "P67b" in line and "conflict" in line
    assert not out.exists()


def test_codemod_output_that_does_not_compile(capsys, patchsets, tmp_path):
    # `return` at class level parses for libcst but is rejected by compile()
    body = good_patch(code="return 1\n", patched='m.SimpleStatementLine(leading_lines=marked("P900"))')
    write_patch(patchsets, "attention_turboquant", "p900_test.py", body)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("previous output")
    code, _, err = run(capsys, "--patchsets", patchsets, "apply", "--pin", "v0.20.1", "--patch", "P900", "--out", out, "--force")
    assert code == 2
    line = one_line_error(err)
    assert "patch P900" in line and "does not compile" in line and "turboquant_attn.py" in line
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]  # untouched
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no staging left


def test_apply_refuses_existing_out_without_force(capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    code, _, err = run(capsys, "apply", "--pin", "v0.20.1", "--patch", "P65", "--out", out)
    assert code == 2
    assert "already exists" in one_line_error(err)


def test_apply_writes_tree_and_report(capsys, tmp_path, tree_0201):
    import hashlib
    import json

    out = tmp_path / "out"
    code, _, err = run(capsys, "apply", "--pin", "v0.20.1", "--patch", "P65", "--out", out)
    assert code == 0, err
    report = json.loads((out / "kiln-report.json").read_text())
    rel = "v1/attention/backends/turboquant_attn.py"
    assert [p["patch"] for p in report["patches"]] == ["P65"]
    assert report["patches"][0]["verdict"] == "APPLIES"
    after = hashlib.sha256((out / "vllm" / rel).read_bytes()).hexdigest()
    before = hashlib.sha256(tree_0201.file(rel).read_bytes()).hexdigest()
    assert report["files"][rel] == {"before": before, "after": after}
    assert before != after
    # every other file is the pristine one
    untouched = "config/vllm.py"
    assert (out / "vllm" / untouched).read_bytes() == tree_0201.file(untouched).read_bytes()
