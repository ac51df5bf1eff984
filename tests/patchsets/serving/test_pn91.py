"""PN91 on real 0.20.1 source: a developer message renders through Qwen3.6's chat template.

Behaviour test running extracted code: vLLM 0.20.1's own ``safe_apply_chat_template``
(``renderers/hf.py``, the definition after its two ``@overload`` stubs), pristine and patched
(with the patch's ``_developer_messages_as_system``), rendering kiln's real baked template
``images/files/chat-templates/qwen3.6.jinja``. Stood in: ``resolve_chat_template`` (returns the
template it is given, as it does for ``--chat-template``), ``resolve_chat_template_kwargs``
(passes the kwargs through), the logger, and the tokenizer, whose ``apply_chat_template``
renders with a jinja2 sandbox the way transformers does (``trim_blocks``, ``lstrip_blocks``,
``raise_exception``). 0.33.0 is checked through its verdict: vLLM's own conversion.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
import pytest

from tests.patchsets.support.patchlib import (
    assert_applies_once,
    assert_upstream,
    patched_files,
    run_defs,
)

HF = "renderers/hf.py"
TEMPLATE = (Path(__file__).parents[3] / "images/files/chat-templates/qwen3.6.jinja").read_text()


class TemplateError(Exception):
    """What the template's raise_exception raises (transformers: a jinja2 TemplateError)."""


class Tokenizer:
    def apply_chat_template(self, conversation, tools=None, chat_template=None, tokenize=False, **kwargs):
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )

        def raise_exception(message):
            raise TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        return env.from_string(chat_template).render(messages=conversation, tools=tools, **kwargs)


def _apply_function(source: str):
    """The real ``safe_apply_chat_template`` (and the patch's helper, when there) of ``source``."""
    helper = "_developer_messages_as_system"
    ns = run_defs(source, ["safe_apply_chat_template", helper], {
        "Any": object,
        "HfTokenizer": object,
        "ConversationMessage": dict,
        "ChatTemplateResolutionError": ValueError,
        "logger": logging.getLogger("vllm.renderers.hf"),
        "resolve_chat_template": lambda tokenizer, chat_template, tools, model_config: chat_template,
        "resolve_chat_template_kwargs": lambda tokenizer, chat_template, chat_template_kwargs: chat_template_kwargs,
    }, HF, optional=(helper,))
    return ns["safe_apply_chat_template"], helper in ns


@pytest.fixture(scope="module")
def patched(catalogue, sessions):
    apply, has_helper = _apply_function(patched_files(catalogue, sessions("v0.20.1"), "PN91")[HF])
    assert has_helper
    return apply


@pytest.fixture(scope="module")
def pristine(sessions):
    apply, has_helper = _apply_function(sessions("v0.20.1").tree.read(HF))
    assert not has_helper
    return apply


def render(apply, conversation, template=TEMPLATE):
    return apply(None, Tokenizer(), conversation, chat_template=template, tokenize=False,
                 add_generation_prompt=True)


DEVELOPER_FIRST = [
    {"role": "developer", "content": "Answer in French."},
    {"role": "user", "content": "Hello"},
]


def test_pristine_fails_on_a_developer_message(pristine):
    with pytest.raises(ValueError, match="Unexpected message role"):
        render(pristine, DEVELOPER_FIRST)


def test_developer_message_renders_as_the_system_message(patched, pristine):
    out = render(patched, DEVELOPER_FIRST)
    system_first = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"}]
    assert out == render(pristine, system_first)
    assert out.startswith("<|im_start|>system\nAnswer in French.<|im_end|>\n<|im_start|>user\nHello")


def test_system_and_later_developer_messages_merge_at_the_front(patched, pristine):
    conversation = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi."},
        {"role": "developer", "content": [{"type": "text", "text": "Answer in French."}]},
        {"role": "user", "content": "Again"},
    ]
    with pytest.raises(ValueError):  # pristine: developer role, and a system message not first
        render(pristine, conversation)
    out = render(patched, conversation)
    assert out.startswith("<|im_start|>system\nYou are terse.\n\nAnswer in French.<|im_end|>\n<|im_start|>user\nHello")
    assert out.count("<|im_start|>system") == 1
    assert "<|im_start|>user\nAgain<|im_end|>" in out


def test_conversation_without_developer_is_untouched(patched, pristine):
    conversation = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hello"}]
    assert render(patched, conversation) == render(pristine, conversation)


def test_template_that_knows_the_role_gets_it(patched):
    template = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{# 'developer' handled #}"
    assert render(patched, DEVELOPER_FIRST, template) == "[developer:Answer in French.][user:Hello]"


def test_verdicts(catalogue, sessions):
    old = sessions("v0.20.1")
    assert_applies_once(catalogue, old, "PN91")

    new = sessions("v0.33.0")
    detail = assert_upstream(catalogue, new, "PN91")
    assert "renderers/hf.py:604" in detail
