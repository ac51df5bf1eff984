"""PN367: a CUDA graph capture that frees memory does not make the graph estimate negative.

What fails: with ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`` on (its default, ``envs.py:1736-1737``
on 0.20.1) the worker takes an estimate of the CUDA graphs' memory off the KV cache budget:
``available_kv_cache_memory_bytes = requested - non_kv_cache_memory -
cudagraph_memory_estimate_applied`` (``v1/worker/gpu_worker.py:385``, ``:399-403``,
``:421-425`` on 0.20.1). The V1 runner's ``GPUModelRunner.profile_cudagraph_memory`` measures
each sample as free memory before minus free memory after a capture
(``mem_samples.append(mem_before - free_after)``, ``v1/worker/gpu_model_runner.py:6006``) and
takes the first sample of each mode as that mode's shared cost unclamped (``:6008``, ``:6012``;
the per-graph cost is floored at 1 MiB, ``:6010``); the total is the largest shared cost plus the
per-graph costs (``:6039-6041``), returned as is (``:6047``). A capture after which more memory is
free than before (the caching allocator consolidating or releasing blocks, buffers made lazily
and collected between the two readings, vllm#44740 with MTP) gives a negative sample, and a
negative first sample in every mode gives a negative total: the worker then *adds* its size to
the KV cache, which is sized past what the card holds once the real graphs are captured.

What the patch does: each sample is ``max(mem_before - free_after, 0)``: a capture is never
counted as giving memory back. Every term of the total is then at least 0, so the estimate can
only lower the KV budget, never raise it. A capture that allocates is measured as before. The
same clamp as vllm#44745's (``mem_samples.append(max(delta, 0))``; in no release of the train),
and the one 0.33.0 puts on its V2 runner's total (``v1/worker/gpu/cudagraph_utils.py:1009``,
which also floors the per-graph cost, ``:1038``) and on its V1 runner's encoder sample
(``gpu_model_runner.py:6374``).
Written anew after Genesis PN367 (which vendors vllm#44745 with a warning and a 1 MiB floor on
the first sample); the floor is left out: the per-graph floor already keeps a total with more
than one graph above 0, and a first sample clamped to 0 books no more than what was measured.

Which runner: 0.20.1 runs the V1 runner (``VLLM_USE_V2_MODEL_RUNNER`` defaults to 0,
``envs.py:1687-1689``), so this is the profile kiln's images run there. On 0.33.0
``VllmConfig.use_v2_model_runner`` (``config/vllm.py:731-767``) picks the V2 runner unless
``VLLM_USE_V2_MODEL_RUNNER=0`` or a feature V2 lacks (``:3053-3087``: suffix or custom-class
drafters, EAGLE parallel drafting, heterogeneous-vocabulary drafts, external-launcher pipeline
parallelism, some dual-batch-overlap setups) is asked for; the images' MTP with prefix caching
is none of them, so they run V2 (``v1/worker/gpu/model_runner.py:1069-1073`` calls the clamped
``cudagraph_utils.profile_cudagraph_memory``). 0.33.0's V1 function still appends the raw
sample (``gpu_model_runner.py:6349``): the patch applies there and is inert for the images,
reached only with ``VLLM_USE_V2_MODEL_RUNNER=0`` or one of those features. On vLLM's CPU build
it is never called: the CPU worker's own ``determine_available_memory``
(``v1/worker/cpu_worker.py:204`` on 0.32.0) sizes the KV cache without it.

Upstream: vllm#44745 (open when Genesis vendored it; in no release up to 0.33.0). ``upstream``
recognises an unmarked ``mem_samples.append(max(...))`` in the V1 function, that PR's form.

Verdicts: 0.20.1 APPLIES, 0.33.0 APPLIES (``gpu_model_runner.py:6006`` and ``:6349``).

Verdicts across releases (``patchsets/release-train.toml``, reviewed on every release
0.20.1-0.33.0):
- 0.20.1 on: APPLIES: every release's V1 ``profile_cudagraph_memory`` appends the raw sample.
"""

import libcst as cst
import libcst.matchers as m

from kiln.patch.model import Codemod, Patch
from kiln.patch.shapes import cls, func, marked, unmarked, with_marker

TARGET = "v1/worker/gpu_model_runner.py"
RUNNER = cls("GPUModelRunner")
PROFILE = func("profile_cudagraph_memory")
WHY = "a capture that frees memory counts as 0, so the graph estimate never enlarges the KV cache"


def _append_sample(value: m.BaseExpression, **kwargs) -> m.SimpleStatementLine:
    """``mem_samples.append(<value>)``"""
    append = m.Attribute(value=m.Name("mem_samples"), attr=m.Name("append"))
    return m.SimpleStatementLine(body=[m.Expr(m.Call(func=append, args=[m.Arg(value)]))], **kwargs)


# `mem_before - free_after`: one capture's measured cost, negative when it freed memory
RAW_SAMPLE = m.BinaryOperation(left=m.Name("mem_before"), operator=m.Subtract(), right=m.Name("free_after"))
CLAMPED = m.Call(func=m.Name("max"))


class ClampCaptureSample(Codemod):
    """``mem_samples.append(mem_before - free_after)`` -> ``mem_samples.append(max(mem_before - free_after, 0))``."""

    target = TARGET
    anchor = (RUNNER, PROFILE, _append_sample(RAW_SAMPLE))
    patched = (RUNNER, PROFILE, _append_sample(CLAMPED, leading_lines=marked("PN367")))
    upstream = (RUNNER, PROFILE, _append_sample(CLAMPED, leading_lines=unmarked("PN367")))

    def rewrite(self, node):
        expr = node.body[0]
        (sample,) = expr.value.args
        clamp = cst.Call(func=cst.Name("max"), args=[cst.Arg(sample.value, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))), cst.Arg(cst.Integer("0"))])
        append = expr.value.with_changes(args=[sample.with_changes(value=clamp)])
        return with_marker(node.with_changes(body=[expr.with_changes(value=append)]), "PN367", WHY)


class PN367(Patch):
    id = "PN367"
    family = "memory"
    title = "CUDA graph memory estimate: a capture that frees memory counts as 0, not as a negative cost"
    why = (
        "The V1 runner's profile of CUDA graph memory takes free-before minus free-after of a "
        "capture as its cost; a capture that frees memory gives a negative sample, and a negative "
        "total is added to the KV cache budget, sized past what the card holds. Clamp each "
        "sample at 0, as vllm#44745 does (0.33.0's V2 runner clamps its total)."
    )
    upstream_refs = ("vllm#44740", "vllm#44745")
    written_for = ">=0.20.1"
    edits = (ClampCaptureSample,)
