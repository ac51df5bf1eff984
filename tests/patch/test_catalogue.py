"""Every patch of the catalogue, on the real source of every recorded pin/candidate.

These tests are generated from the catalogue, so a new patch module gets them without any
edit here: recorded verdicts match, golden diffs match, re-applying changes nothing.
Regenerate golden files after a reviewed change with ``KILN_UPDATE_GOLDEN=1 pytest``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kiln import paths
from kiln.patch.catalog import load_catalogue
from kiln.patch.engine import isolated_run, run_isolated
from kiln.patch.model import BuildTarget, Verdict
from kiln.patch.output import unified_diff
from kiln.patch.record import compare, load_record
from tests.conftest import SOURCES

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
CATALOGUE_IDS = list(load_catalogue(paths.PATCHSETS).patches)
RECORD = load_record(paths.RECORD)


def _target(tree):
    return BuildTarget(tree.vllm_version)


@pytest.mark.parametrize("label", sorted(SOURCES))
def test_verdicts_match_the_record(catalogue, sessions, label):
    session = sessions(label)
    outcomes = run_isolated(catalogue, session, _target(session.tree), list(catalogue.patches))
    differences = compare(RECORD.get(label, {}), outcomes)
    assert not differences, [
        (d.patch_id, d.expected, d.actual, outcomes[d.patch_id].detail if d.patch_id in outcomes else "")
        for d in differences
    ]


def test_record_covers_exactly_the_tested_sources():
    assert set(RECORD) == set(SOURCES)


@pytest.mark.parametrize("label", sorted(SOURCES))
@pytest.mark.parametrize("patch_id", CATALOGUE_IDS)
def test_golden_diff(catalogue, sessions, label, patch_id):
    session = sessions(label)
    result = isolated_run(catalogue, session, _target(session.tree), patch_id)
    golden = GOLDEN / label / f"{patch_id}.diff"
    if result.outcomes[patch_id].verdict is not Verdict.APPLIES:
        assert not golden.exists(), f"{golden} is stale: {patch_id} is {result.outcomes[patch_id].verdict} on {label}"
        return
    diff = unified_diff(session.tree, result)
    assert diff, f"{patch_id} APPLIES on {label} but changes nothing"
    if os.environ.get("KILN_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(diff)
    assert golden.exists(), f"no golden diff {golden} (review it, then KILN_UPDATE_GOLDEN=1)"
    assert diff == golden.read_text()


# Re-application is tested wherever the record says the patch applies (the record itself is
# checked against the source by test_verdicts_match_the_record).
APPLYING = [(label, pid) for label, table in sorted(RECORD.items()) for pid, v in table.items() if v == "APPLIES"]


@pytest.mark.parametrize(("label", "patch_id"), APPLYING)
def test_applying_twice_changes_nothing(catalogue, sessions, label, patch_id):
    session = sessions(label)
    first = isolated_run(catalogue, session, _target(session.tree), patch_id)
    assert first.outcomes[patch_id].verdict is Verdict.APPLIES
    again_session = session.overlay(first.state.changed)
    second = isolated_run(catalogue, again_session, _target(session.tree), patch_id)
    assert second.outcomes[patch_id].verdict is Verdict.ALREADY_PATCHED, second.outcomes[patch_id].detail
    assert all(
        second.state.module(rel).code == module.code for rel, module in first.state.changed.items()
    )


TESTS = Path(__file__).resolve().parents[1] / "patchsets"


@pytest.mark.parametrize("patch_id", CATALOGUE_IDS)
def test_every_patch_has_a_behaviour_test(catalogue, patch_id):
    """``patchsets/<family>/pNN_*.py`` needs ``tests/patchsets/<family>/test_pNN.py`` with a test in it."""
    patch = catalogue.get(patch_id)
    test_file = TESTS / patch.family / f"test_{patch_id.lower()}.py"
    assert test_file.is_file(), f"{patch_id}: no behaviour test {test_file}"
    assert "\ndef test_" in test_file.read_text(), f"{test_file} defines no test"
