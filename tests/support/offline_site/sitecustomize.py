"""Imported at start-up by every Python process a test starts (tests/conftest.py puts this folder
on PYTHONPATH): in a child of a test not marked network, the worker's network guard
(tests/support/netguard.py), loaded by its path so that the child's sys.path stays its own (an
installed kiln's test checks where kiln is imported from)."""

import os

if os.environ.get("KILN_TEST_OFFLINE"):
    import importlib.util
    from pathlib import Path

    _spec = importlib.util.spec_from_file_location(
        "_kiln_test_netguard", Path(__file__).resolve().parent.parent / "netguard.py")
    _guard = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_guard)
    _guard.guard_child(os.environ["KILN_TEST_OFFLINE"])
