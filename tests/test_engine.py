"""Engine semantics on small synthetic trees: each verdict, and how it is explained.

(Patches themselves are tested on the real vLLM source; these tests pin down the engine's
rules with trees small enough to state every case.)
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import libcst.matchers as m
import pytest
from packaging.version import Version

from kiln.patch.catalog import Catalogue
from kiln.patch.engine import Session, isolated_run, run_selection
from kiln.patch.model import BuildTarget, Codemod, Gates, Patch, Verdict
from kiln.patch.shapes import assign_to, cls, func, insert_after, marked, statements, with_marker
from kiln.source.tree import SourceTree

TARGET = BuildTarget(Version("0.20.1"))


def tree(tmp_path: Path, files: dict[str, str]) -> SourceTree:
    for rel, text in files.items():
        path = tmp_path / "vllm" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return SourceTree(tmp_path, Version("0.20.1"), f"test:{tmp_path}", "synthetic")


class AddHelper(Codemod):
    target = "mod.py"
    anchor = (cls("Builder"), assign_to("support"))
    patched = (cls("Builder"), func("helper", leading_lines=marked("P1")))
    upstream = (cls("Builder"), func("upstream_helper"))

    def rewrite(self, node):
        (method,) = statements("def helper(self):\n    return 1\n")
        return insert_after(node, with_marker(method, "P1", "test"))


class RenameSupport(Codemod):
    target = "mod.py"
    anchor = (cls("Builder"), assign_to("support"))
    patched = (cls("Builder"), m.SimpleStatementLine(leading_lines=marked("P2")))

    def rewrite(self, node):
        (stmt,) = statements("support = 2\n")
        return with_marker(stmt, "P2", "test")


def patch(pid, edits, **attrs):
    return type(pid, (Patch,), {"id": pid, "family": "t", "title": pid, "why": pid, "edits": edits, **attrs})()


def catalogue(*patches) -> Catalogue:
    return Catalogue(Path("."), {p.id: p for p in patches}, {p.id: p.id for p in patches})


BASE = {"mod.py": "class Builder:\n    support = 1\n"}


def verdict(tmp_path, files, *patches, pid="P1", target=TARGET):
    result = isolated_run(catalogue(*patches), Session(tree(tmp_path, files)), target, pid)
    return result.outcomes[pid]


def test_applies_and_rewrites(tmp_path):
    cat = catalogue(patch("P1", (AddHelper,)))
    result = isolated_run(cat, Session(tree(tmp_path, BASE)), TARGET, "P1")
    assert result.outcomes["P1"].verdict is Verdict.APPLIES
    assert "def helper(self)" in result.changed_text()["mod.py"]
    assert set(result.outcomes["P1"].files) == {"mod.py"}


def test_drift_when_anchor_matches_nothing(tmp_path):
    out = verdict(tmp_path, {"mod.py": "class Builder:\n    other = 1\n"}, patch("P1", (AddHelper,)))
    assert out.verdict is Verdict.DRIFTED
    assert "class Builder > SimpleStatementLine: matched 0 times" in out.detail


def test_drift_when_anchor_is_ambiguous_says_where(tmp_path):
    files = {"mod.py": "class Builder:\n    support = 1\n    support = 2\n"}
    out = verdict(tmp_path, files, patch("P1", (AddHelper,)))
    assert out.verdict is Verdict.DRIFTED
    assert "matched 2 times (lines 2, 3)" in out.detail


def test_target_gone_suggests_where_the_symbol_moved(tmp_path):
    files = {"other/place.py": "class Builder:\n    support = 1\n"}
    out = verdict(tmp_path, files, patch("P1", (AddHelper,)))
    assert out.verdict is Verdict.TARGET_GONE
    assert "mod.py does not exist; Builder is now in other/place.py:1" in out.detail


def test_upstream_shape_is_not_drift(tmp_path):
    files = {"mod.py": "class Builder:\n    def upstream_helper(self):\n        return 1\n"}
    out = verdict(tmp_path, files, patch("P1", (AddHelper,)))
    assert out.verdict is Verdict.UPSTREAM


def test_patch_level_upstream_detection_wins(tmp_path):
    class Retired(Patch):
        id, family, title, why, edits = "P1", "t", "t", "t", (AddHelper,)

        def upstream_fix(self, module_of):
            return "fixed elsewhere" if module_of("fixed.py") is not None else None

    out = verdict(tmp_path, {**BASE, "fixed.py": "x = 1\n"}, Retired())
    assert (out.verdict, out.detail) == (Verdict.UPSTREAM, "fixed elsewhere")


def test_version_and_sm_gates(tmp_path):
    gated = patch("P1", (AddHelper,), gates=Gates(vllm=">=0.30", sm_min=89))
    assert verdict(tmp_path, BASE, gated).verdict is Verdict.GATED
    sm_only = patch("P1", (AddHelper,), gates=Gates(sm_min=89))
    assert verdict(tmp_path, BASE, sm_only).verdict is Verdict.APPLIES  # SM undecided: not gated
    out = verdict(tmp_path, BASE, sm_only, target=BuildTarget(Version("0.20.1"), sm=86))
    assert (out.verdict, out.detail) == (Verdict.GATED, "sm_86 below sm_89")


def test_requires_an_applying_patch(tmp_path):
    dependent = patch("P2", (RenameSupport,), requires=("P1",))
    files = {"mod.py": "class Builder:\n    support = 1\n    def upstream_helper(self):\n        pass\n"}
    out = verdict(tmp_path, files, patch("P1", (AddHelper,)), dependent, pid="P2")
    assert (out.verdict, out.detail) == (Verdict.GATED, "requires P1, which is UPSTREAM")


def test_selection_reports_declared_conflicts(tmp_path):
    p1 = patch("P1", (AddHelper,), conflicts=("P2",))
    p2 = patch("P2", (RenameSupport,))
    result = run_selection(catalogue(p1, p2), Session(tree(tmp_path, BASE)), TARGET, ["P1", "P2"])
    assert {pid: o.verdict for pid, o in result.outcomes.items()} == {"P1": Verdict.CONFLICT, "P2": Verdict.CONFLICT}


class RenameAttribute(Codemod):
    target = "mod.py"
    anchor = (cls("Builder"), assign_to("support"))
    patched = (cls("Builder"), m.SimpleStatementLine(leading_lines=marked("P2")))

    def rewrite(self, node):
        (stmt,) = statements("supported = 1\n")
        return with_marker(stmt, "P2", "test")


def test_selection_reports_undeclared_overlap_as_conflict(tmp_path):
    # P2 rewrites the statement P3 anchors on: alone each applies, together P3 cannot.
    p2 = patch("P2", (RenameAttribute,))
    p3 = patch("P3", (AddHelper,))
    result = run_selection(catalogue(p2, p3), Session(tree(tmp_path, BASE)), TARGET, ["P2", "P3"])
    assert result.outcomes["P2"].verdict is Verdict.APPLIES
    assert result.outcomes["P3"].verdict is Verdict.CONFLICT
    assert result.outcomes["P3"].detail.startswith("applies alone but not after P2")


def test_partial_application_is_drift_not_success(tmp_path):
    class SecondEdit(Codemod):
        target = "mod.py"
        anchor = (cls("Missing"),)
        patched = (cls("Missing"), func("x", leading_lines=marked("P1")))

        def rewrite(self, node):
            return node

    out = verdict(tmp_path, BASE, patch("P1", (AddHelper, SecondEdit)))
    assert out.verdict is Verdict.DRIFTED
    assert "SecondEdit" in out.detail


def test_codemod_whose_result_lacks_its_patched_shape_is_an_error(tmp_path):
    class Liar(AddHelper):
        def rewrite(self, node):
            return node

    from kiln.errors import KilnError

    with pytest.raises(KilnError, match="codemod Liar ran but its `patched` matcher does not find the result"):
        verdict(tmp_path, BASE, patch("P1", (Liar,)))
