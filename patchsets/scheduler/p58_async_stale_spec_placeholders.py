"""P58: a request that sat out a step does not carry async ``-1`` draft placeholders to the GPU.

What fails on 0.20.1: with async scheduling (on by default with MTP/EAGLE) the scheduler
never sees the drafts; after scheduling a decode, ``AsyncScheduler._update_after_schedule``
sets ``request.spec_token_ids`` to ``[-1] * num_spec_tokens`` (``v1/core/sched/
async_scheduler.py:35``) and the next ``schedule()`` ships them in
``scheduled_spec_decode_tokens``. The V1 model runner writes them into ``token_ids_cpu``
(``v1/worker/gpu_input_batch.py:486``) and relies on ``_prepare_input_ids`` to overwrite
them on the GPU with the drafts it proposed in the previous step, which it does only for
requests of the previous batch: ``if prev_index < 0: continue``
(``v1/worker/gpu_model_runner.py:1642``). A running request that sits out one step keeps its
placeholders (the token budget went to a prefill chunk ahead of it in ``running``, which is
where a request resumed after preemption lands; an encoder budget or cache limit), and when
it is scheduled again it is re-added to the persistent batch with ``prev_index == -1``: the
``-1`` ids reach the embedding. With TP=1 that is ``vectorized_gather_kernel: ind >= 0``, a
device-side assert that kills the engine; under TP the masked vocab-parallel lookup turns them
into zero embeddings and garbage drafts (vllm#37159, #40756; reported as the spec-decode
degenerate loops of #40807/#40831). Long contexts on 24 GB cards preempt often, which is what
puts a decode behind a prefill chunk.

What the patch does: at the top of the running-request loop of ``Scheduler.schedule``, a
request that was not scheduled in the previous step and still holds ``-1`` placeholders drops
them before its token count is computed, so it is scheduled as a plain one-token decode (the
drafts those placeholders stood for are gone: the runner's draft buffer was overwritten by the
step it sat out) and the drafter proposes again in that step. Requests of the previous batch
are untouched, so the common path keeps every draft. Not applied under pipeline parallelism
(its batch queue interleaves steps, and its placeholder cadence is not this one) nor with the
V2 model runner, which takes draft ids from its own GPU request state
(``v1/worker/gpu/model_runner.py``) and only the count from the scheduler.

Upstream: not fixed. vllm#40768 (a per-request placeholder counter materialised only for the
previous batch) and vllm#46899 (clear stale placeholders) were both closed unmerged; 0.33.0's
``AsyncScheduler._update_after_schedule`` still assigns the shared placeholder list
(``async_scheduler.py:49``), ``schedule()`` ships it unchanged (``scheduler.py:1010-1025``), and
the V1 runner still skips requests with ``prev_index < 0`` (``gpu_model_runner.py:1784``).

Verdicts: 0.20.1 APPLIES; 0.33.0 APPLIES (same loop, same anchor; on 0.33.0 the V1 runner is
the fallback when the V2 runner does not support the configuration or
``VLLM_USE_V2_MODEL_RUNNER=0``).

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1-0.33.0: APPLIES. Neither the failure nor the anchor moves: ``AsyncScheduler``
  hands every scheduled decode the shared placeholder list (``v1/core/sched/async_scheduler.py:35``
  on 0.20.1, ``:44`` on 0.26.0, ``:49`` on 0.33.0) and the V1 runner still skips requests that
  were not in the previous batch (``v1/worker/gpu_model_runner.py:1642``, ``:1801``, ``:1784``).
  No release drops stale placeholders (vllm#40768 and #46899 were closed unmerged).
"""

import libcst.matchers as m

from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import cls, func, insert_after, marked, statements, with_marker

TARGET = "v1/core/sched/scheduler.py"
SCHEDULE = (cls("Scheduler"), func("schedule"))

# `request = self.running[req_index]`: the first statement of the running-request loop
RUNNING_REQUEST = m.SimpleStatementLine(
    body=[
        m.Assign(
            targets=[m.AssignTarget(target=m.Name("request"))],
            value=m.Subscript(
                value=m.Attribute(value=m.Name("self"), attr=m.Name("running")),
                slice=[m.SubscriptElement(slice=m.Index(value=m.Name("req_index")))],
            ),
        )
    ]
)

GUARD = """
if (
    request.spec_token_ids
    and request.request_id not in self.prev_step_scheduled_req_ids
    and -1 in request.spec_token_ids
    and not self.use_v2_model_runner
    and not self.use_pp
):
    # The request sat out the previous step: the drafts these async placeholders stand
    # for were overwritten on the GPU, and the runner fills placeholders only for
    # requests of the previous batch. Schedule a plain decode; it drafts again.
    request.spec_token_ids = []
"""


class DropStalePlaceholders(Codemod):
    target = TARGET
    anchor = (*SCHEDULE, RUNNING_REQUEST)
    patched = (*SCHEDULE, m.If(leading_lines=marked("P58")))

    def rewrite(self, node):
        (guard,) = statements(GUARD)
        why = "-1 draft placeholders of a request absent from the previous batch would reach the embedding"
        return insert_after(node, with_marker(guard, "P58", why), blank_line=False)


class P58(Patch):
    id = "P58"
    family = "scheduler"
    title = "Async spec decode: no -1 draft placeholders for a request that sat out a step"
    why = (
        "Under async scheduling a running request that misses one step keeps its [-1]*k draft "
        "placeholders; scheduled again, it is not in the previous batch, the V1 runner does not "
        "overwrite them, and -1 reaches the embedding (device assert at TP=1, garbage under TP)."
    )
    upstream_refs = ("vllm#40768", "vllm#46899", "vllm#37159", "vllm#40807")
    written_for = ">=0.20.1"
    edits = (DropStalePlaceholders,)
