"""KILN_JOBS: how many processes patching and compiling may use (kiln/jobs.py)."""

from __future__ import annotations

import pytest

from kiln import jobs
from kiln.commands import main
from kiln.errors import KilnError


def test_kiln_jobs_caps_the_workers_and_a_callers_own_count_wins(monkeypatch):
    monkeypatch.setenv("KILN_JOBS", "1")
    assert jobs.worker_count(8) == 1
    assert jobs.worker_count(8, asked=3) == 3
    monkeypatch.setenv("KILN_JOBS", "4")
    assert jobs.worker_count(2) == 2  # never more workers than tasks
    assert jobs.worker_count(8) == 4
    monkeypatch.delenv("KILN_JOBS")
    assert jobs.worker_count(10_000) >= 1


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_a_bad_kiln_jobs_is_one_line_before_any_work(monkeypatch, capsys, value):
    monkeypatch.setenv("KILN_JOBS", value)
    with pytest.raises(KilnError, match="KILN_JOBS"):
        jobs.worker_count(4)
    # the command refuses it before it reads anything (`patches` would otherwise list the catalogue)
    assert main(["patches"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "KILN_JOBS" in lines[0] and repr(value) in lines[0]


@pytest.mark.parametrize("setting, forked", [("1", 0), ("2", 2)])
def test_the_patch_step_forks_as_many_workers_as_kiln_jobs_says(monkeypatch, tmp_path, catalogue, tree_0201, setting,
                                                                forked):
    import multiprocessing

    from kiln import paths
    from kiln.definitions import load_definition
    from kiln.patch.memo import SelectionMemo, patched_selection
    from kiln.pins import load_pins

    pins = load_pins(paths.PINS)
    definition = load_definition(paths.IMAGES, "qwen3.6-27b-tq", catalogue, pins)
    monkeypatch.setenv("KILN_JOBS", setting)
    seen: list[int] = []
    patched_selection(catalogue, tree_0201, definition.target(pins["v0.20.1"], 120), list(definition.patches),
                      SelectionMemo(tmp_path / "cache"), forked=lambda changed: seen.append(len(multiprocessing.active_children())))
    assert seen == [forked]
