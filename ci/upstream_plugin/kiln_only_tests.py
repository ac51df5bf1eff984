"""A pytest plugin ``ci/upstream_tests.py --pristine-from`` loads into the patched side only.

It runs the tests named in the JSON list at ``$KILN_ONLY_TESTS`` and deselects the others, by
the name the run's JUnit report gives a test (``tests.a.test_b.TestC::test_d[param]``, what the
record keys outcomes by). Every test is still collected: a test file that no longer imports on
the patched source fails to collect, and the tests it held come out absent, which the comparison
counts as regressions when they passed on pristine.
"""

from __future__ import annotations

import json
import os
import re


def junit_name(nodeid: str) -> str:
    """The name pytest's JUnit report gives a test of this node id (its ``mangle_test_address``:
    the file as a dotted path, ``.py`` dropped, classes and the test after it)."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return f"{'.'.join(names[:-1])}::{names[-1]}"


def pytest_collection_modifyitems(session, config, items):
    listed = os.environ.get("KILN_ONLY_TESTS")
    if not listed:
        return
    with open(listed, encoding="utf-8") as handle:
        wanted = set(json.load(handle))
    keep = [item for item in items if junit_name(item.nodeid) in wanted]
    dropped = [item for item in items if junit_name(item.nodeid) not in wanted]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
