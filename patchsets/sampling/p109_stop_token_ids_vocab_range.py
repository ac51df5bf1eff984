"""P109: out-of-vocabulary ``stop_token_ids`` are rejected with a 400, not with a dead engine.

What fails on 0.20.1: ``SamplingParams.verify`` range-checks ``logit_bias`` (and
``allowed_token_ids``) but not ``stop_token_ids``, which the OpenAI chat and completion
endpoints accept from the client as plain integers (``chat_completion/protocol.py:196``,
``completion/protocol.py:75``). They end up in ``all_stop_token_ids``, and for a request with
``min_tokens > 0`` the V1 sampler's ``MinTokensLogitsProcessor`` uses them as column indices:
``logits.index_put_((rows, stop_token_ids), -inf)`` (``v1/sample/logits_processor/builtin.py``,
``apply`` and ``apply_with_spec_decode``). An id ``>= vocab_size`` (or below ``-vocab_size``)
is an out-of-bounds index: a CUDA device-side assert that kills the engine core, every rank,
and every request in flight; one request ``{"min_tokens": 1, "stop_token_ids": [10**9]}``
is enough. Reported in production on 0.20.0 (gonka-ai/gonka#1170) and as vllm#54195;
nothing about it is model-specific.

What the patch does: ``SamplingParams`` gets ``_validate_stop_token_ids`` (ids must lie in
``[0, model_config.get_vocab_size())``, the width of the logits tensor, the same bound
``_validate_logit_bias`` uses) and ``verify`` calls it right after the ``logit_bias`` check.
The request is refused with ``VLLMValidationError`` (HTTP 400) before it is scheduled. Only
client-supplied ids are checked: ``verify`` runs before the generation config's EOS ids are
merged in, and those are in range anyway. ``logprob_token_ids`` (the scoring API's field,
not exposed by the chat and completion endpoints on 0.20.1) and the V2 runner's Triton
``_bias_kernel`` mask of vllm#42614 are left out.

Upstream: vllm#42614 (closed unmerged) was superseded by vllm#54196 (merged), first released
in 0.29.0: ``SamplingParams._validate_stop_token_ids``, called from ``verify``.

Verdicts: 0.20.1 APPLIES. 0.33.0 UPSTREAM: ``sampling_params.py`` defines its own
``SamplingParams._validate_stop_token_ids`` (line 1050, same bound) and ``verify`` calls it
(line 914); ``upstream_fix`` finds both and names the lines.

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1-0.28.0: APPLIES: ``SamplingParams.verify`` range-checks ``logit_bias`` but not
  ``stop_token_ids`` (0.28.0's ``sampling_params.py`` has no ``_validate_stop_token_ids``).
- 0.29.0 on: UPSTREAM: vllm#54196 added ``SamplingParams._validate_stop_token_ids``
  (``sampling_params.py:874``, called from ``verify`` at ``:803`` on 0.29.0; ``:1050`` and ``:914``
  on 0.33.0), the same bound this patch uses.
"""

import libcst as cst
import libcst.matchers as m

from kiln.patch.anchor import find
from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import (
    cls,
    func,
    insert_after,
    marked,
    place,
    statements,
    unmarked,
    with_marker,
)

TARGET = "sampling_params.py"
PARAMS = cls("SamplingParams")
VALIDATOR = "_validate_stop_token_ids"


def _self_call(name: str, **kwargs) -> m.SimpleStatementLine:
    """The statement ``self.<name>(...)``."""
    return m.SimpleStatementLine(
        body=[m.Expr(value=m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(name))))],
        **kwargs,
    )


def _methods(source: str) -> list[cst.FunctionDef]:
    """Parse methods written at class-body indentation."""
    (holder,) = statements("class _:\n" + source)
    return [method.with_changes(leading_lines=[]) for method in holder.body.body]


class AddStopTokenIdsValidator(Codemod):
    """``SamplingParams._validate_stop_token_ids``, next to ``_validate_logit_bias``."""

    target = TARGET
    anchor = (PARAMS, func("_validate_logit_bias"))
    patched = (PARAMS, func(VALIDATOR, leading_lines=marked("P109")))

    def rewrite(self, node):
        (method,) = _methods(
            '''
    def _validate_stop_token_ids(self, model_config: ModelConfig) -> None:
        """Validate that stop_token_ids are within the vocabulary range."""
        if not self.stop_token_ids:
            return

        # The sampler uses them as column indices into the logits tensor (min_tokens
        # masking), whose width is the model's vocab size: the bound logit_bias uses.
        vocab_size = model_config.get_vocab_size()
        invalid_token_ids = [
            token_id
            for token_id in self.stop_token_ids
            if token_id < 0 or token_id >= vocab_size
        ]
        if invalid_token_ids:
            raise VLLMValidationError(
                f"token_id(s) {invalid_token_ids} in stop_token_ids contain "
                f"out-of-vocab token ids. Vocabulary size: {vocab_size}",
                parameter="stop_token_ids",
                value=invalid_token_ids,
            )
'''
        )
        why = "an out-of-vocab stop token id is a logits index out of bounds (device assert)"
        return insert_after(node, with_marker(method, "P109", why))


class CallStopTokenIdsValidator(Codemod):
    """``verify`` checks the stop token ids right after the logit_bias ids."""

    target = TARGET
    anchor = (PARAMS, func("verify"), _self_call("_validate_logit_bias"))
    patched = (PARAMS, func("verify"), _self_call(VALIDATOR, leading_lines=marked("P109")))

    def rewrite(self, node):
        (call,) = statements("self._validate_stop_token_ids(model_config)")
        why = "refuse out-of-vocab stop_token_ids before the request reaches the sampler"
        return insert_after(node, with_marker(call, "P109", why), blank_line=False)


class P109(Patch):
    id = "P109"
    family = "sampling"
    title = "Reject out-of-vocab stop_token_ids in SamplingParams.verify (min_tokens crash)"
    why = (
        "stop_token_ids from the client are not range-checked; with min_tokens > 0 the sampler "
        "indexes the logits with them, and one id >= vocab_size is a CUDA device assert that "
        "kills the engine for every request."
    )
    upstream_refs = ("vllm#42614", "vllm#54196", "vllm#54195")
    written_for = ">=0.20.1"
    edits = (AddStopTokenIdsValidator, CallStopTokenIdsValidator)

    def upstream_fix(self, module_of) -> str | None:
        module = module_of(TARGET)
        if module is None:
            return None
        upstream_validator = func(VALIDATOR, leading_lines=unmarked("P109"))
        validators = [v for params in find(module, PARAMS) for v in find(params, upstream_validator)]
        calls = [
            c
            for params in find(module, PARAMS)
            for verify in find(params, func("verify"))
            for c in find(verify, _self_call(VALIDATOR))
            if not m.matches(c, _self_call(VALIDATOR, leading_lines=marked("P109")))
        ]
        if not (validators and calls):
            return None
        return (
            f"{place(TARGET, module, validators[0])}: SamplingParams.{VALIDATOR} (vllm#54196), "
            f"called from verify at {place(TARGET, module, calls[0])}"
        )
