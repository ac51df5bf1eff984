"""P14 on real 0.20.1 and 0.33.0 source: the row ``condense()`` vacates no longer keeps a request's blocks.

What runs: the whole ``v1/worker/block_table.py`` of 0.20.1 (pristine and patched by P14) and of
0.33.0 (pristine: upstream's fix, vllm#49757), imported as ``vllm.v1.worker.block_table`` with
``tests/support/vllm_modules.py`` on CPU torch. ``CpuGpuBuffer`` is the tree's own class (executed
from its ``v1/utils.py``, whose module imports the engine); the parallel groups, logger and Triton
are stubs, and no stub may be called while the table is used. The real ``BlockTable`` then goes
through what the V1 runner does to it: ``add_row`` for new requests, ``clear_row`` from
``InputBatch.remove_request``, ``move_row(last_req_index, empty_index)`` from
``InputBatch.condense`` (the test checks that 0.20.1's ``condense`` makes that call), and what a
dummy run reads: ``commit_block_table(num_reqs)`` then ``get_device_tensor(num_reqs)[:, 0]``, the
column the GDN/Mamba metadata takes as state slots (``gdn_attn.py:207``).
"""

from __future__ import annotations

import random
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.patchsets.support.patchlib import (
    assert_applies_once,
    assert_upstream,
    extract,
    patched_files,
)
from tests.support.vllm_modules import VllmModules

TARGET = "v1/worker/block_table.py"
BLOCKS = 6  # per row
ROWS = 4


# -- verdicts ------------------------------------------------------------------------------------


def test_verdicts(catalogue, sessions):
    assert_applies_once(catalogue, sessions("v0.20.1"), "P14")
    detail = assert_upstream(catalogue, sessions("v0.33.0"), "P14")
    assert f"{TARGET}:145" in detail


def test_condense_moves_rows_with_move_row(sessions):
    """The scenario below calls move_row as 0.20.1's condense() does, after remove_request cleared."""
    batch = sessions("v0.20.1").tree.read("v1/worker/gpu_input_batch.py")
    condense = extract(batch, "InputBatch.condense")
    assert "self.block_table.move_row(last_req_index, empty_index)" in condense
    assert "self.block_table.clear_row(req_index)" in extract(batch, "InputBatch.remove_request")


# -- the real BlockTable ---------------------------------------------------------------------------


def _load(tree, text: str, where: Path):
    """``vllm.v1.worker.block_table`` from ``text``, in a root of its own; ``CpuGpuBuffer`` from ``tree``."""
    (where / "vllm/v1/worker").mkdir(parents=True)
    (where / "vllm/v1/worker" / "block_table.py").write_text(text)
    namespace = {"torch": torch, "np": np, "PIN_MEMORY": False}  # 0.33.0's default argument; passed anyway
    exec(compile(extract(tree.read("v1/utils.py"), "CpuGpuBuffer"), "vllm/v1/utils.py", "exec"), namespace)
    utils = types.SimpleNamespace(CpuGpuBuffer=namespace["CpuGpuBuffer"])
    return VllmModules(where, real=["vllm.v1.worker.block_table"], standins={"vllm.v1.utils": vars(utils)})


@pytest.fixture(scope="module")
def tables(catalogue, sessions, tmp_path_factory):
    """name -> a factory of fresh real ``BlockTable`` objects (pristine, patched, upstream)."""
    old, new = sessions("v0.20.1"), sessions("v0.33.0")
    texts = {
        "pristine": (old.tree, old.tree.read(TARGET)),
        "patched": (old.tree, patched_files(catalogue, old, "P14")[TARGET]),
        "upstream": (new.tree, new.tree.read(TARGET)),
    }
    out = {}
    for name, (tree, text) in texts.items():
        with _load(tree, text, tmp_path_factory.mktemp(f"p14-{name}")) as vm:
            module = vm.load("vllm.v1.worker.block_table")
        out[name] = _factory(module, name == "upstream")
    return out


def _factory(module, upstream: bool):
    common = dict(block_size=16, max_num_reqs=ROWS, max_num_blocks_per_req=BLOCKS, max_num_batched_tokens=64,
                  pin_memory=False, device=torch.device("cpu"), cp_kv_cache_interleave_size=1)

    def make():
        if upstream:  # 0.33.0: no kernel block size; a Mamba group's table has no slot mapping
            return module.BlockTable(**common, slot_mapping_mode=module.SlotMappingMode.NONE)
        return module.BlockTable(**common, kernel_block_size=16)

    return make


def _rows(table) -> list[list[int]]:
    return table.block_table.np.tolist()


def _scenario(table) -> dict:
    """A(2 blocks) B(1) C(5) in rows 0-2; B finishes; condense moves C to row 1; a dummy run over 3
    rows; then D(2 blocks) is added in row 2, the first free slot."""
    with VllmModules.recording() as stubs:
        table.add_row([1, 2], 0)
        table.add_row([3], 1)
        table.add_row([4, 5, 6, 7, 8], 2)
        table.clear_row(1)  # remove_request(B)
        table.move_row(2, 1)  # condense(): C from the last slot into B's
        after_move = {"rows": _rows(table), "counts": table.num_blocks_per_row.tolist()}
        table.commit_block_table(3)  # _dummy_run(num_reqs_padded=3)
        slots = table.get_device_tensor(3)[:, 0].tolist()
        table.add_row([9, 10], 2)  # a new request D in the vacated slot
        after_add = {"rows": _rows(table), "counts": table.num_blocks_per_row.tolist()}
    return {"after_move": after_move, "dummy_state_slots": slots, "after_add": after_add, "stubs": stubs}


def _stale_past_count(table) -> list[tuple[int, list[int]]]:
    """(row, ids) for every row holding a nonzero id past its count."""
    out = []
    for row, count in enumerate(table.num_blocks_per_row.tolist()):
        tail = table.block_table.np[row, count:].tolist()
        if any(tail):
            out.append((row, tail))
    return out


def test_pristine_leaves_the_vacated_row_and_a_stale_tail(tables):
    result = _scenario(tables["pristine"]())
    assert result["stubs"] == []
    assert result["after_move"]["rows"][2] == [4, 5, 6, 7, 8, 0]  # C's ids, twice in the table
    assert result["after_move"]["counts"][2] == 5
    assert result["dummy_state_slots"] == [1, 4, 4]  # the dummy's third row: C's live state block
    assert result["after_add"]["rows"][2] == [9, 10, 6, 7, 8, 0]  # D's row keeps C's ids past its own


def test_patched_zeroes_the_vacated_row(tables):
    table = tables["patched"]()
    result = _scenario(table)
    assert result["stubs"] == []
    assert result["after_move"]["rows"][1] == [4, 5, 6, 7, 8, 0]  # C moved
    assert result["after_move"]["rows"][2] == [0] * BLOCKS
    assert result["after_move"]["counts"] == [2, 5, 0, 0]
    assert result["dummy_state_slots"] == [1, 4, 0]  # the null block, no request's state
    assert result["after_add"]["rows"][2] == [9, 10, 0, 0, 0, 0]
    assert _stale_past_count(table) == []


def test_patched_matches_upstream(tables):
    patched, upstream = _scenario(tables["patched"]()), _scenario(tables["upstream"]())
    for key in ("after_move", "dummy_state_slots", "after_add"):
        assert patched[key] == upstream[key], key


@pytest.mark.parametrize("seed", range(4))
def test_no_id_past_a_rows_count_over_a_serving_run(tables, seed):
    """Requests come and go as the input batch adds, removes and condenses them: with the patch
    (and upstream) no row ever holds an id past its count and every row past the batch is zero;
    pristine breaks both. The three tables see the same operations."""
    rng = random.Random(seed)
    made = {name: tables[name]() for name in ("pristine", "patched", "upstream")}
    live: list[int | None] = []  # slot -> request's first block id (None: removed, not condensed)
    next_id, violations = 10, {name: 0 for name in made}
    for _ in range(60):
        removed = [i for i, r in enumerate(live) if r is None]
        if live.count(None) < len(live) and rng.random() < 0.4:  # a request finishes
            slot = rng.choice([i for i, r in enumerate(live) if r is not None])
            live[slot] = None
            for table in made.values():
                table.clear_row(slot)
        elif len([r for r in live if r is not None]) < ROWS:  # a request arrives: a removed slot first
            slot = min(removed) if removed else len(live)
            ids = list(range(next_id, next_id + rng.randint(1, BLOCKS)))
            next_id += len(ids)
            if slot == len(live):
                live.append(ids[0])
            else:
                live[slot] = ids[0]
            for table in made.values():
                table.add_row(ids, slot)
        # condense(): the last live slot into the smallest empty one, as gpu_input_batch does
        while None in live:
            empty = live.index(None)
            last = max((i for i, r in enumerate(live) if r is not None), default=-1)
            if empty >= last:
                del live[empty:]
                break
            for table in made.values():
                table.move_row(last, empty)
            live[empty], live[last] = live[last], None
        for name, table in made.items():
            beyond = table.block_table.np[len(live):].any()
            if _stale_past_count(table) or beyond:
                violations[name] += 1
        assert _rows(made["patched"]) == _rows(made["upstream"])
        assert made["patched"].num_blocks_per_row.tolist() == made["upstream"].num_blocks_per_row.tolist()
    assert violations["patched"] == 0 and violations["upstream"] == 0
    assert violations["pristine"] > 0
