"""P64 on real 0.20.1 source: a delta with the last parameter and ``</function>`` keeps its arguments.

Behaviour test that runs the real parser module (``tests/patchsets/support/qwen3_parsers.py``
loads it). What is real vLLM 0.20.1 code:
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

import json

import pytest

from tests.patchsets.support.patchlib import assert_applies_once, assert_upstream, patched_files
from tests.patchsets.support.qwen3_parsers import (
    PARSER,
    Serving,
    _parser_cls,
    stream,
)

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
    old = sessions("v0.20.1")
    assert_applies_once(catalogue, old, "P64")

    # 0.33.0: the old parser file is gone and qwen3_coder is served by the streaming parser
    # engine, which emits every event of a delta in one message: UPSTREAM, with the places.
    new = sessions("v0.33.0")
    assert not new.tree.exists(PARSER)
    detail = assert_upstream(catalogue, new, "P64")
    registry = new.tree.read("tool_parsers/__init__.py").splitlines()
    line = next(n for n, text in enumerate(registry, 1) if '"qwen3_coder"' in text)
    assert f"tool_parsers/__init__.py:{line}: qwen3_coder is Qwen3EngineToolParser" in detail
    engine = new.tree.read("parser/engine/parser_engine.py").splitlines()
    start = next(n for n, text in enumerate(engine, 1) if "def extract_tool_calls_streaming" in text)
    at = int(detail.split("parser/engine/parser_engine.py:")[1].split(":")[0])
    assert start < at and "_events_to_delta" in engine[at - 1]
