"""P99 (variant): ``WorkspaceManager.get_simultaneous`` hands back the views it built last time.

From 0.21.0 every TurboQuant decode call asks the ``WorkspaceManager`` for its three scratch
views (``_decode_attention``: ``mid_o``, ``output``, ``lse``), in every attention layer, every
step, and the MTP drafter does the same: on Qwen3.6-27B (16 attention layers) with K=3 that is
~20 calls per step. Each call recomputes byte sizes, 256-byte alignment and offsets, goes
through ``_ensure_workspace_size`` and builds N ``view().reshape()`` tensors, for the same
shapes every time. Genesis attributed a -17 % decode regression on 2x A5000 to this
indirection (vllm#40941's first nightly) and memoised it; its own later A/B of the memo on a
newer pin was within noise, and kiln has not measured it: this is a variant an image opts
into (``variant = True``), not part of the default set, until a GPU benchmark says so.

The memo is keyed by the workspace slot (``_get_workspace_id()`` on 0.33.0: ubatch and lane;
``dbo_current_ubatch_id()`` before) and the exact ``shapes_and_dtypes`` tuple, and remembers
which workspace tensor the views were cut from: a hit requires that tensor to still be the
slot's current workspace, so it never needs to grow and the locked-workspace assertion keeps
its meaning (a request that does not fit still reaches ``_ensure_workspace_size``). When a
slot grows, ``_ensure_workspace_size`` drops the memo before it frees the old buffer, so cached
views never keep a freed workspace alive (upstream frees it first on purpose, to bound peak
memory). Callers get a new list each time (the tensors are the cached views). A request whose
shapes are not hashable (a list) is served unmemoised; the memo keeps the 64 newest entries
(continuation prefill asks for a new length per chunk).

Verdicts: APPLIES on 0.20.1 (there the fused-MoE modular kernel and MLA/flash-attention
backends call it; TurboQuant starts in 0.21.0) and on 0.33.0 (``v1/worker/workspace.py``:
``get_simultaneous`` is unchanged apart from a blank line; ``_ensure_workspace_size`` keys
slots by ``_get_workspace_id()``). No release memoises it; the upstream shape to watch is a
memo lookup in ``get_simultaneous`` (``upstream`` matcher: a ``.get(`` on ``self._*`` before the
size arithmetic).

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1-0.33.0: APPLIES (a variant: opt-in). ``WorkspaceManager.get_simultaneous``
  (``v1/worker/workspace.py:92`` on 0.20.1, ``:181`` on 0.33.0) rebuilds its views on every call
  in every release, and none memoises them; from 0.21.0 TurboQuant's decode is one of its
  callers (see PN353A), before that the fused-MoE and MLA/flash-attention paths are.
"""

import libcst as cst
import libcst.matchers as m

from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import (
    assign_to,
    cls,
    func,
    insert_after,
    insert_before,
    marked,
    statements,
    with_marker,
)

TARGET = "v1/worker/workspace.py"
MANAGER = cls("WorkspaceManager")
GET = func("get_simultaneous")
ENSURE = func("_ensure_workspace_size")
MEMO = "_views_memo"
WHY = "same shapes, same workspace: hand back the views built last time"


def _self_attr(name: str) -> m.Attribute:
    return m.Attribute(value=m.Name("self"), attr=m.Name(name))


LOCKED_INIT = m.SimpleStatementLine(body=[m.AnnAssign(target=_self_attr("_locked"))])
SIZES = assign_to("actual_bytes")
RETURN_VIEWS = m.SimpleStatementLine(body=[m.Return(value=m.ListComp())])
# `self._current_workspaces[<slot>] = None`: the old buffer is dropped before a larger one
DROP_OLD = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(target=m.Subscript(value=_self_attr("_current_workspaces")))],
            value=m.Name("None"),
        )
    ]
)
# a memo lookup vLLM might add itself: `... = self._<anything>.get(...)` before the arithmetic
UPSTREAM_LOOKUP = m.SimpleStatementLine(
    body=[m.Assign(value=m.Call(func=m.Attribute(value=m.Attribute(value=m.Name("self")), attr=m.Name("get"))))]
)


class InitMemo(Codemod):
    target = TARGET
    anchor = (MANAGER, func("__init__"), LOCKED_INIT)
    patched = (MANAGER, func("__init__"), m.SimpleStatementLine(leading_lines=marked("P99")))

    def rewrite(self, node):
        (memo,) = statements(f"self.{MEMO}: dict[tuple, tuple[torch.Tensor, list[torch.Tensor]]] = {{}}")
        return insert_after(node, with_marker(memo, "P99", WHY), blank_line=False)


class LookUpMemo(Codemod):
    target = TARGET
    anchor = (MANAGER, GET, SIZES)
    patched = (MANAGER, GET, m.SimpleStatementLine(leading_lines=marked("P99"), body=[m.Assign()]))
    upstream = (MANAGER, GET, UPSTREAM_LOOKUP)

    def rewrite(self, node):
        first, *rest = statements(
            f"""
            slot = (
                self._get_workspace_id()
                if hasattr(self, "_get_workspace_id")
                else dbo_current_ubatch_id()
            )
            memo_key = (slot, shapes_and_dtypes)
            try:
                cached = self.{MEMO}.get(memo_key)
            except TypeError:  # a shape given as a list cannot be a key: not memoised
                memo_key = cached = None
            if cached is not None and cached[0] is self._current_workspaces[slot]:
                return list(cached[1])
            """
        )
        return insert_before(node, with_marker(first, "P99", WHY), *rest)


class StoreMemo(Codemod):
    target = TARGET
    anchor = (MANAGER, GET, RETURN_VIEWS)
    patched = (MANAGER, GET, m.SimpleStatementLine(leading_lines=marked("P99"), body=[m.Assign(targets=[m.AssignTarget(target=m.Name("views"))])]))

    def rewrite(self, node):
        views = cst.SimpleStatementLine(
            body=[cst.Assign(targets=[cst.AssignTarget(target=cst.Name("views"))], value=node.body[0].value)],
            leading_lines=node.leading_lines,
        )
        store, ret = statements(
            f"""
            if memo_key is not None:
                if len(self.{MEMO}) >= 64:  # e.g. one per continuation length: keep the newest
                    self.{MEMO}.pop(next(iter(self.{MEMO})))
                self.{MEMO}[memo_key] = (current_workspace, views)
            return list(views)
            """
        )
        return cst.FlattenSentinel([with_marker(views, "P99", WHY), store, ret])


class DropMemoOnGrowth(Codemod):
    target = TARGET
    anchor = (MANAGER, ENSURE, DROP_OLD)
    patched = (MANAGER, ENSURE, m.SimpleStatementLine(leading_lines=marked("P99")))

    def rewrite(self, node):
        (clear,) = statements(
            f"""
            self.{MEMO} = {{  # cached views must not keep the old buffer alive
                key: entry for key, entry in self.{MEMO}.items() if entry[0] is not current_workspace
            }}
            """
        )
        return insert_before(node, with_marker(clear, "P99", "the workspace grows: forget views of the old buffer"))


class P99(Patch):
    id = "P99"
    family = "attention_turboquant"
    title = "WorkspaceManager.get_simultaneous memoised per slot and shapes (variant, unmeasured)"
    why = (
        "TurboQuant decode asks the WorkspaceManager for the same three scratch views in every "
        "layer and step; each call redoes the offset arithmetic and builds fresh views. Return "
        "the views cut from the same workspace tensor last time; forget them when it grows."
    )
    upstream_refs = ("vllm#40941",)
    written_for = ">=0.20.1"
    variant = True  # Python overhead only; kiln has no GPU measurement of the gain yet
    edits = (InitMemo, LookUpMemo, StoreMemo, DropMemoOnGrowth)
