"""P61c on real 0.20.1 source: a ``<tool_call>`` without a ``<function=`` header streams as content.

Behaviour test running the real qwen3_coder parser module of vLLM 0.20.1, pristine and
patched, and its real non-streaming ``extract_tool_calls`` as the reference for what the
output means; the last delta of each stream goes through the serving layer's real
end-of-stream reconciliation (``tests/patchsets/support/qwen3_parsers.py`` loads both; the
protocol classes and tokenizer are stood in there). Also run: the same streams through the
real ``DelegatingParser`` with vLLM's qwen3 reasoning parser, where a ``<tool_call>`` emitted
mid-thought ends reasoning and hands the rest of the output to this parser.
"""

from __future__ import annotations

import json

import pytest

from kiln.patch.engine import run_selection
from kiln.patch.model import BuildTarget
from tests.patchsets.support.patchlib import assert_applies_once, patched_files
from tests.patchsets.support.qwen3_parsers import (
    DELEGATING,
    PARSER,
    TOOLS,
    ChatCompletionRequest,
    Serving,
    Tokenizer,
    _parser_cls,
    delegating_parser_cls,
    reasoning_parser_cls,
    stream_deltas,
    stream_seen,
)

CALL = ["<tool_call>", "\n<function=bash>\n", "<parameter=command>\n", "ls\n</parameter>\n", "</function>\n</tool_call>"]
PROSE = ["I could wrap it in ", "<tool_call>", " tags, but", " no call is needed", " here."]
PROSE_THEN_CALL = ["Note: ", "<tool_call>", " is how I call tools.", " Now:\n", *CALL, "\n", "Done", " now."]
HERMES_JSON = ["<tool_call>", '\n{"name": "bash", "arguments": {"command": "ls"}}\n', "</tool_call>"]
HEADER_IN_PIECES = ["Sure.", "<tool_call>", "\n", "<func", "tion=bash>\n", *CALL[2:]]
# (the call's phases lag one delta behind here: no parameter may close with </function>,
# which is P64's failure, not this patch's)
TAG_AND_HEADER = ["Sure.<tool_call>\n<function=bash>\n", *CALL[2:4], "</function>\n", "</tool_call>"]


@pytest.fixture(scope="module")
def tree(sessions):
    return sessions("v0.20.1").tree


@pytest.fixture(scope="module")
def serving(tree):
    return Serving(tree)


@pytest.fixture(scope="module")
def pristine(tree):
    return _parser_cls(tree.read(PARSER), tree)


@pytest.fixture(scope="module")
def patched_text(catalogue, sessions):
    return patched_files(catalogue, sessions("v0.20.1"), "P61c")[PARSER]


@pytest.fixture(scope="module")
def patched(patched_text, tree):
    return _parser_cls(patched_text, tree)


@pytest.fixture(scope="module")
def with_p64(catalogue, sessions, tree):
    """P61c and P64 on one tree, as an image selects them (the same parser method)."""
    result = run_selection(catalogue, sessions("v0.20.1"), BuildTarget(tree.vllm_version), ["P61c", "P64"])
    assert all(o.verdict.ok for o in result.outcomes.values()), result.outcomes
    return _parser_cls(result.changed_text()[PARSER], tree)


def non_streaming(parser_cls, deltas):
    info = parser_cls(Tokenizer(), TOOLS).extract_tool_calls("".join(deltas), ChatCompletionRequest())
    return info.content, [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]


def calls(seen):
    return [(seen["names"][i], json.loads(seen["arguments"][i])) for i in sorted(seen["names"])]


@pytest.mark.parametrize("deltas", [PROSE, HERMES_JSON], ids=["prose", "hermes_json"])
def test_tag_without_header_streams_as_content(patched, pristine, serving, deltas):
    _, seen = stream_seen(patched, serving, deltas)
    content, tool_calls = non_streaming(pristine, deltas)
    assert tool_calls == [] and content == "".join(deltas)  # what the output means
    assert seen["content"] == content and not seen["names"]


def test_pristine_goes_silent_after_the_tag(pristine, serving):
    _, seen = stream_seen(pristine, serving, PROSE)
    assert seen["content"] == "I could wrap it in "  # the rest is never sent
    _, seen = stream_seen(pristine, serving, HERMES_JSON)
    assert seen["content"] == "" and not seen["names"]


def test_prose_tag_then_a_real_call(patched, pristine, serving):
    _, seen = stream_seen(patched, serving, PROSE_THEN_CALL)
    # (the newline right after </tool_call> is skipped by the parser, as before)
    assert seen["content"] == "Note: <tool_call> is how I call tools. Now:\nDone now."
    assert calls(seen) == [("bash", {"command": "ls"})] == non_streaming(pristine, PROSE_THEN_CALL)[1]
    # pristine: silence from the prose tag on, and the prose tag counted as call 0, so the
    # real call is located again as call 1 (empty arguments); the text after it is lost
    _, old = stream_seen(pristine, serving, PROSE_THEN_CALL)
    assert old["content"] == "Note: "
    assert old["names"] == {0: "bash", 1: "bash"} and old["arguments"][1] == "{}"


@pytest.mark.parametrize(
    "deltas",
    [[*CALL], ["Let me look.\n", *CALL], HEADER_IN_PIECES, TAG_AND_HEADER, [*CALL, "\n", *CALL]],
    ids=["call", "content_then_call", "header_in_pieces", "tag_and_header", "two_calls"],
)
def test_real_calls_stream_as_before(patched, pristine, serving, deltas):
    (_, new), (_, old) = stream_seen(patched, serving, deltas), stream_seen(pristine, serving, deltas)
    assert calls(new) == calls(old) == non_streaming(pristine, deltas)[1]
    assert new["content"] == old["content"]


def test_with_p64(with_p64, pristine, serving):
    """Both fixes hold together: prose released, and a last parameter closing with </function>."""
    _, seen = stream_seen(with_p64, serving, PROSE_THEN_CALL)
    assert seen["content"] == "Note: <tool_call> is how I call tools. Now:\nDone now."
    assert calls(seen) == [("bash", {"command": "ls"})]
    mtp_close = [*CALL[:3], "ls\n</parameter>\n</function>\n</tool_call>"]  # P64's case
    _, seen = stream_seen(with_p64, serving, mtp_close)
    assert calls(seen) == [("bash", {"command": "ls"})]
    _, old = stream_seen(pristine, serving, mtp_close)
    assert json.loads(old["arguments"][0]) == {}  # what P64 fixes


def test_through_the_delegating_parser_mid_thought(patched_text, tree, sessions):
    """Qwen3 reasoning parser: a <tool_call> mid-thought ends reasoning; the rest is not lost."""
    reasoning = reasoning_parser_cls(tree)
    deltas = ["I might need a", " <tool_call>", " later, but first", " I think it is 4.", "</think>\n\n4"]
    sides = {}
    for name, text in (("pristine", tree.read(PARSER)), ("patched", patched_text)):
        parser_cls = delegating_parser_cls(tree.read(DELEGATING), reasoning, _parser_cls(text, tree))
        sides[name] = stream_deltas(parser_cls(Tokenizer(), TOOLS), deltas)
    assert sides["pristine"]["content"] == ""  # everything after the tag swallowed
    after_tag = "".join(deltas)[len("I might need a ") :]
    assert sides["patched"]["content"] == after_tag
    # (the space before the tag is the boundary delta's reasoning, which K2 keeps)
    assert sides["patched"]["reasoning"] == sides["pristine"]["reasoning"] == "I might need a"


def test_applies_once_and_is_gated_to_its_file_on_0330(catalogue, sessions):
    from kiln.patch.engine import isolated_run
    from kiln.patch.model import BuildTarget, Verdict

    old = sessions("v0.20.1")
    assert_applies_once(catalogue, old, "P61c")

    # 0.33.0: the parser file is gone (the engine serves qwen3_coder; K1 carries the fix
    # there), and the version gate says so before the missing file would
    new = sessions("v0.33.0")
    assert not new.tree.exists("tool_parsers/qwen3coder_tool_parser.py")
    outcome = isolated_run(catalogue, new, BuildTarget(new.tree.vllm_version), "P61c").outcomes["P61c"]
    assert outcome.verdict is Verdict.GATED and outcome.detail == "vllm 0.33.0 not in <0.24.0"
