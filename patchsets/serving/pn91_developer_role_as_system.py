"""PN91: a ``developer`` message is rendered as the system message when the template has no such role.

What fails on 0.20.1: OpenAI's API lets a client send ``{"role": "developer", ...}`` (the
instructions role of newer OpenAI models; the ``openai`` SDK and agent frameworks send it).
vLLM 0.20.1 passes the role through unchanged (``entrypoints/chat_utils.py:1578`` even keeps a
developer message's ``tools``) and ``safe_apply_chat_template`` (``renderers/hf.py:460``) hands
the conversation to the chat template as it is. Qwen3.6's template, stock and kiln's baked
``images/files/chat-templates/qwen3.6.jinja`` alike, knows only system, user, assistant and
tool, and ends in ``raise_exception('Unexpected message role.')``: the request fails (the
template error comes back as a 400) before any token is generated. It accepts a system message
only first (``'System message must be at the beginning.'``), so renaming the role alone is not
enough when a client sends both, or a developer message after the first turn.

What the patch does (written anew after Genesis PN91, which renames the role at parse time, and
vLLM's own later fix): in ``safe_apply_chat_template``, after the template is resolved and only
when the conversation holds a developer message and the template does not name the role as a
string literal ('developer' or "developer"), the system and developer messages become one
system message at the front, their text joined in order by a blank line; the other messages
keep their order. A template that handles the role itself renders the conversation untouched,
and so does every conversation without a developer message.

Upstream: vLLM 0.23.0 converts developer messages the same way, at the same place
(``_convert_developer_to_system`` and ``_consolidate_system_messages`` in ``renderers/hf.py``,
called from ``safe_apply_chat_template``); ``upstream_fix`` finds them.

Verdicts: 0.20.1 APPLIES. 0.33.0 UPSTREAM (``renderers/hf.py:604``, called at ``:893``).

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1-0.22.1: APPLIES; ``safe_apply_chat_template`` and ``resolve_chat_template_kwargs``
  unchanged in shape, and none of them converts the role.
- 0.23.0 on: UPSTREAM, vLLM's own conversion in ``renderers/hf.py``.
"""

import libcst as cst
import libcst.matchers as m

from kiln.patch.anchor import find
from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import assign_to, func, marked, place, statements, top_level, with_marker

TARGET = "renderers/hf.py"
HELPER = "_developer_messages_as_system"
APPLY = func("safe_apply_chat_template")

HELPER_SOURCE = f'''
def {HELPER}(
    conversation: list[ConversationMessage], chat_template: str
) -> list[ConversationMessage]:
    """The conversation a template without a developer role can render.

    Unchanged when no message is a developer message, or when the template names the
    role itself. Otherwise the system and developer messages become one system message at
    the front (templates such as Qwen3.6's accept a system message only first), their text
    joined in order; the other messages keep their order.
    """
    if not any(message["role"] == "developer" for message in conversation):
        return conversation
    if "'developer'" in chat_template or '"developer"' in chat_template:
        return conversation
    instructions: list[str] = []
    rest: list[ConversationMessage] = []
    for message in conversation:
        if message["role"] not in ("system", "developer"):
            rest.append(message)
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = "\\n".join(
                part if isinstance(part, str) else part["text"]
                for part in content
                if isinstance(part, str) or (isinstance(part, dict) and "text" in part)
            )
        if content:
            instructions.append(content)
    system: ConversationMessage = {{"role": "system", "content": "\\n\\n".join(instructions)}}
    return [system, *rest]
'''

HELPER_WHY = "OpenAI's developer role, for chat templates that do not know it"


class AddDeveloperAsSystemHelper(Codemod):
    """The conversion, a module-level function next to the template-kwargs resolution."""

    target = TARGET
    anchor = (func("resolve_chat_template_kwargs"),)
    patched = (func(HELPER, leading_lines=marked("PN91")),)

    def rewrite(self, node):
        (helper,) = statements(HELPER_SOURCE)
        return cst.FlattenSentinel([node, top_level(helper, "PN91", HELPER_WHY)])


class ConvertBeforeRendering(Codemod):
    """``safe_apply_chat_template`` converts once the template is known, before rendering."""

    target = TARGET
    anchor = (APPLY, assign_to("resolved_kwargs"))
    patched = (APPLY, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name("conversation"))])],
                                            leading_lines=marked("PN91")))

    def rewrite(self, node):
        (convert,) = statements(f"conversation = {HELPER}(conversation, chat_template)")
        why = "a developer message fails a template without that role: render it as the system message"
        convert = with_marker(convert, "PN91", why)
        # the blank line above the anchored statement now goes above the conversion
        convert = convert.with_changes(leading_lines=[*node.leading_lines, *convert.leading_lines])
        return cst.FlattenSentinel([convert, node.with_changes(leading_lines=[])])


class PN91(Patch):
    id = "PN91"
    family = "serving"
    title = "A developer-role message is rendered as the system message when the chat template lacks that role"
    why = (
        "OpenAI clients send role 'developer' for instructions; Qwen3.6's chat template raises "
        "'Unexpected message role.' on it, so the request fails. The system and developer "
        "messages are merged into one leading system message before rendering."
    )
    upstream_refs = ()
    written_for = ">=0.20.1"
    edits = (AddDeveloperAsSystemHelper, ConvertBeforeRendering)

    def upstream_fix(self, module_of) -> str | None:
        module = module_of(TARGET)
        if module is None:
            return None
        converters = find(module, func("_convert_developer_to_system"))
        calls = [
            call
            for apply in find(module, APPLY)
            for call in find(apply, m.Call(func=m.Name("_convert_developer_to_system")))
        ]
        if not (converters and calls):
            return None
        return (
            f"{place(TARGET, module, converters[0])}: _convert_developer_to_system, called from "
            f"safe_apply_chat_template at {place(TARGET, module, calls[0])}"
        )
