"""PN33: the memory profile runs the rejection sampler with the real number of draft tokens.

What fails: vLLM sizes the KV cache from the peak memory of a profile run. The V1 runner's
``GPUModelRunner._dummy_sampler_run`` (``v1/worker/gpu_model_runner.py``), which the profile
run calls on one hidden row per request (``max_num_seqs`` rows), warms the rejection sampler
with **one** draft token per request: ``draft_token_ids = [[0] for _ in range(num_reqs)]``,
so the target logits it allocates (and the draft probabilities, for a probabilistic drafter)
have ``2 * max_num_seqs`` rows. A real spec-decode step with ``num_speculative_tokens = K``
hands the rejection sampler ``(K + 1) * max_num_seqs`` rows of vocabulary-wide logits
(``_calc_spec_decode_metadata``: one per draft plus the bonus token), each cast to fp32 and
turned into probabilities inside the sampler. The difference, ``(K - 1) * max_num_seqs *
vocab`` elements per tensor, is never profiled: the KV cache takes that memory, and the first
full batch of spec-decode steps can run out of it. For Qwen3.6 (vocab 248320) with MTP K=3 it
is about 2 MiB per request for each vocabulary-wide fp32 tensor (the logits' fp32 copy, the
target probabilities): some MiB at kiln's ``--max-num-seqs 4``, half a GiB per such tensor at
vLLM's default 256 (vllm#37521 reports the OOM with EAGLE; Genesis's PN33 cites one with MTP on a
24 GB card).

What the patch does: the dummy drafts are ``num_speculative_tokens`` per request (distinct
ids ``0..K-1``), so the profiled logits and draft probabilities have the runtime's shape
(``(K + 1) * num_reqs`` and ``K * num_reqs`` rows). With ``K = 1`` nothing changes. The value
is read from the speculative config at run time; nothing is model-specific. A config that
gives no K keeps vLLM's one draft: vLLM's own
``tests/v1/worker/test_gpu_model_runner.py::test_dummy_sampler_run_warms_all_greedy_rejection_sampler``
(0.32.0) calls ``_dummy_sampler_run`` with a stand-in config holding only the sampling methods,
and the first version of this patch, which read ``num_speculative_tokens`` as an attribute,
failed it where stock passes (``ci/upstream_tests.py``, 2026-11-26). vllm#37521
(open, unmerged) makes the same change for EAGLE only; the rejection sampler's footprint does
not depend on the drafting method, so the patch covers MTP, n-gram and draft models too.

Which runner: 0.20.1 runs the V1 runner by default (``VLLM_USE_V2_MODEL_RUNNER`` defaults to
0, ``envs.py:1687``). 0.33.0 still ships it (``gpu_model_runner.py:5938`` holds the same
statement, so the patch APPLIES), but ``VllmConfig.use_v2_model_runner`` (``config/vllm.py:731``)
picks the V2 runner unless a feature it lacks is asked for or ``VLLM_USE_V2_MODEL_RUNNER=0``
is set; the V2 runner's ``_dummy_sampler_run`` (``v1/worker/gpu/model_runner.py:993``) does
not run the rejection sampler at all, which this patch does not change (a separate fix).

Upstream: vllm#37521 (open). ``upstream`` recognises an unmarked assignment of the dummy draft
ids that reads ``num_speculative_tokens``.

Verdicts: 0.20.1 APPLIES, 0.33.0 APPLIES (``gpu_model_runner.py:5677`` and ``:5938``).

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1 on: APPLIES: every release's ``_dummy_sampler_run`` builds one dummy draft per request.
"""

import libcst.matchers as m

from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import cls, func, marked, statements, unmarked, with_marker

TARGET = "v1/worker/gpu_model_runner.py"
RUNNER = cls("GPUModelRunner")
DUMMY_SAMPLER_RUN = func("_dummy_sampler_run")
WHY = "profile the rejection sampler with K drafts per request, as a real step runs it"


def _assigns_draft_ids(value: m.BaseExpression, **kwargs) -> m.SimpleStatementLine:
    return m.SimpleStatementLine(
        body=[m.Assign(targets=[m.AssignTarget(target=m.Name("draft_token_ids"))], value=value)], **kwargs
    )


# `draft_token_ids = [[0] for _ in range(num_reqs)]` (0.20.1 ... 0.33.0)
ONE_DRAFT_EACH = _assigns_draft_ids(m.ListComp(elt=m.List(elements=[m.Element(value=m.Integer("0"))])))
# vLLM's own fix would size the dummy drafts from the speculative config.
K_DRAFTS_EACH = _assigns_draft_ids(
    m.MatchIfTrue(lambda expr: bool(m.findall(expr, m.Attribute(attr=m.Name("num_speculative_tokens"))))),
    leading_lines=unmarked("PN33"),
)


class ProfileKDraftsPerRequest(Codemod):
    """The dummy spec-decode batch carries ``num_speculative_tokens`` drafts per request."""

    target = TARGET
    anchor = (RUNNER, DUMMY_SAMPLER_RUN, ONE_DRAFT_EACH)
    patched = (RUNNER, DUMMY_SAMPLER_RUN, _assigns_draft_ids(m.DoNotCare(), leading_lines=marked("PN33")))
    upstream = (RUNNER, DUMMY_SAMPLER_RUN, K_DRAFTS_EACH)

    def rewrite(self, node):
        (k_drafts,) = statements(
            """
            draft_token_ids = [
                list(range(getattr(self.speculative_config, "num_speculative_tokens", None) or 1))
                for _ in range(num_reqs)
            ]
            """
        )
        return with_marker(k_drafts.with_changes(leading_lines=node.leading_lines), "PN33", WHY)


class PN33(Patch):
    id = "PN33"
    family = "spec_decode"
    title = "Memory profile runs the rejection sampler with K drafts per request, not 1"
    why = (
        "The V1 runner's profile warms the rejection sampler with one dummy draft per request, "
        "so (K-1) * max_num_seqs vocabulary-wide logit rows of a real K-token spec-decode step "
        "are never profiled and the KV cache takes that memory. Profile with K drafts."
    )
    upstream_refs = ("vllm#37521",)
    written_for = ">=0.20.1"
    edits = (ProfileKDraftsPerRequest,)
