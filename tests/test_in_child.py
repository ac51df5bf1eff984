"""``in_child`` (tests/support/vllm_modules.py) runs a test in a fresh interpreter and reports it."""

from __future__ import annotations

import os

import pytest

from tests.support.vllm_modules import in_child


@in_child
def _passes_in_its_own_process(parent: int) -> None:
    assert os.getpid() != parent


@in_child
def _fails_with(message: str) -> None:
    raise AssertionError(message)


def test_a_child_runs_apart_and_its_failure_comes_back():
    _passes_in_its_own_process(parent=os.getpid())
    with pytest.raises(pytest.fail.Exception, match="the child's own words"):
        _fails_with(message="the child's own words")
