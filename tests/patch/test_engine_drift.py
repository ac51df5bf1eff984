"""A codemod that raises on a source whose shape moved is that patch's drift, never a crash.

The patches here are a test-only catalogue written into ``tmp_path`` (real patch modules,
loaded by kiln's own catalogue loader) that target REAL files of the vLLM 0.20.1 release tree
(the wheel source from the kiln cache). One codemod raises mid-rewrite, one patch-level
``upstream_fix`` raises, one anchor matcher raises, one patch applies, one requires the
raising patch: every patch still gets its verdict, and the drifted ones say which codemod,
why, and where (file:line of the pristine file).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from packaging.version import Version

from kiln.commands import main
from kiln.errors import KilnError
from kiln.patch.catalog import load_catalogue
from kiln.patch.engine import Session, run_isolated, run_selection
from kiln.patch.model import BuildTarget, Verdict

pytestmark = pytest.mark.network

SCHEDULER = "v1/core/sched/scheduler.py"
TQ = "v1/attention/backends/turboquant_attn.py"

HEADER = """
import libcst.matchers as m

from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import assign_to, cls, func, insert_after, marked, statements, with_marker
"""

MODULES = {
    # raises inside rewrite, after its anchor matched once (the P62-on-0.25.0 situation)
    "p1_raises_mid_rewrite.py": """
        class CheckBranchThenEdit(Codemod):
            target = "v1/core/sched/scheduler.py"
            anchor = (cls("Scheduler"), func("update_from_output"))
            patched = (cls("Scheduler"), func("update_from_output", leading_lines=marked("P1")))

            def rewrite(self, node):
                raise ValueError("the grammar-rejection branch is not where expected")

        class P1(Patch):
            id, family, title, why = "P1", "fam", "t", "t"
            edits = (CheckBranchThenEdit,)
    """,
    # an ordinary patch on a real file: must still APPLY next to the broken ones
    "p2_applies.py": """
        class AddHelper(Codemod):
            target = "v1/attention/backends/turboquant_attn.py"
            anchor = (cls("TurboQuantMetadataBuilder"), assign_to("_cudagraph_support"))
            patched = (cls("TurboQuantMetadataBuilder"), func("kiln_helper", leading_lines=marked("P2")))

            def rewrite(self, node):
                (method,) = statements("def kiln_helper(self):\\n    return 1\\n")
                return insert_after(node, with_marker(method, "P2", "test"))

        class P2(Patch):
            id, family, title, why = "P2", "fam", "t", "t"
            edits = (AddHelper,)
    """,
    # the patch-level upstream recogniser raises (written for another shape)
    "p3_upstream_raises.py": """
        class AddOther(Codemod):
            target = "v1/attention/backends/turboquant_attn.py"
            anchor = (cls("TurboQuantMetadataBuilder"), assign_to("_cudagraph_support"))
            patched = (cls("TurboQuantMetadataBuilder"), func("kiln_other", leading_lines=marked("P3")))

            def rewrite(self, node):
                return node

        class P3(Patch):
            id, family, title, why = "P3", "fam", "t", "t"
            edits = (AddOther,)

            def upstream_fix(self, module_of):
                module = module_of("v1/attention/backends/turboquant_attn.py")
                return {}["fixed_in"] if module is not None else None
    """,
    # an anchor whose matcher predicate raises on the real node it meets
    "p4_matcher_raises.py": """
        def _boom(value):
            raise TypeError("unexpected node")

        class ProbeSupport(Codemod):
            target = "v1/attention/backends/turboquant_attn.py"
            anchor = (cls("TurboQuantMetadataBuilder"), m.SimpleStatementLine(body=[m.MatchIfTrue(_boom)]))
            patched = (cls("TurboQuantMetadataBuilder"), func("kiln_probe", leading_lines=marked("P4")))

            def rewrite(self, node):
                return node

        class P4(Patch):
            id, family, title, why = "P4", "fam", "t", "t"
            edits = (ProbeSupport,)
    """,
    # depends on the patch that drifted
    "p5_requires_p1.py": """
        class Rename(Codemod):
            target = "v1/attention/backends/turboquant_attn.py"
            anchor = (cls("TurboQuantMetadataBuilder"), assign_to("_cudagraph_support"))
            patched = (cls("TurboQuantMetadataBuilder"), m.SimpleStatementLine(leading_lines=marked("P5")))

            def rewrite(self, node):
                return with_marker(node, "P5", "test")

        class P5(Patch):
            id, family, title, why = "P5", "fam", "t", "t"
            requires = ("P1",)
            edits = (Rename,)
    """,
}


def write_catalogue(root: Path, modules: dict[str, str]) -> Path:
    family = root / "fam"
    family.mkdir(parents=True)
    for name, body in modules.items():
        (family / name).write_text(textwrap.dedent(HEADER) + textwrap.dedent(body))
    return root


@pytest.fixture
def catalogue(tmp_path):
    return load_catalogue(write_catalogue(tmp_path / "patchsets", MODULES))


def line_of_text(text: str, needle: str) -> int:
    return next(n for n, line in enumerate(text.splitlines(), 1) if needle in line)


def test_a_raising_codemod_is_drift_and_every_other_patch_keeps_its_verdict(catalogue, trees):
    tree = trees("v0.20.1")
    outcomes = run_isolated(catalogue, Session(tree), BuildTarget(Version("0.20.1")), list(catalogue.patches))
    assert {pid: o.verdict for pid, o in outcomes.items()} == {
        "P1": Verdict.DRIFTED,
        "P2": Verdict.APPLIES,
        "P3": Verdict.DRIFTED,
        "P4": Verdict.DRIFTED,
        "P5": Verdict.GATED,
    }
    line = line_of_text(tree.read(SCHEDULER), "    def update_from_output(")
    assert outcomes["P1"].detail == (
        f"CheckBranchThenEdit: {SCHEDULER}:{line}: rewrite raised ValueError: "
        "the grammar-rejection branch is not where expected"
    )
    assert outcomes["P3"].detail == "upstream_fix raised KeyError: 'fixed_in'"
    assert outcomes["P4"].detail == f"ProbeSupport: {TQ}: anchor raised TypeError: unexpected node"
    assert outcomes["P5"].detail == "requires P1, which is DRIFTED"


def test_verify_prints_every_verdict_instead_of_exiting_2(tmp_path, trees, capsys):
    trees("v0.20.1")  # fetched into the kiln cache (the command reads it from there)
    root = write_catalogue(tmp_path / "patchsets", MODULES)
    code = main(
        ["--patchsets", str(root), "--record", str(tmp_path / "record.toml"),
         "verify", "--vllm", "0.20.1", "--json", "--no-memo"]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 1  # unrecorded verdicts differ from the (empty) record; not 2 (a crash)
    verdicts = {p["patch"]: p["verdict"] for p in out["patches"]}
    assert verdicts == {"P1": "DRIFTED", "P2": "APPLIES", "P3": "DRIFTED", "P4": "DRIFTED", "P5": "GATED"}
    assert "rewrite raised ValueError" in next(p["detail"] for p in out["patches"] if p["patch"] == "P1")


def test_a_selection_with_a_drifted_patch_still_decides_the_others(catalogue, trees):
    result = run_selection(catalogue, Session(trees("v0.20.1")), BuildTarget(Version("0.20.1")), ["P1", "P2"])
    assert result.outcomes["P1"].verdict is Verdict.DRIFTED
    assert result.outcomes["P2"].verdict is Verdict.APPLIES


def test_output_that_does_not_compile_still_stops_the_run_naming_the_patch(tmp_path, trees):
    broken = {
        "p6_breaks_the_file.py": """
            class YieldAtModuleLevel(Codemod):
                target = "v1/core/sched/scheduler.py"
                anchor = (cls("Scheduler"),)
                patched = (m.SimpleStatementLine(leading_lines=marked("P6")),)

                def rewrite(self, node):
                    (bad,) = statements("x = yield 1\\n")
                    return insert_after(node, with_marker(bad, "P6", "test"))

            class P6(Patch):
                id, family, title, why = "P6", "fam", "t", "t"
                edits = (YieldAtModuleLevel,)
        """
    }
    catalogue = load_catalogue(write_catalogue(tmp_path / "patchsets", broken))
    with pytest.raises(KilnError, match=rf"patch P6: output of {SCHEDULER} does not compile: 'yield' outside function"):
        run_isolated(catalogue, Session(trees("v0.20.1")), BuildTarget(Version("0.20.1")), ["P6"])
