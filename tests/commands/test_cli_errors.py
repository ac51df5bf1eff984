"""Bad input: one line naming the culprit, exit code 2, and nothing half-written."""

from __future__ import annotations

import shutil

import pytest

from tests.support.cli import P65_FILE, good_patch, one_line_error, run, write_patch


@pytest.fixture
def patchsets(tmp_path):
    """A private catalogue holding a copy of P65, to which tests add broken modules."""
    root = tmp_path / "patchsets"
    (root / "attention_turboquant").mkdir(parents=True)
    shutil.copy(P65_FILE, root / "attention_turboquant" / P65_FILE.name)
    return root





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


# Malformed pins.toml, image definitions and patch metadata: tests/test_malformed_inputs.py.


@pytest.mark.network  # verify reads a release's wheel
def test_conflicting_patches_selected(capsys, patchsets, tmp_path):
    write_patch(patchsets, "attention_turboquant", "p67b_test.py", good_patch(pid="P67b"))
    out = tmp_path / "out"
    code, _, err = run(capsys, "--patchsets", patchsets, "apply", "--pin", "v0.20.1", "--patch", "P65", "--patch", "P67b", "--out", out)
    assert code == 2
    line = one_line_error(err)
    assert "P65" in line and "P67b" in line and "conflict" in line
    assert not out.exists()


@pytest.mark.network  # verify reads a release's wheel
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
