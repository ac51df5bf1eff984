"""K2: a streamed delta that ends reasoning keeps its reasoning text (tools + reasoning parser).

Genesis has no such fix, so the id is from kiln's own sequence (``K<n>``, a prefix Genesis
never uses); it was P110 until the ids were aligned, and records written then still read
(``kiln.patch.catalog.RENAMED``).

What fails on 0.20.1: with ``--reasoning-parser`` and ``--enable-auto-tool-choice`` the chat
stream goes through ``DelegatingParser.parse_delta`` (``parser/abstract_parser.py``,
``chat_completion/serving.py:1005``). When one delta carries the last reasoning tokens and
``</think>``, the reasoning parser returns ``DeltaMessage(reasoning=..., content=...)``; the
hand-off moves the content to the tool parser, and the tool parser's return value then
*replaces* ``delta_message`` (``abstract_parser.py:631``): the reasoning of that delta is
dropped from the stream. With MTP a delta is up to ``1 + num_speculative_tokens`` tokens,
so the tail of the reasoning (``"...so the answer is 4."`` before ``</think>``) goes missing
in ``reasoning_content`` of tool-enabled requests whenever ``</think>`` arrives with the
tokens before it; clients that show the thinking, or send it back in the next turn, get it
truncated (vllm#42781). Non-streaming output is not affected.

What the patch does (the reasoning-keeping half of vllm#42691, written for 0.20.1): the
tool-call phase keeps the reasoning already extracted from this delta and puts it back on
whatever the tool parser returns (a new ``DeltaMessage`` when it returns ``None``).
Single-token deltas, and deltas that do not cross the boundary, stream as before. Left out:
#42691's other half, the hand-off check on ``is_reasoning_end_streaming`` instead of
``is_reasoning_end(delta_token_ids)``; it matters only for a delta holding a whole
``<tool_call>...</tool_call>`` (more tokens than a K=3 MTP step), which 0.20.1's qwen3_coder
parser cannot stream in one delta anyway.

Upstream: vllm#42691 (merged), first released in 0.22.0 (``reasoning = delta_message.reasoning
if delta_message else None`` before the tool parser, put back after it; 0.20.2 and 0.21.0 do
not have it); 0.33.0 keeps it as ``reasoning_from_this_batch``.

Verdicts: 0.20.1 APPLIES. 0.33.0 UPSTREAM: ``upstream_fix`` finds vLLM's own save of the
boundary reasoning in ``DelegatingParser.parse_delta``'s tool-call phase
(``parser/abstract_parser.py:947``) and names the line.

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1, 0.20.2: APPLIES.
- 0.21.0: DRIFTED, the failure unchanged. The tool-call phase of ``parse_delta`` now reads
  ``delta_message, state.function_name_returned = (self._extract_tool_calls_streaming(...))``
  (``parser/abstract_parser.py:701``; the tool-call id bookkeeping came with it), which the
  anchor (``delta_message = self.extract_tool_calls_streaming(...)``) does not match, and still
  nothing saves the delta's reasoning before the tool parser's answer replaces
  ``delta_message``. Not re-anchored: no pin is on 0.21.0 and the next release fixes it.
- 0.22.0 on: UPSTREAM: vllm#42691 keeps the boundary reasoning (``reasoning =
  delta_message.reasoning if delta_message else None`` before the tool parser, put back after:
  ``parser/abstract_parser.py:711`` on 0.22.0; ``reasoning_from_this_batch``, ``:947`` on 0.33.0).
"""

import libcst as cst
import libcst.matchers as m

from kiln.patch.anchor import find
from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import cls, func, kiln_marked, marked, place, statements, with_marker

TARGET = "parser/abstract_parser.py"
PARSE_DELTA = (cls("DelegatingParser"), func("parse_delta"))


def _self_call(name, **kwargs) -> m.Call:
    return m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(name)), **kwargs)


TOOL_PHASE = m.If(test=_self_call("_in_tool_call_phase"))
# `delta_message = self.extract_tool_calls_streaming(...)`: the tool parser's answer
TOOL_CALL_EXTRACTION = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(target=m.Name("delta_message"))],
            value=_self_call("extract_tool_calls_streaming"),
        )
    ]
)
# `<name> = delta_message.reasoning if delta_message else None`, in any spelling
SAVES_REASONING = m.SimpleStatementLine(
    body=[
        m.Assign(
            value=m.IfExp(
                test=m.Name("delta_message"),
                body=m.Attribute(value=m.Name("delta_message"), attr=m.Name("reasoning")),
            )
        )
    ]
)


class KeepBoundaryReasoning(Codemod):
    """Save the delta's reasoning before the tool parser answers; put it back after."""

    target = TARGET
    anchor = (*PARSE_DELTA, TOOL_PHASE, TOOL_CALL_EXTRACTION)
    patched = (*PARSE_DELTA, TOOL_PHASE, m.SimpleStatementLine(leading_lines=marked("K2")))

    def rewrite(self, node):
        (save,) = statements("boundary_reasoning = delta_message.reasoning if delta_message else None")
        (restore,) = statements(
            """
            if boundary_reasoning:
                if delta_message is None:
                    delta_message = DeltaMessage()
                delta_message.reasoning = boundary_reasoning
            """
        )
        return cst.FlattenSentinel(
            [
                with_marker(save, "K2", "a delta that ends reasoning also carries reasoning text"),
                node,
                with_marker(restore, "K2", "the tool parser's answer replaced delta_message: keep that text"),
            ]
        )


class K2(Patch):
    id = "K2"
    family = "reasoning"
    title = "Streaming with tools + reasoning parser: the delta that ends reasoning keeps its reasoning"
    why = (
        "DelegatingParser.parse_delta replaced the boundary delta's message with the tool "
        "parser's answer, dropping the reasoning extracted from it: with MTP (multi-token "
        "deltas) the tail of reasoning_content goes missing on tool-enabled streams."
    )
    upstream_refs = ("vllm#42691", "vllm#43055", "vllm#42781")
    written_for = ">=0.20.1"
    edits = (KeepBoundaryReasoning,)

    def upstream_fix(self, module_of) -> str | None:
        module = module_of(TARGET)
        if module is None:
            return None
        saves = [
            save
            for parser in find(module, PARSE_DELTA[0])
            for parse_delta in find(parser, PARSE_DELTA[1])
            for phase in find(parse_delta, TOOL_PHASE)
            for save in find(phase, SAVES_REASONING)
            if not kiln_marked(save, "K2")  # kiln's own save is this patch, not vLLM's
        ]
        if not saves:
            return None
        return (
            f"{place(TARGET, module, saves[0])}: DelegatingParser.parse_delta keeps the boundary delta's reasoning "
            "around the tool parser's answer (vllm#42691)"
        )
