"""K1 on the real parser engine of 0.24.0 and 0.33.0: a header-less <tool_call> is content.

Behaviour test: the pristine and the patched engine modules and ``parser/qwen3.py`` of each
tree run as modules on CPU (``tests/patchsets/support/parser_engine.py`` says what is stood
in), through the tool adapter's own streaming and non-streaming entry points, with the
``<tool_call>`` tag as its special token (as the model emits it) and as plain text.
"""

import pytest
from packaging.version import Version

from kiln.patch.engine import Session, isolated_run
from kiln.patch.model import BuildTarget, Verdict
from kiln.source.wheel import WheelSource
from tests.patchsets.support import parser_engine as pe
from tests.patchsets.support.patchlib import patched_files

# releases' wheels from PyPI on a machine whose kiln cache lacks them (tests/conftest.py keeps this true)
pytestmark = pytest.mark.network

RELEASES = ("0.24.0", "0.32.0", "0.33.0")  # the engine's first release, the CPU pin's, the newest pin
UPSTREAM_TESTED = Version("0.32.0")  # vLLM's tests for vllm#47137 ship from here (its sdist's tests/)
PROSE = ["Use the ", "<tool_call>", " tag to call tools", ", like this.", " Done."]
CALL = ["Let me check.", "<tool_call>", "\n<function=get_weather>\n", "<parameter=city>\nParis\n</parameter>\n",
        "</function>\n", "</tool_call>"]
PARIS = {0: {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.fixture(scope="module")
def sessions_by_release():
    return {v: Session(WheelSource(Version(v)).fetch()) for v in RELEASES}


@pytest.fixture(scope="module", params=RELEASES)
def engines(request, catalogue, sessions_by_release):
    """(pristine, patched) engines of one release."""
    session = sessions_by_release[request.param]
    patched = patched_files(catalogue, session, "K1")
    return pe.load(pe.tree_texts(session.tree)), pe.load(pe.tree_texts(session.tree, patched))


@pytest.fixture(params=[True, False], ids=["token-ids", "text"])
def token_ids(request):
    return request.param


def test_pristine_engine_drops_the_text_after_a_header_less_tag(engines, token_ids):
    pristine, _ = engines
    assert pe.content_of(pe.stream(pristine, PROSE, token_ids)) == "Use the "
    result = pe.complete(pristine, "".join(PROSE))
    assert result.content == "Use the " and not result.tools_called  # non-streaming loses it too


def test_patched_engine_streams_it_as_content(engines, token_ids):
    _, patched = engines
    messages = pe.stream(patched, PROSE, token_ids)
    assert pe.content_of(messages) == "".join(PROSE)
    assert pe.calls_of(messages) == {}
    result = pe.complete(patched, "".join(PROSE))
    assert result.content == "".join(PROSE) and not result.tools_called


def test_a_real_call_streams_exactly_as_before(engines, token_ids):
    pristine, patched = engines
    expected = pe.stream(pristine, CALL, token_ids)
    assert pe.calls_of(expected) == PARIS and pe.content_of(expected) == "Let me check."
    assert pe.stream(patched, CALL, token_ids) == expected
    # the header after held whitespace, in its own deltas
    spread = ["<tool_call>", "\n", "  ", "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",
              "</function>\n</tool_call>"]
    assert pe.stream(patched, spread, token_ids) == pe.stream(pristine, spread, token_ids)
    text = "".join(CALL)
    assert pe.complete(patched, text) == pe.complete(pristine, text)


def test_a_narrative_tag_before_a_real_call(engines, token_ids):
    pristine, patched = engines
    deltas = ["I will use <tool_call>", " tags. ", "<tool_call>", "\n",
              "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"]
    before = pe.stream(pristine, deltas, token_ids)
    assert pe.calls_of(before) == PARIS and pe.content_of(before) == "I will use "  # " tags. " lost
    after = pe.stream(patched, deltas, token_ids)
    assert pe.calls_of(after) == PARIS  # still call 0
    assert pe.content_of(after) == "I will use <tool_call> tags. "
    result = pe.complete(patched, "".join(deltas))
    assert [c.function.name for c in result.tool_calls] == ["get_weather"]
    assert result.content == "I will use <tool_call> tags."  # in order (stripped with a call)


def test_a_hermes_style_body_cut_off_is_not_lost(engines, token_ids):
    pristine, patched = engines
    deltas = ["<tool_call>", '{"name": "get_weather", "arguments": {"city": "Paris"}}']
    assert pe.stream(pristine, deltas, token_ids) == []  # nothing at all reaches the client
    messages = pe.stream(patched, deltas, token_ids)
    assert pe.content_of(messages) == "".join(deltas) and pe.calls_of(messages) == {}
    result = pe.complete(patched, "".join(deltas))
    assert result.content == "".join(deltas) and not result.tools_called


def test_a_closed_block_without_a_header_is_dropped_as_before(engines, token_ids):
    """``<tool_call>`` ... ``</tool_call>`` with no header is an unpromoted tool block: dropped
    (vLLM's rule, its test for vllm#47137), even with a Hermes-style JSON body."""
    pristine, patched = engines
    for deltas in (["<tool_call>", '{"name": "get_weather", "arguments": {"city": "Paris"}}', "</tool_call>"],
                   ["A ", "<tool_call>", "garbage", "</tool_call>", " B"]):
        assert pe.stream(patched, deltas, token_ids) == pe.stream(pristine, deltas, token_ids)
        assert pe.complete(patched, "".join(deltas)) == pe.complete(pristine, "".join(deltas))


# vLLM's own regression tests for vllm#47137 (tests/parser/engine/test_parser_engine.py,
# TestTruncatedToolOpenerStreamParity, 0.32.0 and 0.33.0), through kiln's harness: a stream
# cut off inside the opener sends no content and no call, in both paths; content before it
# is kept; text around an unpromoted block stays in order. K1 once released these as content
# (``ci/upstream_tests`` found it). On every release the patched engine answers as the
# pristine one; from 0.32.0 (vLLM's fix) that is the answer vLLM's test asserts.


def _as_upstream(engines, request, chunks, content: str):
    """The patched engine answers ``chunks`` as the pristine one; from 0.32.0 with ``content``."""
    pristine, patched = engines
    for token_ids in (True, False):
        messages = pe.stream(patched, chunks, token_ids)
        assert messages == pe.stream(pristine, chunks, token_ids)
        assert pe.calls_of(messages) == {}
        if Version(request.node.callspec.params["engines"]) >= UPSTREAM_TESTED:
            assert pe.content_of(messages) == content
    result = pe.complete(patched, "".join(chunks))
    assert result == pe.complete(pristine, "".join(chunks)) and not result.tools_called
    if Version(request.node.callspec.params["engines"]) >= UPSTREAM_TESTED:
        assert (result.content or "") == content


TRUNCATED_OPENERS = [["<tool_call>"], ["<tool_call>", "\n"], ["<tool_call>", "\n", "<"],
                     ["<tool_call>", "\n", "<function"]]


@pytest.mark.parametrize("chunks", TRUNCATED_OPENERS, ids=["tag", "newline", "angle", "function"])
def test_upstream_truncated_opener_dropped_in_both_paths(engines, request, chunks):
    _as_upstream(engines, request, chunks, "")


def test_upstream_content_before_truncated_opener_preserved(engines, request):
    _as_upstream(engines, request, ["Checking the weather. ", "<tool_call>", "\n", "<function"],
                 "Checking the weather. ")


def test_upstream_content_around_unpromoted_tool_block_stays_ordered(engines, request):
    _as_upstream(engines, request, ["A ", "<tool_call>", "garbage", "</tool_call>", " B"], "A  B")


def test_other_engines_are_unchanged(engines):
    _, patched = engines
    config = patched.parser_engine_config
    assert config.ParserEngineConfig(name="other").release_unheaded_tool_calls is False
    assert patched.qwen3.qwen3_config(thinking=True).release_unheaded_tool_calls is True


def test_verdicts(catalogue, sessions, sessions_by_release):
    for session in (sessions("v0.20.1"), *sessions_by_release.values()):
        target = BuildTarget(session.tree.vllm_version)
        outcome = isolated_run(catalogue, session, target, "K1").outcomes["K1"]
        expected = Verdict.GATED if session.tree.vllm_version < Version("0.24.0") else Verdict.APPLIES
        assert outcome.verdict is expected, outcome.detail
        p61c = isolated_run(catalogue, session, target, "P61c").outcomes["P61c"]
        assert p61c.verdict is (Verdict.APPLIES if expected is Verdict.GATED else Verdict.GATED), p61c.detail


@pytest.mark.parametrize("release", RELEASES)
def test_applying_twice_is_already_patched(catalogue, sessions_by_release, release):
    session = sessions_by_release[release]
    target = BuildTarget(session.tree.vllm_version)
    first = isolated_run(catalogue, session, target, "K1")
    again = isolated_run(catalogue, session.overlay(first.state.changed), target, "K1")
    assert again.outcomes["K1"].verdict is Verdict.ALREADY_PATCHED
