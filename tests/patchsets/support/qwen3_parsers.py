"""The qwen3 reasoning parser, the qwen3_coder tool parser and the delegating stream parser of
a real vLLM tree, executed on CPU without vLLM's imports, for the parser patches' tests.

What is real vLLM code (read from the tree under test, pristine or patched):
- ``tool_parsers/qwen3coder_tool_parser.py``, executed as a module; its base class ``ToolParser``
  (``tool_parsers/abstract_tool_parser.py``) and ``find_tool_properties``/``_extract_tool_info``
  (``tool_parsers/utils.py``), extracted and executed;
- ``reasoning/qwen3_reasoning_parser.py`` and ``reasoning/basic_parsers.py``, executed as
  modules, over ``ReasoningParser`` (``reasoning/abs_reasoning_parsers.py``, extracted);
- ``DelegatingParser``'s streaming methods (``parse_delta`` and what it calls) and
  ``StreamState`` (``parser/abstract_parser.py``), extracted;
- the serving layer's end-of-stream reconciliation in ``chat_completion/serving.py`` (the
  ``if should_check and tool_parser and auto_tools_called:`` block of
  ``OpenAIServingChat.chat_completion_stream_generator`` and the methods
  ``_should_check_for_unstreamed_tool_arg_tokens`` / ``_create_remaining_args_delta``).
What is stood in (vLLM's own imports need pydantic, openai, torch and transformers):
- the protocol classes (``DeltaMessage``, ``DeltaToolCall``, ``DeltaFunctionCall``,
  ``FunctionCall``, ``ToolCall``, ``ExtractedToolCallInformation``, ``ChatCompletionToolsParam``,
  ``FunctionDefinition``) as dataclasses with the real field names and defaults;
- ``regex`` by the standard ``re`` (the parsers' patterns need nothing more), ``init_logger``
  by ``logging.getLogger``, the tokenizer by a vocab holding the special tokens;
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
from abc import abstractmethod
from collections.abc import Callable, Iterable, Sequence
from functools import cached_property
from typing import Any, Literal

import libcst as cst
import libcst.matchers as m
import pytest

from kiln.patch.anchor import resolve
from kiln.patch.shapes import cls, func
from tests.patchsets.support.patchlib import extract

PARSER = "tool_parsers/qwen3coder_tool_parser.py"
SERVING = "entrypoints/openai/chat_completion/serving.py"
TOOL_CALL, TOOL_CALL_END = 151657, 151658  # <tool_call>, </tool_call>
THINK, THINK_END = 151667, 151668  # <think>, </think>
REASONING = "reasoning/qwen3_reasoning_parser.py"
DELEGATING = "parser/abstract_parser.py"


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
    SPECIAL = {
        "<tool_call>": TOOL_CALL,
        "</tool_call>": TOOL_CALL_END,
        "<think>": THINK,
        "</think>": THINK_END,
    }

    def get_vocab(self):
        return dict(self.SPECIAL)

    def ids(self, text: str) -> list[int]:
        """Token ids of a delta, in order: each special token, and one id (7) per run of text."""
        pattern = "(" + "|".join(re.escape(tag) for tag in self.SPECIAL) + ")"
        return [self.SPECIAL.get(piece, 7) for piece in re.split(pattern, text) if piece]


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
    parser, seen = stream_seen(parser_cls, serving, deltas)
    return parser, seen["arguments"]


def stream_seen(parser_cls, serving, deltas):
    """As ``stream``; also what the client reads as content and the tool names, per index."""
    parser = parser_cls(Tokenizer(), TOOLS)
    request = ChatCompletionRequest()
    previous, previous_ids = "", []
    seen: dict = {"content": "", "names": {}, "arguments": {}}
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
        if delta is not None:
            seen["content"] += delta.content or ""
        for call in delta.tool_calls if delta else []:
            if call.function and call.function.name:
                seen["names"][call.index] = call.function.name
            if call.function and call.function.arguments is not None:
                args = seen["arguments"]
                args[call.index] = args.get(call.index, "") + call.function.arguments
        previous, previous_ids = current, previous_ids + ids
    return parser, seen


# --- the qwen3 reasoning parser and the delegating stream parser ------------------------------


def _module_stubs(**modules) -> dict:
    out = {"vllm": types.ModuleType("vllm")}
    for name, attrs in modules.items():
        parts = name.split(".")
        for i in range(2, len(parts)):
            out.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        out[name] = types.SimpleNamespace(**attrs)
    return out


def _exec_module(source: str, filename: str, stubs: dict) -> types.ModuleType:
    module = types.ModuleType(filename)
    with pytest.MonkeyPatch.context() as mp:
        for name, stub in stubs.items():
            mp.setitem(sys.modules, name, stub)
        exec(compile(source, f"vllm/{filename}", "exec"), module.__dict__)
    return module


def reasoning_parser_cls(tree, qwen3_source: str | None = None) -> type:
    """The real ``Qwen3ReasoningParser`` of ``tree`` (or of ``qwen3_source``, e.g. patched)."""
    base = _exec_defs(
        tree.read("reasoning/abs_reasoning_parsers.py"),
        ["ReasoningParser"],
        {
            "cached_property": cached_property,
            "abstractmethod": abstractmethod,
            "Sequence": Sequence,
            "Iterable": Iterable,
            "Callable": Callable,
            "ModelConfig": object,
            "TYPE_CHECKING": False,
        },
    )["ReasoningParser"]
    protocol = {"DeltaMessage": DeltaMessage}
    basic = _exec_module(
        tree.read("reasoning/basic_parsers.py"),
        "reasoning/basic_parsers.py",
        _module_stubs(
            **{
                "vllm.entrypoints.openai.engine.protocol": protocol,
                "vllm.reasoning.abs_reasoning_parsers": {"ReasoningParser": base},
                "vllm.tokenizers": {"TokenizerLike": object},
            }
        ),
    )
    qwen3 = _exec_module(
        qwen3_source if qwen3_source is not None else tree.read(REASONING),
        REASONING,
        _module_stubs(
            **{
                "vllm.entrypoints.openai.engine.protocol": protocol,
                "vllm.reasoning.basic_parsers": {
                    "BaseThinkingReasoningParser": basic.BaseThinkingReasoningParser
                },
                "vllm.tool_parsers.utils": {"partial_tag_overlap": None},
            }
        ),
    )
    return qwen3.Qwen3ReasoningParser


STREAM_METHODS = [
    "parse_delta",
    "_in_reasoning_phase",
    "_in_tool_call_phase",
    "is_reasoning_end",
    "extract_content_ids",
    "extract_reasoning_streaming",
    "extract_tool_calls_streaming",
]


def delegating_parser_cls(delegating_source: str, reasoning_cls, tool_cls) -> type:
    """``DelegatingParser``'s real streaming methods over the two real parsers."""
    ns = _exec_defs(
        delegating_source,
        ["StreamState", *(f"DelegatingParser.{name}" for name in STREAM_METHODS)],
        {
            "dataclass": dataclasses.dataclass,
            "field": dataclasses.field,
            "Sequence": Sequence,
            "DeltaMessage": DeltaMessage,
            "ChatCompletionRequest": ChatCompletionRequest,
            "ResponsesRequest": type("ResponsesRequest", (), {}),
        },
    )
    stream_state = ns["StreamState"]

    def __init__(self, tokenizer, tools=None):
        self._reasoning_parser = reasoning_cls(tokenizer)
        self._tool_parser = tool_cls(tokenizer, tools)
        self._stream_state = stream_state()

    methods = {name: ns[name] for name in STREAM_METHODS} | {"__init__": __init__}
    return type("DelegatingParser", (), methods)


def stream_deltas(parser, deltas, prompt_ids=(1, 2, THINK)):
    """Feed ``deltas`` through ``parser.parse_delta``; what the client reads, per channel."""
    tokenizer = Tokenizer()
    request = ChatCompletionRequest()
    seen = {"reasoning": "", "content": "", "arguments": {}, "names": {}}
    for text in deltas:
        message = parser.parse_delta(text, tokenizer.ids(text), request, list(prompt_ids))
        if message is None:
            continue
        seen["reasoning"] += message.reasoning or ""
        seen["content"] += message.content or ""
        for call in message.tool_calls:
            if call.function and call.function.name:
                seen["names"][call.index] = call.function.name
            if call.function and call.function.arguments is not None:
                args = seen["arguments"]
                args[call.index] = args.get(call.index, "") + call.function.arguments
    return seen
