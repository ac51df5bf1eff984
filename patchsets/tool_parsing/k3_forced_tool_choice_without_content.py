"""K3: a forced tool call whose output is all reasoning returns no call, not an AssertionError.

Genesis has no such fix, so the id is from kiln's own sequence (``K<n>``, a prefix Genesis
never uses); it was P111 until the ids were aligned, and records written then still read
(``kiln.patch.catalog.RENAMED``).

What fails on 0.20.1: with a reasoning parser, a request that names the function to call
(``tool_choice={"type": "function", "function": {"name": ...}}``, or the Responses API's
``{"type": "function", "name": ...}``) takes the model's content as the call's arguments, and
first asserts that there is content (``entrypoints/openai/engine/serving.py:628, 641``;
``parser/abstract_parser.py:439, 449`` for the Responses API). The qwen3 reasoning parser
returns ``content=None`` when the output ends before anything follows the reasoning: thinking
cut by ``max_tokens`` before ``</think>`` (``reasoning/qwen3_reasoning_parser.py``:
"everything generated so far is reasoning"). The assertion then fails inside
``chat_completion_full_generator`` and the client gets an HTTP 500 instead of the response it
paid the tokens for (finish_reason ``length``, the reasoning); the chat path has a second
assertion, ``assert tool_calls is not None and len(tool_calls) > 0``
(``chat_completion/serving.py:1440``), for the same case. Reported on Qwen3.5 (vllm#40528).

What the patch does (as vLLM 0.21.0 does): in the two forced branches of
``OpenAIServing._parse_tool_calls_from_content`` and of ``DelegatingParser._parse_tool_calls``
a missing content means no call (``return [], None``), and the chat path's named-function
branch builds its message from ``tool_calls or []``. A forced call with content is unchanged.

Upstream: vllm#40148 (merged; issues #40147, #40528), first released in 0.21.0:
``if content is None: return [], None`` in both forced branches, ``tool_calls = tool_calls or []``
in the chat path.

Verdicts: 0.20.1 APPLIES. 0.33.0 UPSTREAM: ``entrypoints/openai/engine/serving.py`` is gone,
and ``upstream_fix`` finds the guard in ``DelegatingParser._extract_tool_calls``
(``parser/abstract_parser.py:424``, ``if content is None or ...: return [], None``) with no
``assert content is not None`` left in either parser file and no ``assert tool_calls`` in the
chat path, and names the line.

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1, 0.20.2: APPLIES (``assert content is not None``, ``parser/abstract_parser.py:439, 449``
  on 0.20.2).
- 0.21.0 on: UPSTREAM: vllm#40148 (first released in 0.21.0) returns no call for a forced
  tool choice without content: ``if content is None: return [], None`` in both forced branches
  (``parser/abstract_parser.py:462``, ``entrypoints/openai/engine/serving.py:680, 693`` on
  0.21.0; ``parser/abstract_parser.py:424`` on 0.33.0), and no release after it asserts content
  or tool calls there.
"""

import libcst as cst
import libcst.matchers as m

from kiln.patch.anchor import count, find
from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import cls, func, kiln_marked, marked, place, statements, with_marker

SERVING = "entrypoints/openai/engine/serving.py"
CHAT = "entrypoints/openai/chat_completion/serving.py"
PARSER = "parser/abstract_parser.py"

# `assert content is not None`
ASSERT_CONTENT = m.SimpleStatementLine(
    body=[
        m.Assert(
            test=m.Comparison(
                left=m.Name("content"),
                comparisons=[m.ComparisonTarget(operator=m.IsNot(), comparator=m.Name("None"))],
            )
        )
    ]
)
# `assert tool_calls is not None and len(tool_calls) > 0`
ASSERT_TOOL_CALLS = m.SimpleStatementLine(
    body=[m.Assert(test=m.BooleanOperation(left=m.Comparison(left=m.Name("tool_calls"))))]
)
CONTENT_IS_NONE = m.Comparison(
    left=m.Name("content"),
    comparisons=[m.ComparisonTarget(operator=m.Is(), comparator=m.Name("None"))],
)
# `if content is None [or ...]: return [], None`, in any spelling of the test
NO_CONTENT_NO_CALL = m.If(
    test=m.OneOf(CONTENT_IS_NONE, m.BooleanOperation(left=CONTENT_IS_NONE)),
    body=m.IndentedBlock(
        body=[
            m.SimpleStatementLine(
                body=[
                    m.Return(
                        value=m.Tuple(
                            elements=[m.Element(m.List(elements=[])), m.Element(m.Name("None"))]
                        )
                    )
                ]
            )
        ]
    ),
)
WHY = "content is None when the output is all reasoning (e.g. cut by max_tokens): no call"


class _ReplaceContentAsserts(cst.CSTTransformer):
    def __init__(self):
        self.hits = 0

    def leave_SimpleStatementLine(self, original_node, updated_node):
        if not m.matches(updated_node, ASSERT_CONTENT):
            return updated_node
        self.hits += 1
        (guard,) = statements("if content is None:\n    return [], None")
        guard = guard.with_changes(leading_lines=updated_node.leading_lines)
        return with_marker(guard, "K3", WHY)


class _NoCallWithoutContent(Codemod):
    """Both forced branches of the method: ``assert content is not None`` -> no call."""

    def rewrite(self, node):
        replace = _ReplaceContentAsserts()
        new = node.visit(replace)
        if replace.hits != 2:
            raise ValueError(f"expected 2 `assert content is not None`, found {replace.hits}")
        return new


class ServingNoCallWithoutContent(_NoCallWithoutContent):
    target = SERVING
    anchor = (cls("OpenAIServing"), func("_parse_tool_calls_from_content"))
    patched = (*anchor, m.If(leading_lines=marked("K3")))


class ResponsesNoCallWithoutContent(_NoCallWithoutContent):
    target = PARSER
    anchor = (cls("DelegatingParser"), func("_parse_tool_calls"))
    patched = (*anchor, m.If(leading_lines=marked("K3")))


class ChatNamedBranchWithoutCall(Codemod):
    """The chat path's named-function branch: no call is an empty tool_calls list."""

    target = CHAT
    anchor = (cls("OpenAIServingChat"), func("chat_completion_full_generator"), ASSERT_TOOL_CALLS)
    patched = (
        cls("OpenAIServingChat"),
        func("chat_completion_full_generator"),
        m.SimpleStatementLine(leading_lines=marked("K3")),
    )

    def rewrite(self, node):
        (empty,) = statements("tool_calls = tool_calls or []")
        return with_marker(empty.with_changes(leading_lines=node.leading_lines), "K3", WHY)


class K3(Patch):
    id = "K3"
    family = "tool_parsing"
    title = "Forced tool choice with all-reasoning output: no call instead of an AssertionError (500)"
    why = (
        "A named tool_choice asserted that the model produced content; with a reasoning parser "
        "an output cut by max_tokens inside <think> has none, and the request failed with an "
        "HTTP 500 instead of returning its reasoning and finish_reason length."
    )
    upstream_refs = ("vllm#40148", "vllm#40147", "vllm#40528")
    written_for = ">=0.20.1"
    edits = (ServingNoCallWithoutContent, ResponsesNoCallWithoutContent, ChatNamedBranchWithoutCall)

    def upstream_fix(self, module_of) -> str | None:
        parser = module_of(PARSER)
        if parser is None:
            return None
        guards = [g for g in find(parser, NO_CONTENT_NO_CALL) if not kiln_marked(g, "K3")]
        if not guards:
            return None
        for rel, shape in ((PARSER, ASSERT_CONTENT), (SERVING, ASSERT_CONTENT), (CHAT, ASSERT_TOOL_CALLS)):
            module = module_of(rel)
            if module is not None and count(module, (shape,)):
                return None
        return (
            f"{place(PARSER, parser, guards[0])}: a forced tool choice without content returns no call (vllm#40148); "
            f"no content/tool_calls assertion left in {PARSER}, {SERVING}, {CHAT}"
        )
