"""Patch ids: Genesis's id for Genesis's fix, ``K<n>`` for kiln's own, and renamed ids that
keep old records and definitions readable (``kiln.patch.catalog.RENAMED``)."""

from __future__ import annotations

import pytest

from kiln.errors import KilnError
from kiln.patch.catalog import RENAMED, current_id, load_catalogue, patch_sort_key
from kiln.patch.record import load_record
from tests.support.cli import good_patch, write_patch


def test_ids_sort_genesis_p_then_pn_then_kilns_own():
    ids = ["K10", "PN401", "P5b", "K2", "PN353A", "P65", "P5", "K1", "PN346"]
    assert sorted(ids, key=patch_sort_key) == ["P5", "P5b", "P65", "PN346", "PN353A", "PN401", "K1", "K2", "K10"]


def test_renamed_ids_point_at_patches_of_the_catalogue(catalogue):
    for old, new in RENAMED.items():
        assert old not in catalogue.patches and new in catalogue.patches
        assert current_id(old) == new and catalogue.get(old) is catalogue.get(new)
    assert catalogue.closure(["P98"]) == ["PN353A"]


def test_a_record_written_before_a_rename_reads_under_the_new_id(tmp_path):
    record = tmp_path / "verdicts.toml"
    record.write_text('["v0.20.1"]\nP4 = "APPLIES"\nP98 = "GATED"\nP110 = "APPLIES"\n')
    assert load_record(record) == {"v0.20.1": {"P4": "APPLIES", "PN353A": "GATED", "K2": "APPLIES"}}
    record.write_text('["v0.20.1"]\nP98 = "GATED"\nPN353A = "GATED"\n')
    with pytest.raises(KilnError, match=r"verdicts.toml: v0.20.1: P98 and PN353A are the same patch \(renamed\); keep PN353A"):
        load_record(record)


def test_a_record_may_hold_the_new_verdict(tmp_path):
    record = tmp_path / "train.toml"
    record.write_text('["vllm-0.19.1"]\nP109 = "OUT_OF_RANGE"\n')
    assert load_record(record) == {"vllm-0.19.1": {"P109": "OUT_OF_RANGE"}}


@pytest.mark.parametrize(("pid", "filename", "extra", "message"), [
    ("K1", "k1_test.py", "", None),
    ("PN353A", "pn353a_test.py", "", None),
    ("P98", "p98_test.py", "", "'P98' was renamed to 'PN353A'"),
    ("X1", "x1_test.py", "", "is not like 'P65', 'P5b', 'PN401' (Genesis's ids) or 'K1'"),
    ("K7", "k7_test.py", 'written_for = "0.20.1+"', "K7.written_for: '0.20.1+' is not a version specifier"),
])
def test_the_loader_checks_ids_and_written_for(tmp_path, pid, filename, extra, message):
    write_patch(tmp_path, "attention_turboquant", filename, good_patch(pid=pid, extra=extra))
    if message is None:
        assert list(load_catalogue(tmp_path).patches) == [pid]
        return
    with pytest.raises(KilnError, match=None) as err:
        load_catalogue(tmp_path)
    assert message in str(err.value) and filename in str(err.value)
