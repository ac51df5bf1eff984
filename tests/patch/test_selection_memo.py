"""A build's patched selection is remembered by content, per independent group of patches: a
warm rebuild patches nothing, an edited patch module re-runs its own group, and the result is
always exactly what the engine computes for the whole selection."""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from pathlib import Path

import pytest

from kiln import paths
from kiln.definitions import load_definition
from kiln.patch import memo as memo_module
from kiln.patch.engine import Session, run_selection
from kiln.patch.memo import SelectionMemo, independent_groups, patched_selection
from kiln.pins import load_pins
from kiln.source.tree import SourceTree


@pytest.fixture(scope="module")
def shipped(catalogue):
    pins = load_pins(paths.PINS)
    definition = load_definition(paths.IMAGES, "qwen3.6-27b-tq", catalogue, pins)
    return list(definition.patches), definition.target(pins["v0.20.1"], 120)


@pytest.fixture(scope="module")
def whole(catalogue, tree_0201, shipped):
    ids, target = shipped
    return run_selection(catalogue, Session(tree_0201), target, ids)


def _same(selection, result) -> None:
    assert selection.changed_text() == result.changed_text()
    assert [(o.patch_id, o.verdict, o.detail, o.files) for o in selection.outcomes.values()] == \
           [(o.patch_id, o.verdict, o.detail, o.files) for o in result.outcomes.values()]


def test_groups_share_no_file(catalogue, shipped):
    ids, _ = shipped
    groups = independent_groups(catalogue, catalogue.closure(ids))
    assert sorted(pid for group in groups for pid in group) == sorted(catalogue.closure(ids))
    attention = next(group for group in groups if "P65" in group)
    assert {"P22", "P38", "P44", "PN401"} <= set(attention)  # every patch of turboquant_attn.py together
    assert all("turboquant_attn" in " ".join(catalogue.get(pid).targets) for pid in attention)
    files = [{t for pid in group for t in catalogue.get(pid).targets} for group in groups]
    assert all(not (a & b) for i, a in enumerate(files) for b in files[i + 1:])


@pytest.mark.parametrize("jobs", [1, 2])  # in this process, or groups in two forked processes
def test_warm_patches_nothing_and_equals_the_engine(tmp_path, catalogue, tree_0201, shipped, whole, jobs):
    ids, target = shipped
    memo = SelectionMemo(tmp_path)
    first = patched_selection(catalogue, tree_0201, target, ids, memo, jobs=jobs)
    again = patched_selection(catalogue, tree_0201, target, ids, memo)
    assert sorted(first.patched) == sorted(catalogue.closure(ids)) and again.patched == ()
    _same(first, whole)
    _same(again, whole)


def test_an_edited_patch_module_reruns_its_group_only(tmp_path, catalogue, tree_0201, shipped, whole):
    ids, target = shipped
    memo = SelectionMemo(tmp_path)
    patched_selection(catalogue, tree_0201, target, ids, memo)
    edited = copy.copy(catalogue)
    edited.digests = {**catalogue.digests, "P65": "0" * 64}
    result = patched_selection(edited, tree_0201, target, ids, memo)
    attention = next(g for g in independent_groups(catalogue, catalogue.closure(ids)) if "P65" in g)
    assert result.patched == tuple(attention) and len(attention) < len(catalogue.closure(ids))
    _same(result, whole)


def test_every_input_is_in_the_key(tmp_path, catalogue, tree_0201, shipped, monkeypatch):
    ids, target = shipped
    memo = SelectionMemo(tmp_path)
    base = memo.key(tree_0201, catalogue, target, ids)
    edited = copy.copy(catalogue)
    edited.digests = {**catalogue.digests, "P65": "0" * 64}
    keys = {
        "patch module edited": memo.key(tree_0201, edited, target, ids),
        "other source": memo.key(SourceTree(tree_0201.root, tree_0201.vllm_version, "sha256:" + "1" * 64, "x"),
                                 catalogue, target, ids),
        "other SM": memo.key(tree_0201, catalogue, dataclasses.replace(target, sm=86), ids),
        "one patch fewer": memo.key(tree_0201, catalogue, target, ids[:-1]),
    }
    monkeypatch.setattr(memo_module, "engine_digest", lambda: "an edited engine")
    keys["engine edited"] = memo.key(tree_0201, catalogue, target, ids)
    assert base not in keys.values() and len(set(keys.values())) == len(keys)


def test_a_group_that_read_another_groups_output_means_a_whole_run(tmp_path, catalogue, tree_0201, shipped, whole):
    ids, target = shipped
    memo = SelectionMemo(tmp_path)
    patched_selection(catalogue, tree_0201, target, ids, memo)
    key = memo.key(tree_0201, catalogue, target, ["P4"])
    entry = memo.get(key)
    memo.put(key, dataclasses.replace(entry, reads=entry.reads | {"config/vllm.py"}))  # P66's file
    result = patched_selection(catalogue, tree_0201, target, ids, memo)
    assert sorted(result.patched) == sorted(catalogue.closure(ids))  # not trusted: all patched again
    _same(result, whole)


def test_without_a_memo_everything_is_patched(catalogue, tree_0201, shipped, whole):
    ids, target = shipped
    result = patched_selection(catalogue, tree_0201, target, ids)
    assert sorted(result.patched) == sorted(catalogue.closure(ids))
    _same(result, whole)


@pytest.mark.parametrize("jobs", [1, 2])
def test_forked_is_called_once_when_no_more_processes_will_fork(tmp_path, catalogue, tree_0201, shipped, jobs):
    """A build compiles its kernels in a thread from this hook: it must come after the last fork."""
    import multiprocessing

    ids, target = shipped
    memo = SelectionMemo(tmp_path / "cache")
    for run in ("cold", "warm"):
        seen: list[int] = []
        patched_selection(catalogue, tree_0201, target, ids, memo, jobs=jobs,
                          forked=lambda changed, seen=seen: seen.append(len(multiprocessing.active_children())))
        assert len(seen) == 1, run
        if run == "cold" and jobs == 2:
            assert seen == [2]  # both workers (all the pool will ever fork) exist before the hook ran
        else:
            assert seen == [0]  # nothing forks: patched in this process, or all from the memo


_ORDER_LOG: Path | None = None  # where _logged_run_group notes each group it ran
_RUN_GROUP = memo_module._run_group


def _logged_run_group(group: list[str]):  # module level: the pool pickles it by name
    result = _RUN_GROUP(group)
    with _ORDER_LOG.open("a") as handle:
        handle.write(f"done {','.join(group)} nice {os.getpriority(os.PRIO_PROCESS, 0)}\n")
    return result


@pytest.mark.parametrize("jobs", [1, 2])
def test_the_groups_of_the_first_files_run_first_and_hand_their_final_text(tmp_path, monkeypatch, catalogue,
                                                                           tree_0201, shipped, whole, jobs):
    """A build's kernels compile from what PN119 writes: its group runs first, and ``forked`` gets
    those files' patched text (exactly the result's) as soon as it is done, before the rest."""
    ids, target = shipped
    kernel_dir = "v1/attention/ops/"
    lead = next(g for g in independent_groups(catalogue, catalogue.closure(ids))
                if any(t.startswith(kernel_dir) for pid in g for t in catalogue.get(pid).targets))
    log = tmp_path / "order.log"  # appended to by the forked workers too
    monkeypatch.setattr(sys.modules[__name__], "_ORDER_LOG", log)

    def forked(changed):
        handed.append(changed)
        with log.open("a") as handle:
            handle.write("forked\n")

    monkeypatch.setattr(memo_module, "_run_group", _logged_run_group)
    handed: list[dict] = []
    result = patched_selection(catalogue, tree_0201, target, ids, SelectionMemo(tmp_path / "cache"), jobs=jobs,
                               forked=forked, first=lambda rel: rel.startswith(kernel_dir))
    _same(result, whole)
    expected = {rel: text for rel, text in whole.changed_text().items() if rel.startswith(kernel_dir)}
    assert expected and handed == [expected]  # PN119's two files, as the whole selection writes them
    order = log.read_text().splitlines()
    assert len(order) == len(independent_groups(catalogue, catalogue.closure(ids))) + 1
    done_lead = next(i for i, line in enumerate(order) if line.startswith(f"done {','.join(lead)} "))
    assert done_lead < order.index("forked")
    if jobs == 1:  # in this process: the leading group, the hook, then every other group
        assert order.index("forked") == 1 and done_lead == 0


@pytest.mark.parametrize("started", [True, False])
def test_the_patch_processes_make_way_for_work_started_beside_them(tmp_path, monkeypatch, catalogue, tree_0201,
                                                                   shipped, started):
    """``forked`` returning True (a build: its kernel compile began) lowers the patch processes'
    priority to ``YIELD_NICE`` for the rest of the patching; returning False leaves it as it was."""
    ids, target = shipped
    log = tmp_path / "order.log"
    monkeypatch.setattr(sys.modules[__name__], "_ORDER_LOG", log)
    monkeypatch.setattr(memo_module, "_run_group", _logged_run_group)

    def forked(changed):
        with log.open("a") as handle:
            handle.write("forked\n")
        return started

    patched_selection(catalogue, tree_0201, target, ids, SelectionMemo(tmp_path / "cache"), jobs=2, forked=forked,
                      first=lambda rel: rel.startswith("v1/attention/ops/"))
    order = log.read_text().splitlines()
    after = [int(line.rsplit(" ", 1)[1]) for line in order[order.index("forked") + 1:]]
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert after and set(after) == ({max(base, memo_module.YIELD_NICE)} if started else {base})
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # (this process is left as it was)


def test_without_a_memo_the_first_files_are_handed_after_the_whole_run(catalogue, tree_0201, shipped, whole):
    ids, target = shipped
    handed: list[dict] = []
    patched_selection(catalogue, tree_0201, target, ids, forked=handed.append,
                      first=lambda rel: rel.startswith("v1/attention/ops/"))
    assert handed == [{rel: text for rel, text in whole.changed_text().items()
                       if rel.startswith("v1/attention/ops/")}]
