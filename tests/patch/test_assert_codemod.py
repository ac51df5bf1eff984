"""``kiln.patch.testing.assert_codemod``: a patch's before/after inline, no wheel (here the real P14
module of the catalogue on a block table written in the test)."""

from __future__ import annotations

import pytest

from kiln import paths
from kiln.patch.catalog import load_catalogue
from kiln.patch.model import Verdict
from kiln.patch.testing import assert_codemod

MOVE_ROW = """
    class BlockTable:
        def move_row(self, src: int, tgt: int) -> None:
            num_blocks = self.num_blocks_per_row[src]
            block_table_np = self.block_table.np
            block_table_np[tgt, :num_blocks] = block_table_np[src, :num_blocks]
            self.num_blocks_per_row[tgt] = num_blocks

        def swap_row(self, src: int, tgt: int) -> None:
            pass
    """

ZEROED = """
    class BlockTable:
        def move_row(self, src: int, tgt: int) -> None:
            num_blocks = self.num_blocks_per_row[src]
            block_table_np = self.block_table.np
            block_table_np[tgt, :num_blocks] = block_table_np[src, :num_blocks]
            self.num_blocks_per_row[tgt] = num_blocks
            # kiln P14: zero the vacated source row: a dummy run reads rows past the batch as Mamba state slots
            self.block_table.np[src, :num_blocks] = 0
            self.num_blocks_per_row[src] = 0

        def swap_row(self, src: int, tgt: int) -> None:
            pass
    """


@pytest.fixture(scope="module")
def p14():
    return load_catalogue(paths.PATCHSETS).get("P14")


def test_the_patch_applies_and_writes_the_expected_text(p14):
    outcome = assert_codemod(MOVE_ROW, p14, Verdict.APPLIES, ZEROED)
    assert set(outcome.files) == {"v1/worker/block_table.py"}


def test_upstreams_own_zeroing_is_upstream_and_changes_nothing(p14):
    upstream = MOVE_ROW.replace(
        "self.num_blocks_per_row[tgt] = num_blocks\n",
        "self.num_blocks_per_row[tgt] = num_blocks\n"
        "            block_table_np[src, :num_blocks] = 0\n"
        "            self.num_blocks_per_row[src] = 0\n")
    assert_codemod(upstream, p14, Verdict.UPSTREAM, upstream)


def test_a_moved_anchor_is_drifted(p14):
    assert_codemod(MOVE_ROW.replace("self.num_blocks_per_row[tgt] = num_blocks", "pass"), p14, Verdict.DRIFTED)


def test_applying_twice_is_already_patched(p14):
    assert_codemod(ZEROED, p14, Verdict.ALREADY_PATCHED, ZEROED)


def test_a_wrong_expectation_fails_naming_the_line_or_the_verdict(p14):
    with pytest.raises(AssertionError, match=r"line 7: got .*kiln P14.*, expected ' +pass'"):
        assert_codemod(MOVE_ROW, p14, Verdict.APPLIES, MOVE_ROW.replace("num_blocks\n\n", "num_blocks\n        pass\n\n", 1))
    with pytest.raises(AssertionError, match=r"P14: APPLIES, not UPSTREAM"):
        assert_codemod(MOVE_ROW, p14, Verdict.UPSTREAM)
