"""PN73 on real source: malformed tool-call arguments in the history no longer fail the request.

Behaviour test running extracted code: vLLM's own ``_postprocess_messages``
(``entrypoints/chat_utils.py``), pristine and patched by PN73 (with the patch's
``_tool_call_arguments_as_object``), of 0.20.1 (the rollback pin), 0.22.0 and 0.23.0 (the two
later shapes the codemod rewrites), executed on conversations in the shape
``_parse_chat_message_content`` hands it. Stood in: the module's ``logger`` (a real
``logging.Logger``, whose records the test reads) and ``VLLMValidationError`` (a ``ValueError``,
as vLLM's is). vLLM 0.29.0's own ``_postprocess_messages`` (upstream's fix) runs on the same
conversations: the patched rollback pin must treat every one of them as 0.29.0 does, so a pin
bump changes nothing. The patched 0.20.1 history is then rendered with kiln's baked
``images/files/chat-templates/qwen3.6.jinja`` (a jinja2 sandbox set up as transformers does).
0.29.0 and 0.33.0 are checked through their verdicts.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import jinja2.ext
import jinja2.sandbox
import pytest
from packaging.version import Version

from kiln.patch.engine import Session, isolated_run
from kiln.patch.model import BuildTarget, Verdict
from kiln.source.wheel import WheelSource
from tests.patchsets.support.patchlib import assert_applies_once, patched_files, run_defs

TARGET = "entrypoints/chat_utils.py"
TEMPLATE = (Path(__file__).parents[3] / "images/files/chat-templates/qwen3.6.jinja").read_text()
HELPER = "_tool_call_arguments_as_object"
LOGGER = "vllm.entrypoints.chat_utils"


def _postprocess(source: str):
    """The real ``_postprocess_messages`` of ``source`` (and the patch's helper, when there)."""
    ns = run_defs(source, ["_postprocess_messages", HELPER], {
        "json": json,
        "logger": logging.getLogger(LOGGER),
        "VLLMValidationError": type("VLLMValidationError", (ValueError,), {}),
        "ConversationMessage": dict,
    }, TARGET, optional=(HELPER,))
    return ns["_postprocess_messages"], HELPER in ns


def _session(sessions, version: str):
    return sessions("v0.20.1") if version == "0.20.1" else Session(WheelSource(Version(version)).fetch())


@pytest.fixture(scope="module")
def release_sessions(sessions):
    cache: dict = {}

    def get(version: str):
        if version not in cache:
            cache[version] = _session(sessions, version)
        return cache[version]

    return get


@pytest.fixture(scope="module")
def upstream(release_sessions):
    run, has_helper = _postprocess(release_sessions("0.29.0").tree.read(TARGET))
    assert not has_helper
    return run


def _pair(catalogue, release_sessions, version):
    session = release_sessions(version)
    pristine, pristine_helper = _postprocess(session.tree.read(TARGET))
    patched, patched_helper = _postprocess(patched_files(catalogue, session, "PN73")[TARGET])
    assert (pristine_helper, patched_helper) == (False, True)
    return pristine, patched


def history(arguments, name="get_weather"):
    """A conversation whose assistant turn called a tool with ``arguments``, then its result."""
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "user", "content": "And tomorrow?"},
    ]


def arguments_after(run, arguments):
    conversation = history(copy.deepcopy(arguments))
    run(conversation)
    return conversation[1]["tool_calls"][0]["function"]["arguments"]


MALFORMED = ['{"city": "Paris"', "{}}", "city=Paris", '{"city": Paris}']
NOT_AN_OBJECT = ["[1, 2]", "42", '"Paris"', "true"]
UNCHANGED = ['{"city": "Paris", "days": 2}', {"city": "Paris"}, "", None, "null"]


@pytest.mark.parametrize("version", ["0.20.1", "0.22.0", "0.23.0"])
def test_malformed_arguments_fail_pristine_and_become_empty_patched(catalogue, release_sessions, version, caplog):
    pristine, patched = _pair(catalogue, release_sessions, version)
    for arguments in MALFORMED:
        with pytest.raises(json.JSONDecodeError):
            arguments_after(pristine, arguments)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert arguments_after(patched, arguments) == {}
        (record,) = caplog.records
        assert "not valid JSON" in record.getMessage() and "get_weather" in record.getMessage()


@pytest.mark.parametrize("version", ["0.20.1", "0.22.0", "0.23.0"])
def test_valid_object_arguments_are_decoded_as_before(catalogue, release_sessions, version):
    pristine, patched = _pair(catalogue, release_sessions, version)
    for arguments in ['{"city": "Paris", "days": 2}', {"city": "Paris"}, ""]:
        assert arguments_after(patched, arguments) == arguments_after(pristine, arguments)
    assert arguments_after(patched, '{"city": "Paris", "days": 2}') == {"city": "Paris", "days": 2}


def test_patched_rollback_pin_behaves_as_upstreams_fix(catalogue, release_sessions, upstream, caplog):
    _, patched = _pair(catalogue, release_sessions, "0.20.1")
    for arguments in [*MALFORMED, *NOT_AN_OBJECT, *UNCHANGED, [1, 2]]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            expected = arguments_after(upstream, arguments)
            upstream_warned = len(caplog.records)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert arguments_after(patched, arguments) == expected, arguments
        assert len(caplog.records) == upstream_warned, arguments
    # and the pristine rollback pin hands a template something that is not a mapping
    pristine, _ = _pair(catalogue, release_sessions, "0.20.1")
    assert arguments_after(pristine, "[1, 2]") == [1, 2]
    assert arguments_after(upstream, "[1, 2]") == {}


def render(conversation):
    """kiln's baked Qwen3.6 template, rendered as transformers does (trim/lstrip blocks)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(TEMPLATE).render(messages=conversation, add_generation_prompt=True)


def test_the_baked_template_renders_the_patched_history(catalogue, release_sessions):
    pristine, patched = _pair(catalogue, release_sessions, "0.20.1")
    for arguments, parameter in (('{"city": "Paris"', None), ("[1, 2]", None), ('{"city": "Paris"}', "city")):
        conversation = history(arguments)
        patched(conversation)
        out = render(conversation)
        assert "<function=get_weather>" in out and out.endswith("<|im_start|>assistant\n<think>\n")
        assert ("<parameter=city>" in out) == (parameter == "city")
    conversation = history("[1, 2]")
    pristine(conversation)  # a list passes through to the template, whose `|items` refuses it
    with pytest.raises(TypeError):
        render(conversation)


def test_other_messages_and_empty_tool_calls_untouched(catalogue, release_sessions):
    pristine, patched = _pair(catalogue, release_sessions, "0.20.1")
    for conversation in (
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        [{"role": "assistant", "content": "x", "tool_calls": []}],
    ):
        a, b = copy.deepcopy(conversation), copy.deepcopy(conversation)
        pristine(a)
        patched(b)
        assert a == b


def test_verdicts(catalogue, release_sessions, sessions):
    old = sessions("v0.20.1")
    assert_applies_once(catalogue, old, "PN73")

    for label, where in (("v0.33.0", "renderers/chat_utils/chat_message.py:739"),):
        new = sessions(label)
        outcome = isolated_run(catalogue, new, BuildTarget(new.tree.vllm_version), "PN73").outcomes["PN73"]
        assert outcome.verdict is Verdict.UPSTREAM, outcome.detail
        assert outcome.detail.startswith(where)
    fixed = release_sessions("0.29.0")
    outcome = isolated_run(catalogue, fixed, BuildTarget(fixed.tree.vllm_version), "PN73").outcomes["PN73"]
    assert outcome.verdict is Verdict.UPSTREAM and outcome.detail.startswith(f"{TARGET}:"), outcome.detail
