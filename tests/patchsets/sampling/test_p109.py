"""P109 on real 0.20.1 source: an out-of-vocab stop token id is refused before the sampler sees it.

Behaviour test running real vLLM code extracted from the trees (the modules themselves import
msgspec, pydantic and the whole config package). What is real vLLM 0.20.1 code:
- ``SamplingParams.verify`` and the validators it calls for ids (``_validate_logprobs``,
  ``_validate_logit_bias`` and, patched, ``_validate_stop_token_ids``), pristine and patched,
  executed as methods of a small holder class carrying the request's fields;
- ``VLLMValidationError`` (the whole ``exceptions.py``, executed);
- the V1 sampler's ``MinTokensLogitsProcessor`` and ``process_dict_updates``
  (``v1/sample/logits_processor/builtin.py``), run on CPU torch: the step a min_tokens request
  with such an id reaches. On CPU the out-of-bounds index raises ``IndexError``; on CUDA the
  same ``index_put_`` is a device-side assert that takes the engine down.
What is stood in: ``ModelConfig`` (vocab size and max_logprobs), the four validators of
``verify`` that never look at token ids (logits processors, allowed_token_ids with no
tokenizer, spec decode, structured outputs: no-ops here), the ``BatchUpdate`` of one added
request, and the processor's ``LogitsProcessor`` base (an interface).
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from tests.patchsets.support.patchlib import (
    assert_applies_once,
    assert_upstream,
    extract,
    patched_files,
)

PARAMS = "sampling_params.py"
BUILTIN = "v1/sample/logits_processor/builtin.py"
VOCAB = 248320  # Qwen3.6's padded vocab (the logits width)


def _exec(source: str, names: list[str], namespace: dict) -> dict:
    for name in names:
        exec(compile(extract(source, name), f"<{name}>", "exec"), namespace)
    return namespace


def _error_cls(tree):
    """The real VLLMValidationError: ``exceptions.py`` imports only the standard library."""
    namespace: dict = {}
    exec(compile(tree.read("exceptions.py"), "vllm/exceptions.py", "exec"), namespace)
    return namespace["VLLMValidationError"]


def _params_cls(source: str, error_cls, *, patched: bool) -> type:
    """A class with the real verify() and id validators of ``source``."""
    names = ["verify", "_validate_logprobs", "_validate_logit_bias"]
    if patched:
        names.append("_validate_stop_token_ids")
    ns = _exec(
        source,
        [f"SamplingParams.{name}" for name in names],
        {"VLLMValidationError": error_cls, "ModelConfig": object, "Any": Any},
    )
    methods = {name: ns[name] for name in names}
    for name in (
        "_validate_logits_processors",
        "_validate_allowed_token_ids",
        "_validate_spec_decode",
        "_validate_structured_outputs",
    ):
        methods[name] = lambda self, *args: None

    def __init__(self, stop_token_ids=(), min_tokens=0, logit_bias=None):
        self.stop_token_ids = list(stop_token_ids)
        self.min_tokens = min_tokens
        self.logit_bias = logit_bias
        self.logprobs = None
        self.prompt_logprobs = None
        self.all_stop_token_ids = set(stop_token_ids)

    methods["__init__"] = __init__
    return type("SamplingParams", (), methods)


MODEL_CONFIG = types.SimpleNamespace(max_logprobs=20, get_vocab_size=lambda: VOCAB)


def _verify(params_cls, **fields):
    params = params_cls(**fields)
    params.verify(MODEL_CONFIG, None, None, None)
    return params


@pytest.fixture(scope="module")
def error_cls(sessions):
    return _error_cls(sessions("v0.20.1").tree)


@pytest.fixture(scope="module")
def patched(catalogue, sessions, error_cls):
    text = patched_files(catalogue, sessions("v0.20.1"), "P109")[PARAMS]
    return _params_cls(text, error_cls, patched=True)


@pytest.fixture(scope="module")
def pristine(sessions, error_cls):
    return _params_cls(sessions("v0.20.1").tree.read(PARAMS), error_cls, patched=False)


@pytest.fixture(scope="module")
def min_tokens_processor(sessions):
    """The real MinTokensLogitsProcessor of 0.20.1, on CPU."""
    source = sessions("v0.20.1").tree.read(BUILTIN)
    ns = _exec(
        source,
        ["process_dict_updates", "MinTokensLogitsProcessor"],
        {
            "torch": torch,
            "np": __import__("numpy"),
            "LogitsProcessor": object,
            "BatchUpdate": object,
            "SamplingParams": object,
            "MoveDirectionality": types.SimpleNamespace(SWAP="swap"),
            "Callable": object,
            "Sequence": list,
            "T": Any,
            "TYPE_CHECKING": False,
        },
    )
    return ns["MinTokensLogitsProcessor"]


def _sample_step(processor_cls, params, vocab=VOCAB):
    """One sampler step for a batch holding this single request."""
    processor = processor_cls(None, torch.device("cpu"), False)
    batch_update = types.SimpleNamespace(added=[(0, params, [1, 2, 3], [])], removed=[], moved=[])
    processor.update_state(batch_update)
    return processor.apply(torch.zeros(1, vocab))


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 1, 10**9, -1])
def test_out_of_vocab_stop_token_id_is_refused(patched, error_cls, bad):
    with pytest.raises(error_cls) as caught:
        _verify(patched, stop_token_ids=[151645, bad], min_tokens=1)
    assert caught.value.parameter == "stop_token_ids"
    assert caught.value.value == [bad]
    assert isinstance(caught.value, ValueError)  # 0.20.1 serves ValueErrors as HTTP 400


def test_in_vocab_stop_token_ids_pass(patched, min_tokens_processor):
    params = _verify(patched, stop_token_ids=[0, 151645, VOCAB - 1], min_tokens=2)
    logits = _sample_step(min_tokens_processor, params)
    assert torch.isinf(logits[0, [0, 151645, VOCAB - 1]]).all()  # masked until min_tokens
    assert _verify(patched).stop_token_ids == []


def test_pristine_accepts_the_id_and_the_sampler_step_fails(pristine, min_tokens_processor):
    params = _verify(pristine, stop_token_ids=[10**9], min_tokens=1)  # accepted
    with pytest.raises(IndexError):  # CUDA: device-side assert, engine core dead
        _sample_step(min_tokens_processor, params)


def test_other_validators_still_run_first(patched, error_cls):
    """The new check sits after logit_bias: an invalid logit_bias is reported as before."""
    with pytest.raises(error_cls) as caught:
        _verify(patched, stop_token_ids=[10**9], logit_bias={VOCAB: 1.0})
    assert caught.value.parameter == "logit_bias"


def test_verdicts(catalogue, sessions):
    old = sessions("v0.20.1")
    assert_applies_once(catalogue, old, "P109")

    new = sessions("v0.33.0")
    detail = assert_upstream(catalogue, new, "P109")
    assert "sampling_params.py:1050" in detail and "sampling_params.py:914" in detail
    # and 0.33.0's own validator refuses the same request
    tree = new.tree
    new_error = _error_cls(tree)
    own = _params_cls(tree.read(PARAMS), new_error, patched=True)
    own.verify = lambda self, model_config, *rest: self._validate_stop_token_ids(model_config)
    with pytest.raises(new_error):
        _verify(own, stop_token_ids=[10**9], min_tokens=1)
