"""P64 on real 0.20.1 source: a delta with the last parameter and ``</function>`` keeps its arguments.

Behaviour test that runs the real parser module. What is real vLLM 0.20.1 code:
- the whole ``tool_parsers/qwen3coder_tool_parser.py`` module, pristine and patched (the
  patched text is kiln's output), executed as a module; the tests drive its
  ``Qwen3CoderToolParser.extract_tool_calls_streaming``;
- its base class ``ToolParser`` (``tool_parsers/abstract_tool_parser.py``) and
  ``find_tool_properties``/``_extract_tool_info`` (``tool_parsers/utils.py``), extracted from
  the pristine tree and executed;
- the serving layer's end-of-stream reconciliation in ``chat_completion/serving.py``: the
  ``if should_check and tool_parser and auto_tools_called:`` block of
  ``OpenAIServingChat.chat_completion_stream_generator`` and the methods
  ``_should_check_for_unstreamed_tool_arg_tokens`` / ``_create_remaining_args_delta``.
What is stood in (vLLM's own imports need pydantic, openai, torch and transformers):
- the protocol classes (``DeltaMessage``, ``DeltaToolCall``, ``DeltaFunctionCall``,
  ``FunctionCall``, ``ToolCall``, ``ExtractedToolCallInformation``, ``ChatCompletionToolsParam``,
  ``FunctionDefinition``) as dataclasses with the real field names and defaults;
- ``regex`` by the standard ``re`` (the parser's patterns need nothing more), ``init_logger``
  by ``logging.getLogger``, the tokenizer by a vocab with the two tool-call tokens;
- the two assignments before the reconciliation block (``auto_tools_called``, ``index``),
  restated from serving.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
import textwrap
import types
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any, Literal

import libcst as cst
import libcst.matchers as m
import pytest

from kiln.patch.anchor import resolve
from kiln.patch.shapes import cls, func
from tests.patchsets.support.patchlib import extract, patched_files

PARSER = "tool_parsers/qwen3coder_tool_parser.py"
SERVING = "entrypoints/openai/chat_completion/serving.py"
TOOL_CALL, TOOL_CALL_END = 151657, 151658  # <tool_call>, </tool_call>


# --- protocol stand-ins: field names and defaults of vllm/entrypoints/openai/*/protocol.py ---


@dataclasses.dataclass(kw_only=True)
class DeltaFunctionCall:
    name: str | None = None
    arguments: str | None = None


@dataclasses.dataclass(kw_only=True)
class DeltaToolCall:
    id: str | None = None
    type: Literal["function"] | None = None
    index: int
    function: DeltaFunctionCall | None = None


@dataclasses.dataclass(kw_only=True)
class DeltaMessage:
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(kw_only=True)
class FunctionCall:
    id: str | None = None
    name: str
    arguments: str


@dataclasses.dataclass(kw_only=True)
class ToolCall:
    id: str = "call_0"
    type: Literal["function"] = "function"
    function: FunctionCall


@dataclasses.dataclass(kw_only=True)
class ExtractedToolCallInformation:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None = None


@dataclasses.dataclass(kw_only=True)
class FunctionDefinition:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


@dataclasses.dataclass(kw_only=True)
class ChatCompletionToolsParam:
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionTool:  # openai.types.responses.FunctionTool: never used here
    pass


class ChatCompletionRequest:
    pass


class Tokenizer:
    def get_vocab(self):
        return {"<tool_call>": TOOL_CALL, "</tool_call>": TOOL_CALL_END}


def _exec_defs(source: str, names: list[str], namespace: dict) -> dict:
    for name in names:
        exec(compile(extract(source, name), f"<{name}>", "exec"), namespace)
    return namespace


def _parser_cls(parser_source: str, pristine_tree) -> type:
    """Execute the real parser module with its vLLM imports satisfied by stand-ins."""
    utils = _exec_defs(
        pristine_tree.read("tool_parsers/utils.py"),
        ["_extract_tool_info", "find_tool_properties"],
        {
            "Any": Any,
            "Tool": object,
            "FunctionTool": FunctionTool,
            "ChatCompletionToolsParam": ChatCompletionToolsParam,
        },
    )
    base = _exec_defs(
        pristine_tree.read("tool_parsers/abstract_tool_parser.py"),
        ["ToolParser"],
        {
            "cached_property": cached_property,
            "Callable": Callable,
            "Sequence": Sequence,
            "TokenizerLike": object,
            "Tool": object,
            "ChatCompletionToolsParam": ChatCompletionToolsParam,
            "FunctionTool": FunctionTool,
            "ChatCompletionRequest": ChatCompletionRequest,
            "ResponsesRequest": type("ResponsesRequest", (), {}),
            "DeltaMessage": DeltaMessage,
            "ExtractedToolCallInformation": ExtractedToolCallInformation,
        },
    )
    stubs = {
        "regex": re,
        "vllm": types.ModuleType("vllm"),
        "vllm.entrypoints": types.ModuleType("vllm.entrypoints"),
        "vllm.entrypoints.openai": types.ModuleType("vllm.entrypoints.openai"),
        "vllm.entrypoints.openai.chat_completion": types.ModuleType(
            "vllm.entrypoints.openai.chat_completion"
        ),
        "vllm.entrypoints.openai.chat_completion.protocol": types.SimpleNamespace(
            ChatCompletionRequest=ChatCompletionRequest
        ),
        "vllm.entrypoints.openai.engine": types.ModuleType("vllm.entrypoints.openai.engine"),
        "vllm.entrypoints.openai.engine.protocol": types.SimpleNamespace(
            DeltaFunctionCall=DeltaFunctionCall,
            DeltaMessage=DeltaMessage,
            DeltaToolCall=DeltaToolCall,
            ExtractedToolCallInformation=ExtractedToolCallInformation,
            FunctionCall=FunctionCall,
            ToolCall=ToolCall,
        ),
        "vllm.logger": types.SimpleNamespace(init_logger=logging.getLogger),
        "vllm.tokenizers": types.SimpleNamespace(TokenizerLike=object),
        "vllm.tool_parsers": types.ModuleType("vllm.tool_parsers"),
        "vllm.tool_parsers.abstract_tool_parser": types.SimpleNamespace(
            Tool=object, ToolParser=base["ToolParser"]
        ),
        "vllm.tool_parsers.utils": types.SimpleNamespace(
            find_tool_properties=utils["find_tool_properties"]
        ),
    }
    module = types.ModuleType("qwen3coder_tool_parser_under_test")
    with pytest.MonkeyPatch.context() as mp:
        for name, stub in stubs.items():
            mp.setitem(sys.modules, name, stub)
        exec(compile(parser_source, f"vllm/{PARSER}", "exec"), module.__dict__)
    return module.Qwen3CoderToolParser


class Serving:
    """The real end-of-stream reconciliation of 0.20.1's streaming chat completion."""

    def __init__(self, tree):
        text = tree.read(SERVING)
        module = cst.parse_module(text)
        block = resolve(
            module,
            (
                cls("OpenAIServingChat"),
                func("chat_completion_stream_generator"),
                m.If(test=m.BooleanOperation(left=m.BooleanOperation(left=m.Name("should_check")))),
            ),
        ).unique
        assert block is not None
        self.block = compile(textwrap.dedent(module.code_for_node(block)), "<serving>", "exec")
        ns = _exec_defs(
            text,
            [
                "OpenAIServingChat._should_check_for_unstreamed_tool_arg_tokens",
                "OpenAIServingChat._create_remaining_args_delta",
            ],
            {
                "DeltaMessage": DeltaMessage,
                "DeltaToolCall": DeltaToolCall,
                "DeltaFunctionCall": DeltaFunctionCall,
                "CompletionOutput": object,
            },
        )
        self.should_check = ns["_should_check_for_unstreamed_tool_arg_tokens"]
        self.remaining = ns["_create_remaining_args_delta"]

    def finish(self, tool_parser, delta_message):
        """What the last chunk (finish_reason set) carries instead of ``delta_message``."""
        this = types.SimpleNamespace(
            enable_auto_tools=True,
            tool_parser=tool_parser,
            _create_remaining_args_delta=self.remaining,
        )
        output = types.SimpleNamespace(finish_reason="stop")
        # restated from serving.py, right before the block
        auto_tools_called = len(tool_parser.prev_tool_call_arr) > 0
        index = len(tool_parser.prev_tool_call_arr) - 1 if auto_tools_called else 0
        ns = {
            "self": this,
            "should_check": self.should_check(this, delta_message, output),
            "tool_parser": tool_parser,
            "auto_tools_called": auto_tools_called,
            "delta_message": delta_message,
            "index": index,
            "json": json,
            "DeltaFunctionCall": DeltaFunctionCall,
        }
        exec(self.block, ns)
        return ns["delta_message"]


TOOLS = [
    ChatCompletionToolsParam(
        function=FunctionDefinition(
            name="bash",
            parameters={
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
            },
        )
    )
]


def stream(parser_cls, serving, deltas):
    """Feed ``deltas`` as the serving layer does; the last one carries finish_reason.

    Returns the parser and the arguments a client assembles per tool-call index.
    """
    parser = parser_cls(Tokenizer(), TOOLS)
    request = ChatCompletionRequest()
    previous, previous_ids = "", []
    client: dict[int, str] = {}
    for n, text in enumerate(deltas):
        ids = [TOOL_CALL] if "<tool_call>" in text else []
        ids += [TOOL_CALL_END] if "</tool_call>" in text else []
        ids = ids or [7]
        current = previous + text
        delta = parser.extract_tool_calls_streaming(
            previous, current, text, previous_ids, previous_ids + ids, ids, request
        )
        if n == len(deltas) - 1 and delta is not None:
            delta = serving.finish(parser, delta)
        for call in delta.tool_calls if delta else []:
            if call.function and call.function.arguments is not None:
                client[call.index] = client.get(call.index, "") + call.function.arguments
        previous, previous_ids = current, previous_ids + ids
    return parser, client


HEAD = ["Let me look.\n", "<tool_call>", "\n<function=bash>\n", "<parameter=command>\n"]
# MTP: the last parameter, </function>, </tool_call> (and EOS) in the final delta
ONE_PARAM = [*HEAD, "ls -la\n</parameter>\n</function>\n</tool_call>"]
TWO_PARAMS = [
    *HEAD,
    "ls -la\n</parameter>\n",
    "<parameter=timeout>\n30\n</parameter>\n</function>\n</tool_call>",
]


@pytest.fixture(scope="module")
def serving(sessions):
    return Serving(sessions("v0.20.1").tree)


@pytest.fixture(scope="module")
def patched_parser(catalogue, sessions):
    text = patched_files(catalogue, sessions("v0.20.1"), "P64")[PARSER]
    return _parser_cls(text, sessions("v0.20.1").tree)


@pytest.fixture(scope="module")
def pristine_parser(sessions):
    tree = sessions("v0.20.1").tree
    return _parser_cls(tree.read(PARSER), tree)


@pytest.mark.parametrize(
    ("deltas", "expected"),
    [(ONE_PARAM, {"command": "ls -la"}), (TWO_PARAMS, {"command": "ls -la", "timeout": 30})],
)
def test_final_arguments_are_not_empty(patched_parser, serving, deltas, expected):
    parser, client = stream(patched_parser, serving, deltas)
    assert json.loads(parser.prev_tool_call_arr[0]["arguments"]) == expected
    assert json.loads(parser.streamed_args_for_tool[0]) == expected
    assert json.loads(client[0]) == expected  # what the client assembles, finish chunk included


def test_pristine_leaves_the_arguments_empty(pristine_parser, serving):
    parser, client = stream(pristine_parser, serving, ONE_PARAM)
    assert parser.prev_tool_call_arr[0]["arguments"] == "{}"  # never closed
    assert parser.streamed_args_for_tool[0] == '{"command": "ls -la"'
    assert json.loads(client[0]) == {}  # the finish chunk's reconciliation dropped the value


def test_pristine_breaks_the_json_with_two_parameters(pristine_parser, serving):
    parser, client = stream(pristine_parser, serving, TWO_PARAMS)
    assert parser.prev_tool_call_arr[0]["arguments"] == "{}"
    with pytest.raises(json.JSONDecodeError):
        json.loads(client[0])


def test_close_arriving_later_is_unchanged(patched_parser, pristine_parser, serving):
    """Parameters and </function> in separate deltas: same stream as before the patch."""
    deltas = [*HEAD, "ls -la\n</parameter>\n", "</function>\n", "</tool_call>"]
    results = [stream(p, serving, deltas) for p in (pristine_parser, patched_parser)]
    (old_parser, old_client), (new_parser, new_client) = results
    assert old_client == new_client == {0: '{"command": "ls -la"}'}
    assert old_parser.prev_tool_call_arr == new_parser.prev_tool_call_arr


def test_two_tool_calls_each_closed_in_their_last_delta(patched_parser, serving):
    second = [
        "\n<tool_call>",
        "\n<function=bash>\n",
        "<parameter=command>\n",
        "pwd\n</parameter>\n</function>\n</tool_call>",
    ]
    parser, client = stream(patched_parser, serving, [*ONE_PARAM, *second])
    assert [json.loads(c["arguments"]) for c in parser.prev_tool_call_arr] == [
        {"command": "ls -la"},
        {"command": "pwd"},
    ]
    assert {i: json.loads(a) for i, a in client.items()} == {
        0: {"command": "ls -la"},
        1: {"command": "pwd"},
    }


def test_verdicts(catalogue, sessions):
    from kiln.patch.engine import isolated_run
    from kiln.patch.model import BuildTarget, Verdict

    old = sessions("v0.20.1")
    target = BuildTarget(old.tree.vllm_version)
    first = isolated_run(catalogue, old, target, "P64")
    assert first.outcomes["P64"].verdict is Verdict.APPLIES
    again = isolated_run(catalogue, old.overlay(first.state.changed), target, "P64")
    assert again.outcomes["P64"].verdict is Verdict.ALREADY_PATCHED

    # 0.33.0: the old parser file is gone and qwen3_coder is served by the streaming parser
    # engine, which emits every event of a delta in one message: UPSTREAM, with the places.
    new = sessions("vllm-0.33.0")
    assert not new.tree.exists(PARSER)
    outcome = isolated_run(catalogue, new, BuildTarget(new.tree.vllm_version), "P64").outcomes[
        "P64"
    ]
    assert outcome.verdict is Verdict.UPSTREAM, outcome.detail
    registry = new.tree.read("tool_parsers/__init__.py").splitlines()
    line = next(n for n, text in enumerate(registry, 1) if '"qwen3_coder"' in text)
    assert f"tool_parsers/__init__.py:{line}: qwen3_coder is Qwen3EngineToolParser" in outcome.detail
    engine = new.tree.read("parser/engine/parser_engine.py").splitlines()
    start = next(n for n, text in enumerate(engine, 1) if "def extract_tool_calls_streaming" in text)
    at = int(outcome.detail.split("parser/engine/parser_engine.py:")[1].split(":")[0])
    assert start < at and "_events_to_delta" in engine[at - 1]
