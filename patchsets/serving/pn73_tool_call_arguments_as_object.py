"""PN73: an assistant tool call whose ``arguments`` are not a JSON object no longer fails the request.

What fails on 0.20.1: a chat request carries the conversation so far, including the assistant's
earlier tool calls, whose ``function.arguments`` is the JSON string the server itself produced
(or the client built). ``_postprocess_messages`` (``entrypoints/chat_utils.py:1583``) turns it
into the mapping chat templates iterate over with an unguarded ``json.loads``
(``entrypoints/chat_utils.py:1604``). One malformed string there (a tool call cut off by
``max_tokens``, a model that wrote a bare ``{"a": 1``, a client that sent ``"{}}"``) raises
``JSONDecodeError``; the server's exception handler answers it as a 400 with the decoder's message
(``entrypoints/openai/server_utils.py:375`` -> ``entrypoints/utils.py:302``: a ``ValueError``).
The string stays in the history, so every later turn of that conversation fails the same way.
Valid JSON that is not an object (``"[1]"``, ``"42"``) passes through to the template, which
expects a mapping (Qwen3.6's template iterates ``arguments|items``).

What the patch does (written anew after Genesis PN73 and vLLM's own fix, whose behaviour it
follows so that a pin bump changes nothing): the branch that decodes ``arguments`` becomes one
call of ``_tool_call_arguments_as_object``: a mapping is kept; a string is decoded; a string that
is not valid JSON becomes ``{}`` with a warning; anything that is not a mapping after decoding
(a list, a number, ``null``) becomes ``{}``, with a warning unless it was ``null``; missing or
empty arguments stay ``{}`` as before. Genesis keeps the malformed string; upstream (0.29.0 on)
coerces to ``{}``, and so does kiln.

Upstream: vLLM 0.29.0 catches ``json.JSONDecodeError`` in ``_postprocess_messages`` and coerces
to an empty object; ``upstream_fix`` finds that ``try`` in whichever of the function's three homes
the release has (``entrypoints/chat_utils.py`` to 0.31.0, ``renderers/chat_utils.py`` in 0.32.0,
``renderers/chat_utils/chat_message.py`` from 0.33.0).

Verdicts: 0.20.1 APPLIES. 0.33.0 UPSTREAM (``renderers/chat_utils/chat_message.py:739``).

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1-0.21.0: APPLIES; ``item["function"]["arguments"] = json.loads(content)``.
- 0.22.0-0.22.1: APPLIES; the entries are validated first, then ``function["arguments"] =
  json.loads(content)``, still unguarded.
- 0.23.0-0.28.0: APPLIES; ``null`` becomes ``{}``, the decode itself is still unguarded.
- 0.29.0 on: UPSTREAM, vLLM's own guard.
"""

import libcst as cst
import libcst.matchers as m

from kiln.patch.anchor import find
from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import func, kiln_marked, marked, place, statements, top_level, with_marker

TARGET = "entrypoints/chat_utils.py"
# where _postprocess_messages lives, release by release (upstream moved it twice)
HOMES = (TARGET, "renderers/chat_utils.py", "renderers/chat_utils/chat_message.py")
POSTPROCESS = func("_postprocess_messages")
HELPER = "_tool_call_arguments_as_object"

# ``if content := <function>.get("arguments"):`` ... ``else: <function>["arguments"] = {}``
DECODE_BRANCH = m.If(
    test=m.NamedExpr(
        target=m.Name("content"),
        value=m.Call(func=m.Attribute(attr=m.Name("get")), args=[m.Arg(value=m.SimpleString('"arguments"'))]),
    )
)

HELPER_SOURCE = f'''
def {HELPER}(arguments, name) -> dict:
    """An assistant tool call's ``arguments`` as the mapping chat templates iterate over.

    A mapping is kept and a JSON string decoded. A string that is not valid JSON, or that
    decodes to something other than an object, becomes an empty object: it lives in the
    conversation history, so refusing it would fail every later turn of the conversation too.
    """
    if not arguments:
        return {{}}
    if isinstance(arguments, dict):
        return arguments
    decoded = arguments
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError:
            logger.warning(
                "Tool call %r has arguments that are not valid JSON (%d chars); "
                "using an empty object so the conversation can continue.",
                name,
                len(arguments),
            )
            return {{}}
    if not isinstance(decoded, dict):
        if decoded is not None:
            logger.warning(
                "Tool call %r has arguments that decode to %s, not a JSON object; "
                "using an empty object.",
                name,
                type(decoded).__name__,
            )
        return {{}}
    return decoded
'''


class AddArgumentsHelper(Codemod):
    """The decoding, a module-level function after ``_postprocess_messages``."""

    target = TARGET
    anchor = (POSTPROCESS,)
    patched = (func(HELPER, leading_lines=marked("PN73")),)

    def rewrite(self, node):
        (helper,) = statements(HELPER_SOURCE)
        why = "malformed tool-call arguments in the history must not fail the request"
        return cst.FlattenSentinel([node, top_level(helper, "PN73", why)])


class DecodeThroughHelper(Codemod):
    """The branch that decoded ``arguments`` unguarded becomes one call of the helper."""

    target = TARGET
    anchor = (POSTPROCESS, DECODE_BRANCH)
    patched = (POSTPROCESS, m.SimpleStatementLine(leading_lines=marked("PN73")))

    def rewrite(self, node):
        # the mapping holding "arguments": `item["function"]` (to 0.21.0) or `function` (0.22.0 on)
        holder = cst.Module(body=[]).code_for_node(node.test.value.func.value)
        (assign,) = statements(
            f'{holder}["arguments"] = {HELPER}(\n'
            f'    {holder}.get("arguments"), {holder}.get("name")\n'
            ")"
        )
        why = "arguments that are not a JSON object become {} (logged), as vLLM does from 0.29.0"
        assign = with_marker(assign, "PN73", why)
        return assign.with_changes(leading_lines=[*node.leading_lines, *assign.leading_lines])


def _guarded_decode(postprocess: cst.FunctionDef) -> cst.Try | None:
    """vLLM's own ``try: ... json.loads(...) except json.JSONDecodeError`` in the function."""
    catches_decode = m.ExceptHandler(
        type=m.Attribute(value=m.Name("json"), attr=m.Name("JSONDecodeError"))
    )
    loads = m.Call(func=m.Attribute(value=m.Name("json"), attr=m.Name("loads")))
    for node in find(postprocess, m.Try(handlers=[m.ZeroOrMore(), catches_decode, m.ZeroOrMore()])):
        if not kiln_marked(node) and find(node.body, loads):
            return node
    return None


class PN73(Patch):
    id = "PN73"
    family = "serving"
    title = "Assistant tool-call arguments that are not a JSON object become {} instead of failing the request"
    why = (
        "A chat request whose history holds a tool call with malformed JSON arguments fails "
        "(json.loads unguarded), and so does every later turn of that conversation. The "
        "arguments become an empty object with a warning, as vLLM does from 0.29.0."
    )
    upstream_refs = ()
    written_for = ">=0.20.1"
    edits = (DecodeThroughHelper, AddArgumentsHelper)

    def upstream_fix(self, module_of) -> str | None:
        for rel in HOMES:
            module = module_of(rel)
            if module is None:
                continue
            for postprocess in find(module, POSTPROCESS):
                guard = _guarded_decode(postprocess)
                if guard is not None:
                    return (
                        f"{place(rel, module, guard)}: _postprocess_messages catches json.JSONDecodeError "
                        "on tool-call arguments and uses an empty object"
                    )
        return None
