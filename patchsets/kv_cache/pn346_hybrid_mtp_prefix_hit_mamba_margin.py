"""PN346: with MTP and prefix caching on a hybrid model, the Mamba/GDN lookup no longer lengthens the hit.

``HybridKVCacheCoordinator.find_longest_cache_hit`` (``v1/core/kv_cache_coordinator.py``)
reconciles the cache hit of each KV-cache group. Under EAGLE/MTP it gives every *eagle group*
one extra block of search room ("match one more block and then pop the last"): the manager
matches up to the candidate plus a block and drops the last matched block, so the target model
recomputes that block's hidden states for the drafter. ``FullAttentionManager`` does the drop;
``MambaManager.find_longest_cache_hit`` ignores its eagle flag (a Mamba hit is one state at a
boundary, nothing to pop). On 0.20.1 the Mamba group is an eagle group for Qwen3.5/3.6: only
DeepSeek-V4 flags its draft group (``kv_cache_utils.py:1594-1607``), and with none flagged the
coordinator treats every group as one (``kv_cache_coordinator.py:59-64``).

So for MTP + ``--enable-prefix-caching`` on a GDN hybrid: full attention matches n blocks and
drops one (hit ``(n-1) * B``); the Mamba search then runs up to ``(n-1) * B + B`` and, when
the state at ``n * B`` is cached (a previous turn of the conversation crossed that boundary),
returns it. The hit grows back to ``n * B`` while the full-attention group holds only ``n - 1``
blocks: the request starts at token ``n * B`` with a block of attention context it never
computed (the slot the allocator hands out for tokens ``(n-1) * B .. n * B`` holds whatever was
there), the drafter loses the block it needed, and the output degrades silently (vllm#43559:
GSM8K 0.916 -> 0.900 on Qwen3.5/3.6-35B-A3B with MTP K=3 and prefix caching).

It is reachable when the cache-hit alignment equals the Mamba block (the usual hybrid setup:
one block size for all groups). With the kiln preset on 0.20.1 (TurboQuant + P5) the
attention block is twice the Mamba block, the alignment is the attention block, and the extra
Mamba half-block never reaches an aligned boundary: masked, not fixed (P5b, or an fp8/auto KV
cache, brings it back).

The patch gives the extra search room to non-Mamba groups only (``... and not
isinstance(spec, MambaSpec)``), which is how vLLM fixed it (vllm#49502, in 0.26.0): every group
may then only keep or shorten the candidate length. Genesis's PN346 (vllm#43650, open) fixed the same failure
inside ``MambaManager`` (search one block less under eagle); either shape reads as UPSTREAM.

Verdicts: 0.20.1 APPLIES (``kv_cache_coordinator.py:551``). 0.33.0 UPSTREAM: the coordinator
skips the margin for Mamba specs (``kv_cache_coordinator.py:875``: "No margin for mamba: its
finder never drops"), present since 0.26.0; the test reads it from both releases and APPLIES
on 0.21.0-0.25.1.

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1-0.25.1: APPLIES: the coordinator gives the eagle search margin to every eagle
  group, Mamba groups included (``v1/core/kv_cache_coordinator.py:551`` on 0.20.1).
- 0.26.0 on: UPSTREAM: ``if drop_eagle_block and not isinstance(spec, MambaSpec)`` ("No margin
  for mamba: its finder never drops"; ``v1/core/kv_cache_coordinator.py:746`` on 0.26.0,
  ``:875`` on 0.33.0; vllm#49502). 0.25.1's coordinator has no such test.
"""

import libcst as cst
import libcst.matchers as m

from kiln.patch.anchor import find, line_of
from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import cls, func, insert_after, marked, statements, with_marker

TARGET = "v1/core/kv_cache_coordinator.py"
MANAGERS = "v1/core/single_type_kv_cache_manager.py"
COORDINATOR = cls("HybridKVCacheCoordinator")
FIND = func("find_longest_cache_hit")
WHY = "Mamba finders never drop a block: searching one block further would lengthen the hit"

# `if use_eagle:` / `if drop_eagle_block:` whose body widens the search: `_max_length = min(...)`
WIDEN = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name("_max_length"))])])
EAGLE_MARGIN = m.If(body=m.IndentedBlock(body=[m.ZeroOrMore(), WIDEN, m.ZeroOrMore()]))
SPEC_IMPORT = m.SimpleStatementLine(
    body=[m.ImportFrom(module=m.Attribute(value=m.Attribute(), attr=m.Name("kv_cache_interface")))]
)
MAMBA_IMPORT = m.SimpleStatementLine(
    body=[
        m.ImportFrom(
            module=m.Attribute(attr=m.Name("kv_cache_interface")),
            names=[m.ZeroOrMore(), m.ImportAlias(name=m.Name("MambaSpec")), m.ZeroOrMore()],
        )
    ]
)


def _mentions(node: cst.CSTNode, name: str) -> bool:
    return bool(m.findall(node, m.Name(name)))


def _is_kiln(node: cst.CSTNode) -> bool:
    return any(line.comment and line.comment.value.startswith("# kiln PN346:") for line in node.leading_lines)


class ImportMambaSpec(Codemod):
    """``MambaSpec`` next to the coordinator's other ``kv_cache_interface`` imports."""

    target = TARGET
    anchor = (SPEC_IMPORT,)
    patched = (m.SimpleStatementLine(leading_lines=marked("PN346"), body=[m.ImportFrom()]),)

    def rewrite(self, node):
        (stmt,) = statements("from vllm.v1.kv_cache_interface import MambaSpec")
        return insert_after(node, with_marker(stmt, "PN346", WHY), blank_line=False)


class NoEagleMarginForMamba(Codemod):
    """The eagle search margin goes to groups whose finder drops a block: not Mamba."""

    target = TARGET
    anchor = (COORDINATOR, FIND, EAGLE_MARGIN)
    patched = (COORDINATOR, FIND, m.If(leading_lines=marked("PN346")))

    def rewrite(self, node):
        (template,) = statements("if _ and not isinstance(spec, MambaSpec):\n    pass")
        test = template.test.with_changes(left=node.test)
        return with_marker(node.with_changes(test=test), "PN346", WHY)


class PN346(Patch):
    id = "PN346"
    family = "kv_cache"
    title = "Hybrid prefix caching under MTP/EAGLE: no extra search block for Mamba groups"
    why = (
        "Under MTP every group of a hybrid gets one extra block of prefix-cache search; full "
        "attention drops it again, Mamba does not, so the hit can exceed the attention blocks "
        "by one block of never-computed context. Give the margin to non-Mamba groups only."
    )
    upstream_refs = ("vllm#43559", "vllm#43650", "vllm#49502")
    written_for = ">=0.20.1"
    edits = (ImportMambaSpec, NoEagleMarginForMamba)

    def upstream_fix(self, module_of):
        coordinator = module_of(TARGET)
        if coordinator is not None:
            for cls_node in find(coordinator, COORDINATOR):
                for method in find(cls_node, FIND):
                    for margin in find(method, EAGLE_MARGIN):
                        if not _is_kiln(margin) and _mentions(margin.test, "MambaSpec"):
                            return (
                                f"{TARGET}:{line_of(coordinator, margin)}: the eagle search margin "
                                "skips Mamba groups"
                            )
        managers = module_of(MANAGERS)
        if managers is not None:  # vllm#43650's shape: the Mamba finder searches one block less
            for cls_node in find(managers, cls("MambaManager")):
                for method in find(cls_node, FIND):
                    for shrink in find(
                        method,
                        m.If(body=m.IndentedBlock(body=[m.SimpleStatementLine(body=[m.AugAssign(target=m.Name("max_num_blocks"))])])),
                    ):
                        if _mentions(shrink.test, "drop_eagle_block") or _mentions(shrink.test, "use_eagle"):
                            return f"{MANAGERS}:{line_of(managers, shrink)}: MambaManager searches one block less under eagle"
        return None
