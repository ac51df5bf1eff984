"""P34: Mamba align mode, multimodal prompt: a prefill chunk cut short at an image is not rounded to zero.

What fails on 0.20.1: a hybrid model (Qwen3.5/3.6's Gated DeltaNet layers) in Mamba ``align``
cache mode (prefix caching) splits each prefill chunk so that it ends on a block boundary,
where the Mamba state is cached: ``Scheduler._mamba_block_aligned_split`` rounds the chunk
length down to a multiple of the block (``v1/core/sched/scheduler.py:337-339``). ``schedule``
calls it *after* ``_try_schedule_encoder_inputs`` (running requests ``:427-444``, waiting
``:696-717``), which cuts the chunk just before an image the encoder cache cannot take
(``:1222-1241``). The cache holds ``max(--max-num-batched-tokens, largest item)`` embeddings
(``v1/core/encoder_cache_manager.py:312-314``), and an image stays in it until the request's
computed tokens pass its end (``_free_encoder_inputs``, ``scheduler.py:1672-1675``). With two
large images, once the chunks reach the block in which the first image ends and the second
begins, the encoder cap leaves fewer than a block's tokens, the alignment rounds that to 0, the
request is skipped (``:446-461``, ``break`` at ``:717`` for a waiting one) and the first image
is never computed past, so never freed: the same happens every step, a permanent hang that
holds the request's KV blocks (vllm#40707).

What the patch does, as 0.33.0 does:
- ``schedule`` aligns a chunk before the encoder cap, in both loops (the split moves above the
  ``_try_schedule_encoder_inputs`` block; in the waiting loop into the branch that computes
  ``num_new_tokens``, right after ``assert num_new_tokens > 0``). A chunk the encoder cuts at an
  image is then kept as cut, even when it ends mid-block; a chunk the token budget leaves
  shorter than a block still waits, as before.
- ``_mamba_block_aligned_split``: a prefill chunk that starts mid-block (after such a cut)
  ends at that block's boundary when it reaches it. Align mode writes a chunk's final state
  into the block holding its last token, and ``cache_blocks`` caches that block once full
  (``v1/core/single_type_kv_cache_manager.py:954-1010``, ``:273-296``): a chunk running past
  the boundary would leave the block holding the state from the middle of the block, cached
  as its boundary state for every later request with that prefix. Ending there, the block
  gets the boundary state; the following chunks start aligned again.
Genesis's P34 keeps the short chunk inside the split and has no stop at the boundary: on
0.20.1 the next chunk, rounded from a mid-block start, would pass it (the poisoned cache above).

Verdicts: 0.20.1 APPLIES. 0.33.0 UPSTREAM: ``schedule`` aligns before the encoder cap
(``v1/core/sched/scheduler.py:859-863`` running, ``:1349-1355`` waiting) and the split stops a
mid-block start at the next boundary (``:621``, ``:644-649``).

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1-0.22.1: APPLIES: both loops call the split after the encoder cap.
- 0.23.0-0.27.1: DRIFTED (fail closed): the waiting loop's split reads
  ``if self.need_mamba_block_aligned_split and not load_kv_async:`` (``scheduler.py:721`` on
  0.23.0), still after the encoder cap, so these releases have the hang; the anchor does not take
  that test and the port has not been judged there.
- 0.28.0 on: UPSTREAM: ``schedule`` aligns before the encoder cap in both loops
  (``scheduler.py:579``/``:970`` on 0.28.0) and the split stops a mid-block start at the next
  boundary (``:415`` on 0.28.0; ``:621`` on 0.33.0).
"""

import libcst as cst
import libcst.matchers as m

from kiln.patch.anchor import find
from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import cls, func, kiln_marked, marked, place, statements, with_marker

TARGET = "v1/core/sched/scheduler.py"
SCHEDULER = cls("Scheduler")
SCHEDULE = (SCHEDULER, func("schedule"))
SPLIT = (SCHEDULER, func("_mamba_block_aligned_split"))


def _attr(owner: str, name: str) -> m.Attribute:
    return m.Attribute(value=m.Name(owner), attr=m.Name(name))


# `if request.has_encoder_inputs:` calling `self._try_schedule_encoder_inputs(...)`
ENCODER_IF = m.If(
    test=_attr("request", "has_encoder_inputs"),
    body=m.IndentedBlock(
        body=[
            m.SimpleStatementLine(
                body=[m.Assign(value=m.Call(func=_attr("self", "_try_schedule_encoder_inputs")))]
            ),
            m.ZeroOrMore(),
        ]
    ),
)


def _split_if(**kwargs) -> m.If:
    """``if self.need_mamba_block_aligned_split: num_new_tokens = self._mamba_block_aligned_split(...)``."""
    return m.If(
        test=_attr("self", "need_mamba_block_aligned_split"),
        body=m.IndentedBlock(
            body=[
                m.SimpleStatementLine(
                    body=[
                        m.Assign(
                            targets=[m.AssignTarget(target=m.Name("num_new_tokens"))],
                            value=m.Call(func=_attr("self", "_mamba_block_aligned_split")),
                        )
                    ]
                ),
                m.ZeroOrMore(),
            ]
        ),
        **kwargs,
    )


SPLIT_IF = _split_if()
ALIGN_FIRST = [m.ZeroOrMore(), SPLIT_IF, m.ZeroOrMore(), ENCODER_IF, m.ZeroOrMore()]  # upstream's order

# `while req_index < len(self.running) and token_budget > 0:`
RUNNING_TEST = (
    m.BooleanOperation(
        left=m.Comparison(
            left=m.Name("req_index"),
            comparisons=[m.ComparisonTarget(m.LessThan(), m.Call(args=[m.Arg(_attr("self", "running"))]))],
        )
    )
)
RUNNING_LOOP = m.While(test=RUNNING_TEST)
# `while (self.waiting or self.skipped_waiting) and token_budget > 0:`
WAITING_TEST = m.BooleanOperation(
    left=m.BooleanOperation(left=_attr("self", "waiting"), right=_attr("self", "skipped_waiting"))
)
WAITING_LOOP = m.While(test=WAITING_TEST)
# `if load_kv_async: ... else: <num_new_tokens; the encoder block last>`
LOAD_KV_ASYNC = m.If(
    test=m.Name("load_kv_async"),
    orelse=m.Else(body=m.IndentedBlock(body=[m.ZeroOrMore(), ENCODER_IF])),
)
# `if num_computed_tokens_after_sched < last_cache_position:` (then `elif`s): the split's rounding
ROUNDING = m.If(
    test=m.Comparison(
        left=m.Name("num_computed_tokens_after_sched"),
        comparisons=[m.ComparisonTarget(m.LessThan(), m.Name("last_cache_position"))],
    )
)
# `(start // block_size + 1) * block_size`: upstream's next block boundary
NEXT_BOUNDARY = m.BinaryOperation(
    operator=m.Multiply(),
    left=m.BinaryOperation(
        operator=m.Add(), left=m.BinaryOperation(operator=m.FloorDivide()), right=m.Integer("1")
    ),
)

WHY_ORDER = "align the chunk before the encoder cap: a chunk cut at an image is not rounded to 0 (a hang)"
WHY_STOP = "a chunk starting mid-block ends at its boundary, where align mode caches the Mamba state"


def _moved_split(node: cst.If) -> cst.If:
    return with_marker(node.with_changes(leading_lines=[]), "P34", WHY_ORDER)


def _spaced(node: cst.BaseStatement) -> cst.BaseStatement:
    lines = list(node.leading_lines)
    if not lines or lines[0].comment is not None:
        lines.insert(0, cst.EmptyLine(indent=False))
    return node.with_changes(leading_lines=lines)


class AlignBeforeEncoderRunning(Codemod):
    """Running requests: the block-aligned split moves above the encoder-input block."""

    target = TARGET
    anchor = (*SCHEDULE, m.While(test=RUNNING_TEST, body=m.IndentedBlock(body=[m.ZeroOrMore(), ENCODER_IF, SPLIT_IF, m.ZeroOrMore()])))
    patched = (*SCHEDULE, RUNNING_LOOP, _split_if(leading_lines=marked("P34")))

    def rewrite(self, node):
        body = list(node.body.body)
        (i,) = [k for k, s in enumerate(body) if m.matches(s, ENCODER_IF) and m.matches(body[k + 1], SPLIT_IF)]
        encoder, split = body[i], body[i + 1]
        body[i : i + 2] = [_moved_split(split), _spaced(encoder)]
        return node.with_changes(body=node.body.with_changes(body=body))


class AlignBeforeEncoderWaiting(Codemod):
    """Waiting requests: the split moves into the branch that sizes the chunk, above the encoder block."""

    target = TARGET
    anchor = (*SCHEDULE, m.While(test=WAITING_TEST, body=m.IndentedBlock(body=[m.ZeroOrMore(), LOAD_KV_ASYNC, SPLIT_IF, m.ZeroOrMore()])))
    patched = (*SCHEDULE, WAITING_LOOP, _split_if(leading_lines=marked("P34")))

    def rewrite(self, node):
        body = list(node.body.body)
        (i,) = [k for k, s in enumerate(body) if m.matches(s, LOAD_KV_ASYNC) and m.matches(body[k + 1], SPLIT_IF)]
        branch, split = body[i], body.pop(i + 1)
        inner = list(branch.orelse.body.body)
        inner[-1:] = [_moved_split(split), _spaced(inner[-1])]
        orelse = branch.orelse.with_changes(body=branch.orelse.body.with_changes(body=inner))
        body[i] = branch.with_changes(orelse=orelse)
        return node.with_changes(body=node.body.with_changes(body=body))


class StopAtBlockBoundary(Codemod):
    """The split ends a prefill chunk that starts mid-block at that block's boundary."""

    target = TARGET
    anchor = (*SPLIT, ROUNDING)
    patched = (*SPLIT, m.If(leading_lines=marked("P34")))

    def rewrite(self, node):
        (stop,) = statements(
            """
            if (
                num_computed_tokens % block_size != 0
                and num_computed_tokens % block_size + num_new_tokens >= block_size
            ):
                num_new_tokens = block_size - num_computed_tokens % block_size
            """
        )
        rounding = cst.If(test=node.test, body=node.body, orelse=node.orelse)  # now the first `elif`
        return with_marker(stop.with_changes(orelse=rounding, leading_lines=node.leading_lines), "P34", WHY_STOP)


class P34(Patch):
    id = "P34"
    family = "scheduler"
    title = "Mamba align mode: align a prefill chunk before the encoder cap; a mid-block chunk stops at the boundary"
    why = (
        "In Mamba align mode (hybrid models with prefix caching) 0.20.1 rounds a prefill chunk down "
        "to the block after the encoder cap has cut it at an image the encoder cache cannot take: "
        "with less than a block before the second of two large images the chunk is 0 on every "
        "step, a permanent hang holding KV blocks. Align first and keep the cut; a chunk that then "
        "starts mid-block ends at the boundary, so the cached Mamba state stays exact."
    )
    upstream_refs = ("vllm#40707", "vllm#40757")
    written_for = ">=0.20.1"
    edits = (AlignBeforeEncoderRunning, AlignBeforeEncoderWaiting, StopAtBlockBoundary)

    def upstream_fix(self, module_of):
        module = module_of(TARGET)
        if module is None:
            return None
        schedule = find(module, SCHEDULER)
        schedule = [f for c in schedule for f in find(c, func("schedule"))]
        split = [f for c in find(module, SCHEDULER) for f in find(c, func("_mamba_block_aligned_split"))]
        if len(schedule) != 1 or len(split) != 1:
            return None
        ordered = [b for b in m.findall(schedule[0], m.IndentedBlock(body=ALIGN_FIRST))]
        ordered = [b for b in ordered if not any(kiln_marked(s) for s in b.body if m.matches(s, SPLIT_IF))]
        stops = m.findall(split[0], NEXT_BOUNDARY)
        if len(ordered) < 2 or not stops:
            return None
        aligned = [next(s for s in b.body if m.matches(s, SPLIT_IF)) for b in ordered]
        where = ", ".join(place(TARGET, module, s).rsplit(":", 1)[-1] for s in aligned)
        return (
            f"{TARGET}:{where.split(', ')[0]}: Scheduler.schedule aligns a prefill chunk before the encoder "
            f"cap (lines {where}); _mamba_block_aligned_split stops a mid-block chunk at the next block "
            f"boundary ({place(TARGET, module, stops[0])})"
        )
