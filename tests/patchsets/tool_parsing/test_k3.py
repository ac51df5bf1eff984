"""K3 on real 0.20.1 source: a forced tool call with all-reasoning output returns no call.

Behaviour test running real vLLM 0.20.1 code, pristine and patched, extracted from the trees
(the serving modules import FastAPI, pydantic, openai and the engine): the qwen3 reasoning
parser's ``extract_reasoning`` (loaded by ``tests/patchsets/support/qwen3_parsers.py``) turns a
``max_tokens``-truncated thinking output into ``(reasoning, None)``; that content goes through
``OpenAIServing._parse_tool_calls_from_content`` (chat) or ``DelegatingParser._parse_tool_calls``
(Responses API), and the chat path's result through the real named-function branch of
``chat_completion_full_generator``; the tool parser class is vLLM's own ``Qwen3CoderToolParser``. Stood in: the request and tool-choice protocol classes,
``FunctionCall``, ``ChatMessage`` and ``ToolCall`` (dataclasses with the fields used), and the
helpers the code calls (``make_tool_call_id``, ``is_mistral_tokenizer``).
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any

import libcst as cst
import libcst.matchers as m
import pytest

from kiln.patch.anchor import resolve
from kiln.patch.shapes import cls, func
from tests.patchsets.support.patchlib import (
    assert_applies_once,
    assert_upstream,
    extract,
    patched_files,
)
from tests.patchsets.support.qwen3_parsers import PARSER as CODER
from tests.patchsets.support.qwen3_parsers import Tokenizer, _parser_cls, reasoning_parser_cls

SERVING = "entrypoints/openai/engine/serving.py"
CHAT = "entrypoints/openai/chat_completion/serving.py"
PARSER = "parser/abstract_parser.py"


@dataclasses.dataclass
class FunctionCall:
    name: str
    arguments: str
    id: str | None = None


@dataclasses.dataclass
class ToolCall:
    function: FunctionCall
    id: str = "call_0"


@dataclasses.dataclass
class ChatMessage:
    role: str
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ChatCompletionNamedToolChoiceParam:  # {"type": "function", "function": {"name": ...}}
    function: Any
    type: str = "function"


@dataclasses.dataclass
class ToolChoiceFunction:  # Responses API: {"type": "function", "name": ...}
    name: str
    type: str = "function"


@dataclasses.dataclass
class ChatCompletionRequest:
    tool_choice: Any
    tools: list = dataclasses.field(default_factory=list)
    _grammar_from_tool_parser: bool = False


class ResponsesRequest(ChatCompletionRequest):
    pass


NAMES = {
    "FunctionCall": FunctionCall,
    "ChatCompletionNamedToolChoiceParam": ChatCompletionNamedToolChoiceParam,
    "ToolChoiceFunction": ToolChoiceFunction,
    "ChatCompletionRequest": ChatCompletionRequest,
    "ResponsesRequest": ResponsesRequest,
    "TokenizerLike": object,
    "ToolParser": object,
    "is_mistral_tool_parser": lambda parser_cls: False,
}


def _function(source: str, dotted: str):
    ns = dict(NAMES)
    exec(compile(extract(source, dotted), f"<{dotted}>", "exec"), ns)
    fn = ns[dotted.rsplit(".", 1)[-1]]
    return fn.__func__ if isinstance(fn, staticmethod) else fn


def _named_branch(source: str):
    """The body of the chat path's `elif ... type(request.tool_choice) is Named...:` branch."""
    module = cst.parse_module(source)
    branch = resolve(
        module,
        (
            cls("OpenAIServingChat"),
            func("chat_completion_full_generator"),
            m.If(
                test=m.BooleanOperation(
                    right=m.Comparison(left=m.Call(func=m.Name("type")))
                )
            ),
        ),
    ).unique
    assert branch is not None
    body = "".join(module.code_for_node(s) for s in branch.body.body)
    return compile(textwrap.dedent(body), "<named branch>", "exec")


class Side:
    def __init__(self, serving, parser, chat, tool_parser_cls):
        self.tool_parser_cls = tool_parser_cls  # qwen3_coder: supports named tool choice
        self.parse_chat = _function(serving, "OpenAIServing._parse_tool_calls_from_content")
        self.parse_responses = _function(parser, "DelegatingParser._parse_tool_calls")
        self.named_branch = _named_branch(chat)

    def chat(self, request, reasoning, content):
        """Non-streaming chat: parse the content, then build the message (named branch)."""
        tool_calls, content = self.parse_chat(request, None, True, self.tool_parser_cls, content)
        ns = {
            "tool_calls": tool_calls,
            "tool_call_class": ToolCall,
            "is_mistral_tokenizer": lambda tokenizer: False,
            "tokenizer": None,
            "make_tool_call_id": lambda id_type, func_name, idx: f"call_{idx}",
            "self": type("Serving", (), {"tool_call_id_type": "random"})(),
            "history_tool_call_cnt": 0,
            "ChatMessage": ChatMessage,
            "role": "assistant",
            "reasoning": reasoning,
        }
        exec(self.named_branch, ns)
        return ns["message"]

    def responses(self, request, content):
        parser = type("DelegatingParser", (), {"_tool_parser": None})()
        return self.parse_responses(parser, request, content, True)


@pytest.fixture(scope="module")
def tree(sessions):
    return sessions("v0.20.1").tree


@pytest.fixture(scope="module")
def coder(tree):
    return _parser_cls(tree.read(CODER), tree)


@pytest.fixture(scope="module")
def pristine(tree, coder):
    return Side(tree.read(SERVING), tree.read(PARSER), tree.read(CHAT), coder)


@pytest.fixture(scope="module")
def patched(catalogue, sessions, coder):
    files = patched_files(catalogue, sessions("v0.20.1"), "K3")
    return Side(files[SERVING], files[PARSER], files[CHAT], coder)


@pytest.fixture(scope="module")
def truncated(tree):
    """What the real qwen3 reasoning parser makes of thinking cut by max_tokens."""
    parser = reasoning_parser_cls(tree)(Tokenizer())
    reasoning, content = parser.extract_reasoning("The user wants the weather, so I", None)
    assert (reasoning, content) == ("The user wants the weather, so I", None)
    return reasoning, content


NAMED = ChatCompletionRequest(
    tool_choice=ChatCompletionNamedToolChoiceParam(function=type("F", (), {"name": "get_weather"})())
)
RESPONSES = ResponsesRequest(tool_choice=ToolChoiceFunction(name="get_weather"))


def test_pristine_asserts(pristine, truncated):
    reasoning, content = truncated
    with pytest.raises(AssertionError):  # HTTP 500 for the client
        pristine.chat(NAMED, reasoning, content)
    with pytest.raises(AssertionError):
        pristine.responses(RESPONSES, content)


def test_no_call_and_the_reasoning_is_returned(patched, truncated):
    reasoning, content = truncated
    message = patched.chat(NAMED, reasoning, content)
    assert message.tool_calls == [] and message.reasoning == reasoning
    assert patched.responses(RESPONSES, content) == ([], None)


def test_a_forced_call_with_content_is_unchanged(patched, pristine):
    args = '{"city": "Paris"}'
    for side in (patched, pristine):
        message = side.chat(NAMED, "thought", args)
        assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
            ("get_weather", args)
        ]
        calls, rest = side.responses(RESPONSES, args)
        assert [(c.name, c.arguments) for c in calls] == [("get_weather", args)] and rest is None


def test_verdicts(catalogue, sessions):
    old = sessions("v0.20.1")
    assert_applies_once(catalogue, old, "K3")

    new = sessions("v0.33.0")
    detail = assert_upstream(catalogue, new, "K3")
    assert "parser/abstract_parser.py:424" in detail
    assert not new.tree.exists(SERVING)  # the chat-path half moved into the parser
