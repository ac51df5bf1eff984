"""The qwen3 parser engine of a real vLLM tree (0.24.0 on), executed on CPU.

What is real vLLM code (read from the tree under test, pristine or patched), run as modules
under their own names: ``parser/engine/{events,incremental_lexer,token_id_scanner,
parser_engine_config,streaming_parser_engine,parser_engine}.py`` and ``parser/qwen3.py``
(``qwen3_config`` and ``Qwen3Parser``, the class both the ``qwen3`` reasoning and the
``qwen3_coder`` tool adapters wrap). ``Qwen3Parser.extract_tool_calls_streaming`` and
``extract_tool_calls`` are the adapter's streaming and non-streaming entry points.
What is stood in (their real modules import pydantic, openai, torch, transformers): the
protocol classes (``tests/patchsets/support/qwen3_parsers.py``), ``regex`` by ``re``, the
logger, ``Parser``/``StreamState`` of ``parser/abstract_parser.py`` (a plain base and the two
fields the engine reads), tool-call ids (``call_<n>``), the schema helpers of
``tool_parsers/utils.py`` (no tools declared: names accepted, arguments left as they are) and
the tokenizer (the four Qwen special tokens plus ``<|im_end|>``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import sys
import types

import pytest

from tests.patchsets.support import qwen3_parsers as proto

ENGINE_MODULES = ("events", "incremental_lexer", "token_id_scanner", "parser_engine_config",
                  "streaming_parser_engine", "parser_engine")
FILES = tuple(f"parser/engine/{name}.py" for name in ENGINE_MODULES) + ("parser/qwen3.py",)
IM_END = 151645


class Tokenizer(proto.Tokenizer):
    """The Qwen special tokens; each run of other text in a delta is one token of its own."""

    all_special_tokens = ["<|im_end|>"]
    all_special_ids = [IM_END]

    def __init__(self) -> None:
        self._texts = {tid: text for text, tid in self.SPECIAL.items()}

    def ids(self, text: str) -> list[int]:
        out = []
        for tid, piece in zip(super().ids(text), self._pieces(text), strict=True):
            if tid not in self._texts or self._texts[tid] != piece:
                tid = 1000 + len(self._texts)
                self._texts[tid] = piece
            out.append(tid)
        return out

    def _pieces(self, text: str) -> list[str]:
        pattern = "(" + "|".join(re.escape(tag) for tag in self.SPECIAL) + ")"
        return [piece for piece in re.split(pattern, text) if piece]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(self._texts.get(tid, "") for tid in token_ids)


@dataclasses.dataclass
class StreamState:
    tool_call_id_type: str = "random"
    history_tool_call_cnt: int = 0


class Parser:  # vllm.parser.abstract_parser.Parser: only a base here
    def _initialize_history_tool_call_cnt(self, request) -> None:
        pass


def _stubs() -> dict:
    protocol = {name: getattr(proto, name) for name in (
        "DeltaFunctionCall", "DeltaMessage", "DeltaToolCall", "ExtractedToolCallInformation", "FunctionCall",
        "ToolCall")}
    ids = {"get_tool_call_id_type": lambda model_config: "random",
           "make_tool_call_id": lambda id_type="random", func_name=None, idx=None: f"call_{idx}"}
    modules = {
        "regex": re,
        "vllm.entrypoints.openai.engine.protocol": protocol,  # 0.24.0-0.29.0
        "vllm.entrypoints.generate.base.protocol": protocol,  # 0.30.0 on
        "vllm.entrypoints.chat_utils": ids,  # to 0.32.0
        "vllm.renderers.chat_utils": ids,  # 0.33.0
        "vllm.logger": {"init_logger": logging.getLogger},
        "vllm.parser.abstract_parser": {"Parser": Parser, "StreamState": StreamState},
        "vllm.tool_parsers.utils": {
            "coerce_to_schema_type": lambda value, types_: value,
            "extract_types_from_schema": lambda schema: [],
            "find_tool_name": lambda tools, name: True,
            "find_tool_properties": lambda tools, name: {},
        },
    }
    out: dict = {}
    for name, attrs in modules.items():
        if isinstance(attrs, types.ModuleType):
            out[name] = attrs
            continue
        parts = name.split(".")
        for i in range(1, len(parts)):
            package = ".".join(parts[:i])
            out.setdefault(package, types.ModuleType(package)).__path__ = []
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        out[name] = module
    return out


def load(texts: dict[str, str]) -> types.SimpleNamespace:
    """``texts``: rel path -> source for every file in ``FILES``. Returns the loaded modules.

    The modules import lazily too (the lexer inside a cached property), so every entry point
    below runs with this load's modules installed in ``sys.modules`` (``installed``).
    """
    modules = _stubs()
    for package in ("vllm", "vllm.parser", "vllm.parser.engine"):
        modules.setdefault(package, types.ModuleType(package)).__path__ = []
    engine = types.SimpleNamespace(modules=modules)
    with installed(engine):
        for rel in FILES:
            name = "vllm." + rel[:-3].replace("/", ".")
            module = modules[name] = sys.modules[name] = types.ModuleType(name)
            exec(compile(texts[rel], f"vllm/{rel}", "exec"), module.__dict__)
            setattr(engine, rel[:-3].rsplit("/", 1)[1], module)
    return engine


@contextlib.contextmanager
def installed(engine: types.SimpleNamespace):
    with pytest.MonkeyPatch.context() as mp:
        for name, module in engine.modules.items():
            mp.setitem(sys.modules, name, module)
        yield


def tree_texts(tree, patched: dict[str, str] | None = None) -> dict[str, str]:
    return {rel: (patched or {}).get(rel) or tree.read(rel) for rel in FILES}


def parser(engine: types.SimpleNamespace, thinking: bool = False):
    return engine.qwen3.Qwen3Parser(Tokenizer(), None, chat_template_kwargs={"enable_thinking": thinking})


def stream(engine, deltas: list[str], token_ids: bool = True, thinking: bool = False) -> list:
    """Every ``DeltaMessage`` the tool adapter returns for ``deltas``, then the one at the end."""
    seen, previous, previous_ids = [], "", []
    with installed(engine):
        p, request = parser(engine, thinking), proto.ChatCompletionRequest()
        tokenizer = p.model_tokenizer
        for delta in deltas:
            ids = tokenizer.ids(delta) if token_ids else []
            current = previous + delta
            seen.append(p.extract_tool_calls_streaming(previous, current, delta, previous_ids,
                                                       previous_ids + ids, ids, request))
            previous, previous_ids = current, previous_ids + ids
        seen.append(p.finish_streaming())
    return [message for message in seen if message is not None]


def content_of(messages: list) -> str:
    return "".join(message.content or "" for message in messages)


def calls_of(messages: list) -> dict[int, dict]:
    """index -> {"name", "arguments"} as a client assembles them from the deltas."""
    calls: dict[int, dict] = {}
    for message in messages:
        for call in message.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            if call.function and call.function.name:
                entry["name"] += call.function.name
            if call.function and call.function.arguments:
                entry["arguments"] += call.function.arguments
    return calls


def complete(engine, text: str):
    """The non-streaming result (``extract_tool_calls`` on the whole output)."""
    with installed(engine):
        return parser(engine).extract_tool_calls(text, proto.ChatCompletionRequest())
