"""Engine semantics on small synthetic trees: each verdict, and how it is explained.

(Patches themselves are tested on the real vLLM source; these tests pin down the engine's
rules with trees small enough to state every case.)
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import libcst as cst
import libcst.matchers as m
import pytest
from packaging.version import Version

from kiln.patch.catalog import Catalogue
from kiln.patch.engine import Session, isolated_run, run_selection
from kiln.patch.model import BuildTarget, Codemod, Gates, NewFile, Patch, Verdict
from kiln.patch.output import report, unified_diff
from kiln.patch.shapes import assign_to, cls, func, insert_after, marked, statements, with_marker
from kiln.publish.tree import TreePublisher
from kiln.source.tree import SourceTree
from kiln.staging import commit_all

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


def test_a_release_outside_written_for_is_out_of_range_not_gated(tmp_path):
    """0.19.1 below a patch written for >=0.20.1: OUT_OF_RANGE, even where the anchor is there
    (the failure may well be present); it wins over a gate and does not block a build."""
    written = patch("P1", (AddHelper,), written_for=">=0.20.1", gates=Gates(sm_min=89))
    old = BuildTarget(Version("0.19.1"), sm=86)
    out = verdict(tmp_path, BASE, written, target=old)
    assert out.verdict is Verdict.OUT_OF_RANGE
    assert "written for vllm>=0.20.1" in out.detail and "0.19.1" in out.detail
    assert not out.verdict.blocks_build and not out.verdict.ok
    # inside the range the same patch is judged on the source and the target as before
    assert verdict(tmp_path, BASE, written, target=BuildTarget(Version("0.20.1"), sm=86)).verdict is Verdict.GATED
    assert verdict(tmp_path, BASE, written).verdict is Verdict.APPLIES


def test_a_dependency_out_of_range_gates_the_dependent(tmp_path):
    p1 = patch("P1", (AddHelper,), written_for=">=0.21")
    out = verdict(tmp_path, BASE, p1, patch("P2", (RenameSupport,), requires=("P1",)), pid="P2")
    assert (out.verdict, out.detail) == (Verdict.GATED, "requires P1, which is OUT_OF_RANGE")


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


# --- NewFile: a codemod that adds a whole file ------------------------------------------------

NEW_FILE_TEXT = '"""A helper module."""\n\n\n# kiln P1: test\ndef helper():\n    return 1\n'


class AddHelperModule(NewFile):
    target = "ops/helper.py"
    content = "p1_files/helper.py"
    patched = (func("helper", leading_lines=marked("P1")),)
    upstream = (func("helper"),)


def new_file_patch(tmp_path, *edits, text=NEW_FILE_TEXT, **attrs):
    """A patch whose module 'lives' in ``tmp_path/patches``, with its content file beside it."""
    home = tmp_path / "patches"
    (home / "p1_files").mkdir(parents=True, exist_ok=True)
    (home / "p1_files" / "helper.py").write_text(text)
    return patch("P1", edits or (AddHelperModule,), source_file=str(home / "p1_x.py"), **attrs)


def test_new_file_applies_where_absent_and_diffs_against_dev_null(tmp_path):
    source = tree(tmp_path / "src", BASE)
    p1 = new_file_patch(tmp_path, AddHelperModule, AddHelper)
    result = isolated_run(catalogue(p1), Session(source), TARGET, "P1")
    outcome = result.outcomes["P1"]
    assert outcome.verdict is Verdict.APPLIES  # no TARGET_GONE for the absent file
    assert result.changed_text()["ops/helper.py"] == NEW_FILE_TEXT
    assert outcome.files["ops/helper.py"][0] is None  # nothing before
    assert outcome.files["mod.py"][0] is not None
    diff = unified_diff(source, result)
    assert "--- /dev/null\n+++ b/vllm/ops/helper.py\n@@ -0,0 +1,6 @@\n" in diff
    assert "--- a/vllm/mod.py\n+++ b/vllm/mod.py\n" in diff
    assert report(source, "t", result)["files"]["ops/helper.py"]["before"] is None
    out = tmp_path / "out"
    publisher = TreePublisher(out)
    publisher.check()
    commit_all([publisher.stage(source, "t", result)])
    assert (out / "vllm" / "ops" / "helper.py").read_text() == NEW_FILE_TEXT


def test_new_file_rerun_is_already_patched(tmp_path):
    session = Session(tree(tmp_path / "src", BASE))
    cat = catalogue(new_file_patch(tmp_path))
    first = isolated_run(cat, session, TARGET, "P1")
    second = isolated_run(cat, session.overlay(first.state.changed), TARGET, "P1")
    assert second.outcomes["P1"].verdict is Verdict.ALREADY_PATCHED
    assert not second.state.changed


def test_new_file_already_there_is_upstream_or_drift(tmp_path):
    upstream = {**BASE, "ops/helper.py": "def helper():\n    return 2\n"}
    assert verdict(tmp_path / "a", upstream, new_file_patch(tmp_path)).verdict is Verdict.UPSTREAM
    foreign = {**BASE, "ops/helper.py": "def unrelated():\n    pass\n"}
    out = verdict(tmp_path / "b", foreign, new_file_patch(tmp_path))
    assert (out.verdict, out.detail) == (
        Verdict.DRIFTED, "AddHelperModule: ops/helper.py already exists and is not this patch's file"
    )


def test_new_file_without_its_marker_is_an_error(tmp_path):
    from kiln.errors import KilnError

    unmarked = new_file_patch(tmp_path, text="def helper():\n    return 1\n")
    with pytest.raises(KilnError, match="AddHelperModule's `patched` matcher does not find its marker"):
        verdict(tmp_path / "src", BASE, unmarked)


def _write_patch_module(root: Path, content: str, body: str) -> Path:
    family = root / "fam"
    (family / "p1_files").mkdir(parents=True, exist_ok=True)
    (family / "p1_files" / "helper.py").write_text(body)
    module = family / "p1_add.py"
    module.write_text(textwrap.dedent(f"""
        from kiln.patch.model import NewFile, Patch
        from kiln.patch.shapes import func, marked

        class AddHelper(NewFile):
            target = "ops/helper.py"
            content = {content!r}
            patched = (func("helper", leading_lines=marked("P1")),)

        class P1(Patch):
            id, family, title, why = "P1", "fam", "t", "t"
            edits = (AddHelper,)
    """))
    return module


def test_catalogue_digest_covers_the_content_file_and_validates_its_path(tmp_path):
    from kiln.errors import KilnError
    from kiln.patch.catalog import load_catalogue

    _write_patch_module(tmp_path, "p1_files/helper.py", NEW_FILE_TEXT)
    first = load_catalogue(tmp_path).digests["P1"]
    (tmp_path / "fam" / "p1_files" / "helper.py").write_text(NEW_FILE_TEXT + "# changed\n")
    assert load_catalogue(tmp_path).digests["P1"] != first  # the verdict memo sees content edits
    _write_patch_module(tmp_path, "p1_files/missing.py", NEW_FILE_TEXT)
    with pytest.raises(KilnError, match=r"p1_add.py: P1.edits\[AddHelper\].content: .*missing.py does not exist"):
        load_catalogue(tmp_path)


def test_a_text_is_parsed_once_per_process_and_held_within_its_bound(tmp_path, monkeypatch):
    """Sessions over two trees holding the same file share its parsed module (a libcst tree is
    immutable); another text is parsed; the oldest trees go once the bound is passed; a text
    that does not parse raises every time, and one seen to parse is not parsed again."""
    import libcst as cst

    from kiln.patch.engine import _ParsedTexts

    text = "class Builder:\n    support = 1\n"
    one = Session(tree(tmp_path / "a", {"mod.py": text, "other.py": "x = 1\n"}))
    two = Session(tree(tmp_path / "b", {"mod.py": text, "other.py": "x = 2\n"}))
    assert one.module("mod.py") is two.module("mod.py")
    assert one.module("other.py") is not two.module("other.py") and two.module("other.py").code == "x = 2\n"
    parsed = _ParsedTexts(max_text=20)
    first = parsed.parse("a = 1\n")
    assert parsed.parse("a = 1\n") is first
    parsed.parse("b = 22222222222222\n")  # 19 characters: with the first held, past the bound of 20
    assert parsed.parse("a = 1\n") is not first  # parsed again
    for _ in range(2):
        with pytest.raises(cst.ParserSyntaxError):
            parsed.check_parses("def (:\n")
    calls = []
    parsed_module = cst.parse_module

    def counting(source, *args, **kwargs):
        calls.append(source)
        return parsed_module(source, *args, **kwargs)

    monkeypatch.setattr(cst, "parse_module", counting)
    parsed.check_parses("c = 3\n")
    parsed.check_parses("c = 3\n")
    parsed.check_parses("a = 1\n")  # held as a tree: known to parse
    monkeypatch.undo()
    assert calls == ["c = 3\n"]


def test_a_selection_reparses_only_the_texts_no_splice_vouched_for(tmp_path, monkeypatch):
    """What a selection writes must parse back; a text spliced from a parsed one with new
    statements that parse alone is known to (``kiln.patch.codegen``), so only the others are
    parsed again: here the file a full-module transform wrote."""
    from kiln.patch import engine

    class RenameInElif(Codemod):  # an elif is no statement of a block: libcst writes the module
        target = "other.py"
        anchor = (m.If(test=m.Name("b")),)
        patched = (m.If(test=m.Name("c")),)

        def rewrite(self, node):
            return node.with_changes(test=cst.Name("c"))

    files = {**BASE, "other.py": "if a:\n    x = 1\nelif b:\n    x = 2\n"}
    cat = catalogue(patch("P1", (AddHelper,)), patch("P2", (RenameInElif,)))
    reparsed = []
    check = engine.PARSED.check_parses
    monkeypatch.setattr(engine.PARSED, "check_parses", lambda text: (reparsed.append(text), check(text)))
    result = run_selection(cat, Session(tree(tmp_path, files)), TARGET, ["P1", "P2"])
    assert {o.verdict for o in result.outcomes.values()} == {Verdict.APPLIES}
    assert reparsed == [result.changed_text()["other.py"]] and "elif c:" in reparsed[0]
