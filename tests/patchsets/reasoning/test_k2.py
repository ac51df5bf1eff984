"""K2 on real 0.20.1 source: the delta that ends reasoning keeps its reasoning text.

Behaviour test running the real stream parsers (``tests/patchsets/support/qwen3_parsers.py``
loads them): ``DelegatingParser.parse_delta`` and the methods it calls, pristine and patched,
over vLLM 0.20.1's own ``Qwen3ReasoningParser`` and ``Qwen3CoderToolParser`` (the parsers of
``--reasoning-parser qwen3 --tool-call-parser qwen3_coder``), fed MTP-sized deltas the way
``chat_completion/serving.py`` feeds them (delta text, delta token ids, prompt ids ending in
``<think>`` as Qwen3.6's chat template leaves them). Stood in: the protocol dataclasses and
the tokenizer (see the support module).
"""

from __future__ import annotations

import json

import pytest

from tests.patchsets.support.patchlib import assert_applies_once, assert_upstream, patched_files
from tests.patchsets.support.qwen3_parsers import (
    DELEGATING,
    PARSER,
    TOOLS,
    Tokenizer,
    _parser_cls,
    delegating_parser_cls,
    reasoning_parser_cls,
    stream_deltas,
)

REASONING_TEXT = "The user wants the files. I should list them."


def _parser(delegating_source, tree):
    tool_cls = _parser_cls(tree.read(PARSER), tree)
    cls_ = delegating_parser_cls(delegating_source, reasoning_parser_cls(tree), tool_cls)
    return cls_(Tokenizer(), TOOLS)


@pytest.fixture(scope="module")
def patched(catalogue, sessions):
    text = patched_files(catalogue, sessions("v0.20.1"), "K2")[DELEGATING]
    return lambda: _parser(text, sessions("v0.20.1").tree)


@pytest.fixture(scope="module")
def pristine(sessions):
    tree = sessions("v0.20.1").tree
    return lambda: _parser(tree.read(DELEGATING), tree)


# MTP: up to four tokens a delta; the reasoning's last words arrive with </think>
ANSWER = ["The user", " wants the", " files. I should list", " them.</think>", "\n\nHere", " they are."]
TOOL_CALL = [
    "The user",
    " wants the",
    " files. I should list",
    " them.</think>\n\n<tool_call>",
    "\n<function=bash>\n",
    "<parameter=command>\n",
    "ls\n</parameter>\n",
    "</function>\n</tool_call>",
]


@pytest.mark.parametrize("deltas", [ANSWER, TOOL_CALL], ids=["answer", "tool_call"])
def test_reasoning_tail_kept(patched, deltas):
    seen = stream_deltas(patched(), deltas)
    assert seen["reasoning"] == REASONING_TEXT


def test_pristine_drops_the_reasoning_tail(pristine):
    for deltas in (ANSWER, TOOL_CALL):
        seen = stream_deltas(pristine(), deltas)
        assert seen["reasoning"] == "The user wants the files. I should list"


def test_content_and_tool_call_unchanged(patched, pristine):
    for deltas in (ANSWER, TOOL_CALL):
        new, old = stream_deltas(patched(), deltas), stream_deltas(pristine(), deltas)
        assert (new["content"], new["names"], new["arguments"]) == (
            old["content"],
            old["names"],
            old["arguments"],
        )
    seen = stream_deltas(patched(), TOOL_CALL)
    assert seen["names"] == {0: "bash"}
    assert json.loads(seen["arguments"][0]) == {"command": "ls"}
    assert stream_deltas(patched(), ANSWER)["content"] == "\n\nHere they are."


def test_single_token_boundary_is_unchanged(patched, pristine):
    deltas = ["The user", " wants the files.", "</think>", "\n\nHere", " they are."]
    assert stream_deltas(patched(), deltas) == stream_deltas(pristine(), deltas)


def test_verdicts(catalogue, sessions):
    old = sessions("v0.20.1")
    assert_applies_once(catalogue, old, "K2")

    new = sessions("v0.33.0")
    detail = assert_upstream(catalogue, new, "K2")
    assert "parser/abstract_parser.py:947" in detail
