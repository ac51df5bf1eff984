"""P99 on real 0.20.1 and 0.33.0 source: memoised workspace views, identical to the unmemoised ones.

What runs: the patched and the pristine ``v1/worker/workspace.py`` of each tree as modules
(``tests/patchsets/support/tq_workspace.py``), on CPU. The patched manager must hand out
exactly the views the pristine one does (same memory, shape, dtype), skip the size
arithmetic on repeats, cut fresh views after the workspace grows (and not keep the old buffer
alive), keep the locked-workspace assertion, and keep ubatch/lane slots apart.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kiln.patch.engine import isolated_run
from kiln.patch.model import BuildTarget, Verdict
from tests.patchsets.support import tq_workspace as ws
from tests.patchsets.support.patchlib import patched_files

LABELS = ["v0.20.1", "v0.33.0"]
DECODE = (((4, 8, 32, 129), torch.float32), ((4, 8, 128), torch.bfloat16), ((4, 8), torch.float32))
BIGGER = (((1, 2, 4096, 128), torch.float16), ((1, 2, 4096, 128), torch.float16))  # 4 MiB > DECODE


@pytest.fixture(scope="module")
def texts(catalogue, sessions):
    out = {}
    for label in LABELS:
        session = sessions(label)
        out[label] = (session.tree.read(ws.WORKSPACE), patched_files(catalogue, session, "P99")[ws.WORKSPACE])
    return out


def _manager(text, monkeypatch, **kwargs):
    module = ws.load_workspace(text, monkeypatch)
    module.init_workspace_manager(torch.device("cpu"), **kwargs)
    return module, module.current_workspace_manager()


def _describe(views):
    return [(v.data_ptr() - views[0].data_ptr(), tuple(v.shape), v.dtype, v.stride()) for v in views]


@pytest.mark.parametrize("label", LABELS)
def test_views_match_the_pristine_manager(texts, label, monkeypatch):
    pristine, patched = texts[label]
    _, plain = _manager(pristine, monkeypatch)
    _, memo = _manager(patched, monkeypatch)
    for request in (DECODE, BIGGER, DECODE):
        expected, got = plain.get_simultaneous(*request), memo.get_simultaneous(*request)
        assert _describe(got) == _describe(expected)
        assert got[0].data_ptr() == memo._current_workspaces[0].data_ptr()


@pytest.mark.parametrize("label", LABELS)
def test_repeats_skip_the_size_arithmetic(texts, label, monkeypatch):
    _, patched = texts[label]
    _, memo = _manager(patched, monkeypatch)
    calls = []
    ensure = memo._ensure_workspace_size
    monkeypatch.setattr(memo, "_ensure_workspace_size", lambda n: calls.append(n) or ensure(n))
    first = memo.get_simultaneous(*DECODE)
    again = memo.get_simultaneous(*DECODE)
    assert len(calls) == 1
    assert all(a is b for a, b in zip(first, again, strict=True)) and first is not again  # cached views, new list
    first.clear()  # a caller's list is its own: the memo is not touched
    assert len(memo.get_simultaneous(*DECODE)) == 3


@pytest.mark.parametrize("label", LABELS)
def test_growth_recuts_views_and_frees_the_old_buffer(texts, label, monkeypatch):
    _, patched = texts[label]
    _, memo = _manager(patched, monkeypatch)
    small = memo.get_simultaneous(*DECODE)
    old = weakref.ref(memo._current_workspaces[0])
    del small
    memo.get_simultaneous(*BIGGER)  # grows: a new, larger buffer
    gc.collect()
    assert old() is None  # the memo does not keep the freed workspace alive
    again = memo.get_simultaneous(*DECODE)
    assert again[0].data_ptr() == memo._current_workspaces[0].data_ptr()


@pytest.mark.parametrize("label", LABELS)
def test_locked_workspace_still_refuses_growth(texts, label, monkeypatch):
    _, patched = texts[label]
    module, memo = _manager(patched, monkeypatch)
    memo.get_simultaneous(*DECODE)
    module.lock_workspace()
    memo.get_simultaneous(*DECODE)  # fits: served
    with pytest.raises(AssertionError, match="Workspace is locked"):
        memo.get_simultaneous(*BIGGER)


def test_lanes_keep_their_own_views(texts, monkeypatch):
    """0.33.0 keys workspaces by (ubatch, lane); the memo does the same."""
    _, patched = texts["v0.33.0"]
    module, memo = _manager(patched, monkeypatch, num_lanes=2)
    lane0 = memo.get_simultaneous(*DECODE)
    with module.use_workspace_lane(1):
        lane1 = memo.get_simultaneous(*DECODE)
    assert lane0[0].data_ptr() != lane1[0].data_ptr()
    assert lane1[0].data_ptr() == memo._current_workspaces[1].data_ptr()
    assert memo.get_simultaneous(*DECODE)[0] is lane0[0]


def test_ubatches_keep_their_own_views(texts, monkeypatch):
    _, patched = texts["v0.20.1"]
    module, memo = _manager(patched, monkeypatch, num_ubatches=2)
    first = memo.get_simultaneous(*DECODE)
    monkeypatch.setattr(module, "dbo_current_ubatch_id", lambda: 1)
    second = memo.get_simultaneous(*DECODE)
    assert first[0].data_ptr() != second[0].data_ptr()
    assert second[0].data_ptr() == memo._current_workspaces[1].data_ptr()


@pytest.mark.parametrize("label", LABELS)
def test_verdict_and_variant(catalogue, sessions, label):
    session = sessions(label)
    outcome = isolated_run(catalogue, session, BuildTarget(session.tree.vllm_version), "P99").outcomes["P99"]
    assert outcome.verdict is Verdict.APPLIES, outcome.detail
    assert "P99" not in catalogue.default_selection()


@pytest.mark.parametrize("label", LABELS)
def test_views_of_a_replaced_buffer_are_not_served(texts, label, monkeypatch):
    """Only the growth path replaces a slot's buffer today; the memo also checks identity."""
    _, patched = texts[label]
    _, memo = _manager(patched, monkeypatch)
    memo.get_simultaneous(*DECODE)
    memo._current_workspaces[0] = torch.empty_like(memo._current_workspaces[0])
    again = memo.get_simultaneous(*DECODE)
    assert again[0].data_ptr() == memo._current_workspaces[0].data_ptr()


@pytest.mark.parametrize("label", LABELS)
def test_unhashable_shapes_and_many_shapes(texts, label, monkeypatch):
    pristine, patched = texts[label]
    _, plain = _manager(pristine, monkeypatch)
    _, memo = _manager(patched, monkeypatch)
    listed = (([4, 8, 128], torch.bfloat16),)  # a list shape: served, not memoised
    assert _describe(memo.get_simultaneous(*listed)) == _describe(plain.get_simultaneous(*listed))
    for length in (199, *range(1, 200)):  # the largest first (no growth after), then one per chunk
        memo.get_simultaneous(((1, 2, length, 16), torch.float16), ((1, 2, length, 16), torch.float16))
    assert len(memo._views_memo) == 64
    def key(length):
        shape = ((1, 2, length, 16), torch.float16)
        return (0, (shape, shape))

    assert key(198) in memo._views_memo and key(1) not in memo._views_memo  # the oldest go first
    assert memo._views_memo[key(198)][1][0].shape == (1, 2, 198, 16)
