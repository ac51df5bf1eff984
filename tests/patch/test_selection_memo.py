"""A build's patched selection is remembered by content: a warm rebuild skips the patching,
and any changed input (patch module, source, target, selection, engine) patches again."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from kiln import paths
from kiln.definitions import load_definition
from kiln.patch import memo as memo_module
from kiln.patch.engine import Session, run_selection
from kiln.patch.memo import SelectionMemo, patched_selection
from kiln.pins import load_pins
from kiln.source.tree import SourceTree


@pytest.fixture(scope="module")
def shipped(catalogue):
    pins = load_pins(paths.PINS)
    definition = load_definition(paths.IMAGES, "qwen3.6-27b-tq", catalogue, pins)
    return definition, definition.target(pins["v0.20.1"], 120)


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = memo_module.run_selection

    def counting(*args):
        calls.append(args[3])
        return real(*args)

    monkeypatch.setattr(memo_module, "run_selection", counting)
    return calls


def test_second_call_reuses_the_first_exactly(tmp_path, catalogue, tree_0201, shipped, counted):
    definition, target = shipped
    memo = SelectionMemo(tmp_path)
    ids = list(definition.patches)
    first = patched_selection(catalogue, tree_0201, target, ids, memo)
    again = patched_selection(catalogue, tree_0201, target, ids, memo)
    assert len(counted) == 1 and not first.memoised and again.memoised
    assert again.changed_text() == first.changed_text() and again.changed
    assert [(o.patch_id, o.verdict, o.detail, o.files) for o in again.outcomes.values()] == \
           [(o.patch_id, o.verdict, o.detail, o.files) for o in first.outcomes.values()]
    # and what it remembers is what the engine computes
    direct = run_selection(catalogue, Session(tree_0201), target, ids)
    assert again.changed_text() == direct.changed_text()


def test_any_input_changed_patches_again(tmp_path, catalogue, tree_0201, shipped, counted):
    definition, target = shipped
    memo = SelectionMemo(tmp_path)
    ids = list(definition.patches)
    base = memo.key(tree_0201, catalogue, target, ids)
    edited = copy.copy(catalogue)
    edited.digests = {**catalogue.digests, "P65": "0" * 64}
    other_tree = SourceTree(tree_0201.root, tree_0201.vllm_version, "sha256:" + "1" * 64, "elsewhere")
    keys = {
        "patch module edited": memo.key(tree_0201, edited, target, ids),
        "other source": memo.key(other_tree, catalogue, target, ids),
        "other SM": memo.key(tree_0201, catalogue, dataclasses.replace(target, sm=86), ids),
        "one patch fewer": memo.key(tree_0201, catalogue, target, ids[:-1]),
    }
    assert base not in keys.values() and len(set(keys.values())) == len(keys)
    patched_selection(catalogue, tree_0201, target, ids, memo)
    patched_selection(edited, tree_0201, target, ids, memo)  # another key: patched again
    assert len(counted) == 2


def test_engine_code_is_part_of_the_key(tmp_path, catalogue, tree_0201, shipped, monkeypatch):
    definition, target = shipped
    memo = SelectionMemo(tmp_path)
    before = memo.key(tree_0201, catalogue, target, list(definition.patches))
    monkeypatch.setattr(memo_module, "engine_digest", lambda: "an edited engine")
    assert memo.key(tree_0201, catalogue, target, list(definition.patches)) != before


def test_no_memo_always_patches(catalogue, tree_0201, shipped, counted):
    definition, target = shipped
    patched_selection(catalogue, tree_0201, target, list(definition.patches))
    patched_selection(catalogue, tree_0201, target, list(definition.patches))
    assert len(counted) == 2
