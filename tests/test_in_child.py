"""``in_child`` (tests/support/vllm_modules.py) runs a test in a process of its own and reports it."""

from __future__ import annotations

import os
import sys

import pytest

from tests.support.vllm_modules import in_child


@in_child
def _passes_in_its_own_process(parent: int) -> None:
    assert os.getpid() != parent


@in_child
def _fails_with(message: str) -> None:
    raise AssertionError(message)


@in_child
def _finds_triton_not_imported_and_torch_as_a_fresh_import_would(value: str) -> None:
    # a test may set TRITON_INTERPRET here, before its first Triton import (tests/patchsets/attention_gdn/test_p60b.py)
    assert "triton" not in sys.modules
    os.environ["KILN_IN_CHILD_PROBE"] = value
    import torch

    assert torch.tensor([2, 3]).sum().item() == 5


def test_a_child_starts_without_triton_and_its_environment_stays_its_own():
    _finds_triton_not_imported_and_torch_as_a_fresh_import_would(value="one")
    _finds_triton_not_imported_and_torch_as_a_fresh_import_would(value="two")
    assert "KILN_IN_CHILD_PROBE" not in os.environ


def test_a_child_runs_apart_and_its_failure_comes_back():
    _passes_in_its_own_process(parent=os.getpid())
    with pytest.raises(pytest.fail.Exception, match="the child's own words"):
        _fails_with(message="the child's own words")
