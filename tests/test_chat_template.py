"""kiln's Qwen3.6 chat template against the stock one, rendered as vLLM renders chat templates.

vLLM applies a chat template through transformers' ``apply_chat_template``: a jinja2
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the loop-controls
extension, and the ``raise_exception``, ``tojson`` and ``strftime_now`` helpers; the request's
``chat_template_kwargs`` (``enable_thinking``, ``preserve_thinking``) become template variables.
``_environment`` reproduces it.

The stock template (tests/support/chat_templates/, see its README for provenance) leaves a
``<think>`` open before a ``<tool_call>`` when an assistant turn comes back with its thinking
unclosed; these tests show that it does, that kiln's template never does, and that both render
the same bytes for conversations without an unclosed ``<think>``.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import jinja2
import pytest
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kiln import paths

STOCK = Path(__file__).parent / "support" / "chat_templates" / "qwen3.6-stock.jinja"
KILN = paths.REPO / "images" / "files" / "chat-templates" / "qwen3.6.jinja"

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


def _environment() -> jinja2.Environment:
    """The environment transformers compiles chat templates in (``_compile_jinja_template``)."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def render(template: Path, messages: list[dict], **kwargs) -> str:
    return _environment().from_string(template.read_text()).render(messages=messages, tools=TOOLS, **kwargs)


def _call(path: str, call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "read_file", "arguments": {"path": path}}}


def _tool(text: str, call_id: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def open_think_before_tool_call(prompt: str) -> list[int]:
    """Offsets of every ``<tool_call>`` rendered while a ``<think>`` is still open."""
    return [m.start() for m in re.finditer(r"<tool_call>", prompt)
            if prompt.count("<think>", 0, m.start()) > prompt.count("</think>", 0, m.start())]


def _history(prompt: str) -> str:
    """The prompt's turns after the system turn (whose tool instructions show a ``<tool_call>``),
    without the generation prompt, which opens ``<think>`` on purpose."""
    turns = prompt.split("<|im_end|>\n", 1)[1]
    return turns.rsplit("<|im_start|>assistant\n", 1)[0] if turns.endswith(("<think>\n", "</think>\n\n")) else turns


# Assistant turns as a client sends them back when the model called a tool before closing its
# thinking: vLLM's reasoning parser saw no </think>, so the thinking reached the client as content.
UNCLOSED = {
    "in content, call in tool_calls": {"role": "assistant", "content": "<think>\nThe config is in setup.cfg; read it.",
                                       "tool_calls": [_call("setup.cfg", "c1")]},
    "in content beside reasoning_content": {"role": "assistant", "reasoning_content": "Need the config.",
                                            "content": "<think>\nStill thinking: setup.cfg.",
                                            "tool_calls": [_call("setup.cfg", "c1")]},
    "call written inline in content": {"role": "assistant", "content": (
        "Let me look.\n<think>\nsetup.cfg first\n<tool_call>\n<function=read_file>\n<parameter=path>\nsetup.cfg\n"
        "</parameter>\n</function>\n</tool_call>")},
}


def _conversations(assistant: dict) -> dict[str, list[dict]]:
    """Multi-turn agent conversations holding ``assistant`` as the turn after the last user query,
    and before it (an earlier query, the turn then rendered without its reasoning)."""
    after_query = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "What does setup.cfg set?"},
        assistant,
        _tool("[metadata]\nname = demo", "c1"),
        {"role": "assistant", "reasoning_content": "It names the package.", "content": "",
         "tool_calls": [_call("pyproject.toml", "c2")]},
        _tool("[project]\nname = 'demo'", "c2"),
    ]
    before_query = [*after_query, {"role": "assistant", "content": "It sets the name: demo."},
                    {"role": "user", "content": "And the version?"}]
    return {"after the last query": after_query, "before the last query": before_query}


CASES = [(f"{turn} / {where}", conversation) for turn, assistant in UNCLOSED.items()
         for where, conversation in _conversations(assistant).items()]
PROMPT_KWARGS = [{"add_generation_prompt": True}, {"add_generation_prompt": True, "enable_thinking": False},
                 {"add_generation_prompt": True, "preserve_thinking": True}, {"add_generation_prompt": False}]


def test_stock_template_leaves_think_open_before_a_tool_call():
    """The baseline has the bug, wherever the unclosed turn is rendered with its text."""
    for name, messages in CASES:
        prompt = _history(render(STOCK, messages, add_generation_prompt=True, preserve_thinking=True))
        assert open_think_before_tool_call(prompt), name
    # without preserve_thinking the stock template still renders the unclosed turn verbatim
    name, messages = CASES[0]
    assert open_think_before_tool_call(_history(render(STOCK, messages, add_generation_prompt=True))), name


@pytest.mark.parametrize("kwargs", PROMPT_KWARGS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
@pytest.mark.parametrize("name,messages", CASES, ids=[n for n, _ in CASES])
def test_kiln_template_never_leaves_think_open(name, messages, kwargs):
    prompt = render(KILN, messages, **kwargs)
    history = _history(prompt)
    assert open_think_before_tool_call(history) == []
    assert history.count("<think>") == history.count("</think>")
    # every tool call is still there, whole, and the reasoning is kept where the turn shows it
    assert history.count("<tool_call>") == history.count("</tool_call>") == 2
    assert "<parameter=path>\nsetup.cfg\n</parameter>" in history
    assert ("setup.cfg" in history.split("<tool_call>")[0]) or "before the last query" in name
    assert prompt.count("<|im_start|>") == prompt.count("<|im_end|>") + (1 if kwargs["add_generation_prompt"] else 0)


def test_kiln_template_keeps_unclosed_reasoning_as_reasoning():
    """The unclosed text is the turn's reasoning, closed before its call; text before <think> stays content."""
    messages = _conversations(UNCLOSED["call written inline in content"])["after the last query"]
    prompt = render(KILN, messages, add_generation_prompt=True)
    turn = prompt.split("<|im_start|>assistant\n")[1]
    assert turn.startswith("<think>\nsetup.cfg first\n</think>\n\nLet me look.\n\n<tool_call>\n<function=read_file>")
    merged = render(KILN, _conversations(UNCLOSED["in content beside reasoning_content"])["after the last query"],
                    add_generation_prompt=True)
    assert "<think>\nNeed the config.\n\nStill thinking: setup.cfg.\n</think>\n\n<tool_call>" in merged


HEALTHY = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "<think>\ngreet\n</think>\n\nHello!"}, {"role": "user", "content": "read setup.cfg"}],
    _conversations({"role": "assistant", "reasoning_content": "Read it.", "content": "",
                    "tool_calls": [_call("setup.cfg", "c1")]})["after the last query"],
    _conversations({"role": "assistant", "content": "<think>\nRead it.\n</think>\n\nReading.",
                    "tool_calls": [_call("setup.cfg", "c1"), _call("setup.py", "c9")]})["before the last query"],
    [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, {"type": "image"}]},
     {"role": "assistant", "reasoning_content": "a cat", "content": "<think>\nclosed\n</think>\nA cat."},
     {"role": "user", "content": "sure?"}],
]


@pytest.mark.parametrize("kwargs", PROMPT_KWARGS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
@pytest.mark.parametrize("index", range(len(HEALTHY)))
def test_kiln_template_equals_stock_where_the_bug_is_not_triggered(index, kwargs):
    messages = HEALTHY[index]
    assert render(KILN, messages, **kwargs) == render(STOCK, messages, **kwargs)


def test_kiln_template_raises_like_stock():
    for template in (STOCK, KILN):
        with pytest.raises(jinja2.exceptions.TemplateError, match="No user query"):
            render(template, [{"role": "assistant", "content": "x"}])
