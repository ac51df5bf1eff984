"""P64: qwen3_coder streaming closes a tool call whose last parameter arrives with ``</function>``.

What fails on 0.20.1: ``Qwen3CoderToolParser.extract_tool_calls_streaming`` handles one phase
per delta and returns early after emitting the parameter fragments it found. With MTP (or a
stream interval > 1) one delta often carries the last parameter *and* ``</function>`` (and
``</tool_call>`` and EOS): the early return skips the ``</function>`` branch, so the call is
never closed (no ``}``) and ``prev_tool_call_arr[i]["arguments"]`` keeps its ``"{}"``
placeholder. When that delta is the last one, the serving layer's end-of-stream
reconciliation (``chat_completion/serving.py``: expected = ``prev_tool_call_arr`` arguments,
minus what was streamed) replaces the final fragment with what is "left" of ``"{}"``: the
client receives ``{}`` for a one-parameter call (or broken JSON for more), i.e. the final
tool call's arguments are empty (vllm#39598).

What the patch does (the approach of vllm#39598, written here as a source edit): the
fragments are joined before the ``</function>`` check and no longer returned early; when the
function ends in the same delta, the closing branch (which also parses the whole call into
``prev_tool_call_arr``) emits ``fragments + "}"`` in one delta; otherwise the fragments are
sent alone, as before.

Only the parser changes. The serving-layer edits Genesis carried with it are not needed for
this failure: once the parser returns the last fragments with ``}`` and updates
``prev_tool_call_arr`` in the same call, the reconciliation computes exactly that delta
(``expected - streamed-before-it``), so widening ``_should_check_for_unstreamed_tool_arg_tokens``
changes nothing here, and the ``_create_remaining_args_delta`` change (``id: null`` vs unset)
is cosmetic. Not covered (neither by vllm#39598): a final delta that also carries the header
or the opening ``{`` phase, which still return early.

On 0.33.0: UPSTREAM, in a new module. ``tool_parsers/qwen3coder_tool_parser.py`` no longer
exists and no ``Qwen3CoderToolParser`` class is left: ``qwen3_coder`` maps to
``Qwen3EngineToolParser`` in ``tool_parsers/qwen3_engine_tool_parser.py`` (the streaming
parser engine, vllm#45413), which has no per-phase early returns; ``upstream_fix`` recognises
that shape (a TARGET_GONE would send a reviewer looking for a class that was replaced on
purpose).

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1-0.23.0: APPLIES (the parser changed around it, not its streaming method).
- 0.24.0 on: UPSTREAM, in a new module. ``tool_parsers/__init__.py`` maps ``qwen3_coder`` to
  ``Qwen3EngineToolParser`` (``:157`` on 0.24.0), an adapter over the streaming parser engine
  (vllm#45413), and ``qwen3coder_tool_parser.py`` is gone. ``ParserEngine.
  extract_tool_calls_streaming`` lexes the whole delta and turns all of its events into one
  ``DeltaMessage`` (``parser/engine/parser_engine.py:568`` on 0.24.0), so there is no
  per-phase early return left to drop the close of the call. Read, not run. Before this
  review these releases read TARGET_GONE (the recogniser did not look at the new module).
"""

import libcst as cst
import libcst.matchers as m

from kiln.patch.anchor import find
from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import (
    cls,
    func,
    insert_after,
    marked,
    place,
    place_of,
    statements,
    with_marker,
)

TARGET = "tool_parsers/qwen3coder_tool_parser.py"
STREAMING = (cls("Qwen3CoderToolParser"), func("extract_tool_calls_streaming"))

# `if json_fragments:` (emit the parameters found in this delta)
FRAGMENTS_IF = m.If(test=m.Name("json_fragments"))
# `if not self.json_closed and self.function_end_token in tool_text:` (close the call)
FUNCTION_END_IF = m.If(
    test=m.BooleanOperation(
        left=m.UnaryOperation(operator=m.Not(), expression=m.Attribute(attr=m.Name("json_closed"))),
        operator=m.And(),
        right=m.Comparison(
            left=m.Attribute(attr=m.Name("function_end_token")),
            comparisons=[m.ComparisonTarget(operator=m.In())],
        ),
    )
)
JOIN_FRAGMENTS = m.SimpleStatementLine(
    body=[m.Assign(targets=[m.AssignTarget(target=m.Name("combined"))], value=m.Call())]
)


class HoldFragmentsForTheClose(Codemod):
    """Join the fragments before the ``if`` and drop its early ``return``."""

    target = TARGET
    anchor = (*STREAMING, FRAGMENTS_IF)
    patched = (
        *STREAMING,
        m.SimpleStatementLine(
            leading_lines=marked("P64"),
            body=[m.Assign(targets=[m.AssignTarget(target=m.Name("combined"))])],
        ),
    )

    def rewrite(self, node):
        body = list(node.body.body)
        if not (
            len(body) > 2
            and m.matches(body[0], JOIN_FRAGMENTS)
            and m.matches(body[-1], m.SimpleStatementLine(body=[m.Return()]))
        ):
            raise ValueError("`if json_fragments:` no longer joins then returns")
        kept = body[1:-1]
        kept[0] = kept[0].with_changes(leading_lines=[])
        join = body[0].with_changes(leading_lines=node.leading_lines)
        why = "the last parameter can arrive with </function> (MTP)"
        return cst.FlattenSentinel(
            [
                with_marker(join, "P64", why),
                node.with_changes(leading_lines=[], body=node.body.with_changes(body=kept)),
            ]
        )


class _ArgumentsCloseBrace(cst.CSTTransformer):
    """``arguments="}"`` -> ``arguments=combined + "}"``."""

    def __init__(self):
        self.hits = 0

    def leave_Arg(self, original_node, updated_node):
        if m.matches(updated_node, m.Arg(keyword=m.Name("arguments"), value=m.SimpleString('"}"'))):
            self.hits += 1
            return updated_node.with_changes(value=cst.parse_expression('combined + "}"'))
        return updated_node


class CloseInTheSameDelta(Codemod):
    """The ``</function>`` branch emits the held fragments with ``}``; else send them alone."""

    target = TARGET
    anchor = (*STREAMING, FUNCTION_END_IF)
    patched = (*STREAMING, m.If(leading_lines=marked("P64"), test=m.Name("json_fragments")))

    def rewrite(self, node):
        close_brace = _ArgumentsCloseBrace()
        closing = node.visit(close_brace)
        if close_brace.hits != 1:
            raise ValueError(
                f'expected one arguments="}}" in the </function> branch, found {close_brace.hits}'
            )
        (alone,) = statements(
            """
            if json_fragments:
                return DeltaMessage(
                    tool_calls=[
                        DeltaToolCall(
                            index=self.current_tool_index,
                            function=DeltaFunctionCall(arguments=combined),
                        )
                    ]
                )
            """
        )
        return insert_after(
            with_marker(closing, "P64", "send the held parameters together with the closing brace"),
            with_marker(alone, "P64", "no </function> in this delta: send the parameters alone"),
        )


# -- upstream detection -------------------------------------------------------------------------
# 0.24.0 maps ``qwen3_coder`` to a parser built on the streaming parser engine (vllm#45413): a
# delta is lexed whole into events and all of them become one DeltaMessage, so the last
# parameter and the close of the call leave together (no phase returns early).

REGISTRY = "tool_parsers/__init__.py"
ENGINE = "parser/engine/parser_engine.py"


def _registry_entry(registry: cst.Module) -> tuple[cst.CSTNode, str, str] | None:
    """The ``"qwen3_coder": (module, class)`` entry of the lazy tool-parser registry."""
    entry = m.DictElement(
        key=m.SimpleString('"qwen3_coder"'),
        value=m.Tuple(elements=[m.Element(value=m.SimpleString()), m.Element(value=m.SimpleString()), m.ZeroOrMore()]),
    )
    found = m.findall(registry, entry)
    if len(found) != 1:
        return None
    module_name, class_name = (e.value.evaluated_value for e in found[0].value.elements[:2])
    return found[0], module_name, class_name


ENGINE_STREAMING = (
    cls("ParserEngine"),
    func("extract_tool_calls_streaming"),
    m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("_events_to_delta"))),
)


def engine_parser_for_qwen3_coder(module_of) -> str | None:
    registry = module_of(REGISTRY)
    hit = _registry_entry(registry) if registry is not None else None
    if hit is None or hit[1] == "qwen3coder_tool_parser":
        return None
    node, module_name, class_name = hit
    parser_file = f"tool_parsers/{module_name}.py"
    parser = module_of(parser_file)
    adapter = m.ClassDef(
        name=m.Name(class_name),
        bases=[m.AtLeastN(m.Arg(value=m.Name(m.MatchIfTrue(lambda n: n.endswith("ToolAdapter")))), n=1)],
    )
    if parser is None or not find(parser, adapter):
        return None
    engine_at = place_of(ENGINE, module_of(ENGINE), ENGINE_STREAMING)
    if engine_at is None:
        return None
    return (
        f"{place(REGISTRY, registry, node)}: qwen3_coder is {class_name} ({parser_file}), a "
        f"parser-engine adapter; {engine_at}: ParserEngine.extract_tool_calls_streaming turns all "
        "events of a delta into one DeltaMessage, so the last parameter and </function> leave "
        "together (vllm#45413)"
    )


class P64(Patch):
    id = "P64"
    family = "tool_parsing"
    title = "qwen3_coder streaming: last parameter and </function> in one delta (MTP)"
    why = (
        "With MTP one streamed delta carries the last tool parameter and </function>; the "
        "parser returned after the parameters, never closed the call, and the serving layer's "
        "final reconciliation left the tool call's arguments empty."
    )
    upstream_refs = ("vllm#39598", "vllm#45335", "vllm#45413")
    written_for = ">=0.20.1"
    edits = (HoldFragmentsForTheClose, CloseInTheSameDelta)

    def upstream_fix(self, module_of) -> str | None:
        found = engine_parser_for_qwen3_coder(module_of)
        return f"fixed upstream in a new module: {found}" if found else None
