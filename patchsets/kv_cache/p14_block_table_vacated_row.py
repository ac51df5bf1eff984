"""P14: the block-table row ``condense()`` vacates is zeroed, so no stale copy of a request's blocks stays behind.

The V1 runner keeps one block-table row per request slot (``v1/worker/block_table.py``). When
requests finish, ``InputBatch.condense()`` slides the last requests down into the freed slots
with ``BlockTable.move_row(src, tgt)`` (``v1/worker/gpu_input_batch.py:736`` on 0.20.1). On
0.20.1 ``move_row`` copies the row and leaves the source as it was (``block_table.py:130-134``):
the slot past the batch keeps a second copy of the moved request's block ids, and its
``num_blocks_per_row`` still counts them. ``remove_request()`` does clear the row of a finished
request (``clear_row``, ``gpu_input_batch.py:507``); only the vacated row escapes.

Two things read that copy:
- a dummy run (``GPUModelRunner._dummy_run``) commits and reads rows ``[0, num_reqs)`` of the
  table whatever they hold (``gpu_model_runner.py:5449-5464``), and the GDN/Mamba layers take
  their state slots from column 0 of those rows and write state in place: a stale row points
  them at the moved request's live state block, or at a block freed and reallocated since
  (vllm#49757);
- a later ``add_row`` into that slot resets the count and writes only the new request's
  blocks, so a shorter request keeps the old occupant's ids past its own (the "stale tail" of
  vllm#39589/#39591, Genesis's P14).

What the patch does: after the copy, ``move_row`` zeroes the source row's entries and count,
as vLLM does from vllm#49757. Every path that shrinks a row then zeroes what it drops
(``clear_row``, ``move_row``; ``swap_row`` exchanges whole rows; the buffers start zeroed), so
no row holds an id past its count and no row past the batch holds any. That invariant is also
what Genesis's P14 wants (it zero-fills the target row's tail after ``append_row`` and
``move_row``), without leaving the vacated row to a dummy run. ``condense`` never moves a row
onto itself (``empty_index < last_req_index``, ``gpu_input_batch.py:696-697``), as upstream's
version also assumes.

Who can observe it on 0.20.1: dummy runs during serving come only from data parallelism
(``DPEngineCoreProc``'s busy loop, ``v1/engine/core.py:1758``; ``LLMEngine`` with a DP group,
``llm_engine.py:192-193``); the startup dummy runs (profile, warm-up, graph capture) run
before any request, on an all-zero table. The attention kernels and the GDN gather read a
live row only up to what its sequence length needs (FlashInfer's page copy is masked at the
row's page count, ``v1/attention/backends/flashinfer.py:1851-1857``; align mode gathers
``(seq_len - 1) // block_size`` plus the speculative blocks, ``v1/attention/backends/utils.py:886-898``,
which the runner allocates, ``v1/worker/mamba_utils.py:189-192``). Padded CUDA-graph rows are
filled with the null block (``gpu_model_runner.py:2140-2142``). So with one engine and no KV
connector the stale copy is written and never read; the patch matters for a data-parallel or
disaggregated deployment.

Verdicts: 0.20.1 APPLIES. 0.33.0 UPSTREAM: ``move_row`` zeroes the vacated row itself
(``v1/worker/block_table.py:145-146``, vllm#49757).

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1-0.26.0: APPLIES: ``move_row`` copies the row and leaves the source as it was.
- 0.27.0 on: UPSTREAM: ``move_row`` zeroes the vacated row after the copy (vllm#49757;
  ``v1/worker/block_table.py:174`` on 0.27.0-0.28.0, ``:193`` on 0.29.0-0.31.0, ``:145`` on
  0.32.0 and 0.33.0).
"""

import libcst as cst
import libcst.matchers as m

from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import cls, func, marked, statements, unmarked, with_marker

TARGET = "v1/worker/block_table.py"
BLOCK_TABLE = cls("BlockTable")
MOVE_ROW = func("move_row")
WHY = "zero the vacated source row: a dummy run reads rows past the batch as Mamba state slots"


def _self_attr(name: str) -> m.Attribute:
    return m.Attribute(value=m.Name("self"), attr=m.Name(name))


# `self.num_blocks_per_row[tgt] = num_blocks`: the target row's count, the copy's last statement.
TARGET_COUNT = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[
                m.AssignTarget(
                    m.Subscript(
                        value=_self_attr("num_blocks_per_row"),
                        slice=[m.SubscriptElement(m.Index(m.Name("tgt")))],
                    )
                )
            ],
            value=m.Name("num_blocks"),
        )
    ]
)


def _zero_source_entries(**kwargs) -> m.SimpleStatementLine:
    """``<the table's array>[src, ...] = 0``: the source row's block ids zeroed, however the array
    is spelt (``block_table_np``, ``self.block_table.np``); not the count (``num_blocks_per_row``)."""
    return m.SimpleStatementLine(
        body=[
            m.Assign(
                targets=[
                    m.AssignTarget(
                        m.Subscript(
                            value=~_self_attr("num_blocks_per_row"),
                            slice=[m.SubscriptElement(m.Index(m.Name("src"))), m.ZeroOrMore()],
                        )
                    )
                ],
                value=m.Integer("0"),
            )
        ],
        **kwargs,
    )


class ZeroVacatedRow(Codemod):
    """After ``move_row`` copies ``src`` to ``tgt``, the source row's ids and count are zeroed."""

    target = TARGET
    anchor = (BLOCK_TABLE, MOVE_ROW, TARGET_COUNT)
    patched = (BLOCK_TABLE, MOVE_ROW, _zero_source_entries(leading_lines=marked("P14")))
    upstream = (BLOCK_TABLE, MOVE_ROW, _zero_source_entries(leading_lines=unmarked("P14")))

    def rewrite(self, node):
        entries, count = statements(
            """
            self.block_table.np[src, :num_blocks] = 0
            self.num_blocks_per_row[src] = 0
            """
        )
        return cst.FlattenSentinel([node, with_marker(entries, "P14", WHY), count])


class P14(Patch):
    id = "P14"
    family = "kv_cache"
    title = "Block table: move_row zeroes the row it vacates"
    why = (
        "InputBatch.condense() moves a request to a lower slot with BlockTable.move_row, which "
        "leaves the vacated row holding the request's block ids: a dummy run reads that row as "
        "Mamba/GDN state slots and writes state into the live (or freed and reused) blocks, and "
        "a shorter request added there keeps the old ids past its own. Zero the row (vllm#49757)."
    )
    upstream_refs = ("vllm#49757", "vllm#39591", "vllm#39589")
    written_for = ">=0.20.1"
    edits = (ZeroVacatedRow,)

