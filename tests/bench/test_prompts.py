"""The prompt set is fixed under its version, and covers what spec-decode acceptance depends on."""

from __future__ import annotations

import pytest

from kiln.bench.prompts import PROMPT_SET_VERSION, PROMPTS, prompt_set_sha256, select_prompts
from kiln.errors import KilnError

# The hash of each released version's texts. Editing a prompt (or kiln/bench/texts.py) without
# a new PROMPT_SET_VERSION fails here: figures from two different sets must not be compared.
RELEASED = {"kiln-bench-1": "2daed8febffe00caf069f33b5303d8b2faa432b680686095a4f6d8e4741fe5f0"}


def test_the_texts_are_those_of_the_version():
    assert prompt_set_sha256() == RELEASED[PROMPT_SET_VERSION], (
        "the prompt set changed: bump PROMPT_SET_VERSION and record the new hash here")


def test_the_set_crosses_short_and_long_inputs_and_outputs_with_prose_and_code():
    assert len({p.id for p in PROMPTS}) == len(PROMPTS)
    words = {p.id: len(p.user.split()) for p in PROMPTS}
    for kind in ("prose", "code"):
        mine = [p for p in PROMPTS if p.kind == kind]
        assert any(words[p.id] > 300 for p in mine) and any(words[p.id] < 60 for p in mine), kind
        assert any(p.max_tokens >= 800 for p in mine) and any(p.max_tokens < 800 for p in mine), kind


def test_a_unique_prefix_changes_only_the_first_line():
    prompt = PROMPTS[0]
    plain, prefixed = prompt.messages(), prompt.messages("[request 1]\n")
    assert prefixed[0]["content"] == "[request 1]\n" + plain[0]["content"]
    assert prefixed[1] == plain[1]


def test_selecting_prompts_by_id():
    assert [p.id for p in select_prompts(["long-code", "short-prose", "long-code"])] == ["long-code", "short-prose"]
    assert select_prompts(None) == PROMPTS
    with pytest.raises(KilnError, match=r"^--prompts: unknown prompt 'poem' \(known: short-prose, "):
        select_prompts(["poem"])
