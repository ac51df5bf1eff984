"""A pytest plugin ``ci/upstream_tests.py`` loads into vLLM's own tests, on both sides alike.

vLLM's ``tests/conftest.py`` ends every test with ``cleanup_dist_env_and_memory()``, which
unfreezes the heap and runs a full ``gc.collect()``. On the CPU build that collection walks the
half million objects torch and vLLM create at import (and every collected test item): 0.4 to
0.8 s after each test, whatever the test did, so the 14,213 tests of ``tests/kernels`` took hours
a side, nearly all of it there (py-spy: 97 % of samples in that call).

Here the heap is frozen (``gc.freeze``) once the tests are collected and again after each
cleanup, and during vLLM's cleanup, and only there, ``gc.unfreeze`` does nothing: each cleanup
still destroys the distributed state and collects every object created since the last one (all
a test can have left behind), without walking the heap that existed before it. vLLM's code keeps
the real ``gc.unfreeze`` everywhere else (an engine's shutdown unfreezes as it always does; the
next cleanup then walks the whole heap once and freezes it again).
"""

from __future__ import annotations

import functools
import gc

import pytest

_KEY = pytest.StashKey[int]()  # how many conftests' cleanups were wrapped
_WRAPPED = "_kiln_gc_between_tests"


def _young_only(cleanup):
    @functools.wraps(cleanup)
    def cleanup_young(*args, **kwargs):
        unfreeze = gc.unfreeze
        gc.unfreeze = lambda: None
        try:
            return cleanup(*args, **kwargs)
        finally:
            gc.unfreeze = unfreeze
            gc.freeze()

    setattr(cleanup_young, _WRAPPED, True)
    return cleanup_young


def pytest_collection_finish(session):
    wrapped = 0
    for plugin in session.config.pluginmanager.get_plugins():  # the conftest modules among them
        cleanup = getattr(plugin, "cleanup_dist_env_and_memory", None)
        if callable(cleanup) and not getattr(cleanup, _WRAPPED, False):
            plugin.cleanup_dist_env_and_memory = _young_only(cleanup)
            wrapped += 1
    session.config.stash[_KEY] = wrapped
    gc.collect()
    gc.freeze()


def pytest_terminal_summary(terminalreporter, config):
    terminalreporter.write_line(f"kiln: vLLM's per-test cleanup collects young objects only ({config.stash.get(_KEY, 0)} conftest(s))")


def pytest_unconfigure(config):
    gc.unfreeze()  # the interpreter's shutdown frees the heap as it would have
