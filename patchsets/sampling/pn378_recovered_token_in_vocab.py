"""PN378: the rejection sampler's recovered token stays inside the vocabulary on all-NaN rows.

What fails on 0.20.1: when a draft is rejected, the V1 rejection sampler emits a *recovered*
token drawn by ``sample_recovered_tokens_kernel`` (``v1/sample/rejection_sampler.py``). The
kernel walks the vocabulary in tiles of ``BLOCK_SIZE`` = 8192 lanes and keeps the best
``score = prob * inv_q`` of each tile with ``tl.max(score, axis=0, return_indices=True)``.
Lanes past ``vocab_size`` in the last tile (Qwen3.6's 248320 = 30 * 8192 + 2560 leaves 5632)
are loaded as ``0.0``, so they score ``0``. When the target model's logits for a position are
all NaN, every real lane scores NaN; Triton's argmax combine compares with ``>``, which is
false against NaN, so the padding zeros win the last tile and the kernel returns
``recovered_id == vocab_size``. For a request that samples (temperature > 0), a NaN row also
rejects its draft (``target_prob / draft_prob >= u`` is false), so the step's first token is
that id, and ``RejectionSampler.parse_output`` drops ids ``>= vocab_size``
(``rejection_sampler.py:267-269``): the request gets an empty step with drafts scheduled. The
scheduler then skips its accounting (vllm#33729's guard, Genesis's PN133) while the lost
token stays counted as computed, which has stalled requests (vllm#42722) and crashed a
metrics counter (vllm#26372). Greedy requests are not affected (their argmax is torch's).

What the patch does, in the kernel only: the tile's padding lanes score ``-inf`` before the
reduction, so they can never win it; an all-NaN row then keeps the kernel's initial id 0; and
the id is clamped to ``vocab_size - 1`` before the store, the same two statements vLLM
carries from 0.24.0 (vllm#44744, GHSA-8wr5-jm2h-8r4f). Token 0 for an all-NaN row is what
every other vLLM sampler already returns on such rows (greedy and random, with and without
top-k/top-p: the measurements in vllm#42722); the request keeps going and commits a token each
step instead of stalling. Rows without NaN are unchanged: their scores are ``>= 0``, so the
padding's ``0`` never beat them (a tie goes to the lower, real lane), and ``-inf`` cannot.
Genesis's PN378 ports only the mask, from vllm#45060 (closed unmerged); here both statements
follow the fix vLLM shipped.

The V2 model runner (0.33.0's default for kiln's models) samples recovered tokens with other
kernels, which map NaN block maxima to ``-inf`` before their argmax for the same reason
(``v1/worker/gpu/spec_decode/rejection_sampler_utils.py:116-117``, ``:1065-1072`` on 0.33.0);
PN378 does not touch them.

Verdicts: 0.20.1 APPLIES. 0.33.0 UPSTREAM: the kernel masks the padding lanes
(``rejection_sampler.py:1143``) and clamps the id (``:1150``) itself.

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1-0.23.0: APPLIES. The kernel is the same from 0.20.1 to 0.22.1; 0.23.0 only adds the
  ``USE_FP64_GUMBEL`` variant of the running maximum, outside both rewritten statements.
- 0.24.0 on: UPSTREAM: vllm#44744 landed both statements (``rejection_sampler.py:941`` and
  ``:948`` on 0.24.0); later releases only moved them (0.30.0 launches the kernel through a
  warm-up dispatcher, outside its body).
"""

import libcst.matchers as m

from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import func, insert_before, marked, statements, unmarked, with_marker

TARGET = "v1/sample/rejection_sampler.py"
KERNEL = func("sample_recovered_tokens_kernel")


def _tl(name: str) -> m.Attribute:
    return m.Attribute(value=m.Name("tl"), attr=m.Name(name))


# The tile reduction: ``local_max, local_id = tl.max(score, ...)``.
TILE_ARGMAX = m.SimpleStatementLine(
    body=[m.Assign(value=m.Call(func=_tl("max"), args=[m.Arg(m.Name("score")), m.ZeroOrMore()]))]
)
# The store of the kernel's result: ``tl.store(<output pointer>, recovered_id)``.
STORE_RECOVERED = m.SimpleStatementLine(
    body=[m.Expr(value=m.Call(func=_tl("store"), args=[m.Arg(), m.Arg(m.Name("recovered_id")), m.ZeroOrMore()]))]
)


def _padding_mask(**kwargs) -> m.SimpleStatementLine:
    """``score = tl.where(vocab_mask, score, <-inf>)``, however -inf is spelt."""
    call = m.Call(func=_tl("where"), args=[m.Arg(m.Name("vocab_mask")), m.Arg(m.Name("score")), m.Arg()])
    return m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name("score"))], value=call)], **kwargs)


def _clamp(**kwargs) -> m.SimpleStatementLine:
    """``recovered_id = tl.minimum(recovered_id, <bound>)``."""
    call = m.Call(func=_tl("minimum"), args=[m.Arg(m.Name("recovered_id")), m.Arg()])
    return m.SimpleStatementLine(
        body=[m.Assign(targets=[m.AssignTarget(m.Name("recovered_id"))], value=call)], **kwargs
    )


class MaskPaddingLanes(Codemod):
    """Lanes past the vocabulary score -inf before each tile's argmax."""

    target = TARGET
    anchor = (KERNEL, TILE_ARGMAX)
    patched = (KERNEL, _padding_mask(leading_lines=marked("PN378")))
    upstream = (KERNEL, _padding_mask(leading_lines=unmarked("PN378")))

    def rewrite(self, node):
        (mask,) = statements('score = tl.where(vocab_mask, score, float("-inf"))')
        why = "lanes past vocab_size load as 0 and would beat a NaN row: they must never win the argmax"
        head = with_marker(mask.with_changes(leading_lines=node.leading_lines), "PN378", why)
        return insert_before(node.with_changes(leading_lines=[]), head)


class ClampRecoveredId(Codemod):
    """The stored id is at most ``vocab_size - 1``."""

    target = TARGET
    anchor = (KERNEL, STORE_RECOVERED)
    patched = (KERNEL, _clamp(leading_lines=marked("PN378")))
    upstream = (KERNEL, _clamp(leading_lines=unmarked("PN378")))

    def rewrite(self, node):
        (clamp,) = statements("recovered_id = tl.minimum(recovered_id, vocab_size - 1)")
        why = "an id >= vocab_size is dropped by parse_output and leaves the request an empty step"
        head = with_marker(clamp.with_changes(leading_lines=node.leading_lines), "PN378", why)
        return insert_before(node.with_changes(leading_lines=[]), head)


class PN378(Patch):
    id = "PN378"
    family = "sampling"
    title = "Rejection sampler: the recovered token stays in the vocabulary on all-NaN logits"
    why = (
        "On a row of all-NaN logits the recovered-token kernel's padding lanes (score 0) win its "
        "argmax, so it returns vocab_size; parse_output drops that id and the sampling request "
        "gets an empty spec-decode step. Mask the padding to -inf and clamp the id (vllm#44744)."
    )
    upstream_refs = ("vllm#44744", "vllm#45060", "vllm#42722")
    written_for = ">=0.20.1"
    edits = (MaskPaddingLanes, ClampRecoveredId)
